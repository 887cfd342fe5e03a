"""The docs site's generated pages (scripts/mkdocs_hooks.py) say what the code does: every environment variable of
console/settings.py with a meaning, every API operation of the app's schema. `make docs` builds the site itself
(mkdocs build --strict)."""

import ast
import importlib.util
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _hooks():
    spec = importlib.util.spec_from_file_location("mkdocs_hooks", ROOT / "scripts" / "mkdocs_hooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _settings_rows(page: str) -> dict[str, list[str]]:
    rows = {}
    for line in page.splitlines():
        if match := re.match(r"\| `([A-Z0-9_]+)`", line):
            rows.setdefault(match.group(1), [cell.strip() for cell in line.strip("|").split(" | ")])
    return rows


def test_every_setting_read_from_the_environment_is_listed_with_its_default_and_meaning():
    page = _hooks().settings_page()
    rows = _settings_rows(page)
    tree = ast.parse((ROOT / "console" / "settings.py").read_text())
    names = {
        node.args[0].value
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id.startswith("env_")
        and node.args
        and isinstance(node.args[0], ast.Constant)
    }
    assert len(names) > 90  # the walk found the settings, not nothing
    assert names <= set(rows)
    no_meaning = sorted(name for name in names if not rows[name][3])
    assert not no_meaning, f"say what these are in a comment beside or above them in console/settings.py: {no_meaning}"
    assert rows["GATEWAY_QUEUE_DEPTH"][1:4] == ["`256`", "int", "in-flight requests per endpoint before 429"]
    assert rows["SECRET_KEY"][0] == "`SECRET_KEY` (or `SECRET_KEY_FILE`)"  # a secret may come from a file
    # Variables read outside settings.py are listed with the module that reads them.
    assert "| `CONSOLE_ADMIN_PASSWORD_FILE` |" in page and "ensure_admin.py" in page


def test_the_api_page_lists_every_operation_of_the_schema():
    hooks = _hooks()
    schema = hooks.openapi_schema()
    page = hooks.api_page(schema)
    operations = [
        f"### `{method.upper()} {path}`"
        for path, item in schema["paths"].items()
        for method in item
        if method != "parameters"
    ]
    assert len(operations) > 50
    assert [op for op in operations if op not in page] == []
    for name in schema["components"]["schemas"]:
        assert f"### {name}\n" in page
