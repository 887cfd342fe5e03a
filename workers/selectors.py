"""Reads for nodes and devices (the job runtime's reads are in workers.jobs.selectors)."""
