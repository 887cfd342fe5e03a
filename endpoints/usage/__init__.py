"""Usage and budgets, the console's side (docs/usage.md): the usage API and CSV, accelerator-hours per team, the
usage page, and the budgets' API and forms. The gateway writes the rows (endpoints.gateway: UsageHour) and enforces
the budgets (endpoints.gateway.limits); this package reads the one and manages the other."""
