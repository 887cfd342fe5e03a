"""The usage rows as CSV, with the benchmark comparison's neutraliser (endpoints.bench.compare.csv_text): a text cell
that a spreadsheet would read as a formula (= + - @, tab, CR) gets a leading single quote."""

import csv
import io

from endpoints.bench.compare import csv_text


def usage_csv(columns: list[str], rows: list[dict]) -> str:
    out = io.StringIO()
    writer = csv.writer(out)
    writer.writerow(columns)
    for row in rows:
        writer.writerow([_cell(row.get(c)) for c in columns])
    return out.getvalue()


def _cell(value):
    if value is None:
        return ""
    return csv_text(value) if isinstance(value, str) else value
