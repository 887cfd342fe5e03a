"""MkDocs hooks (mkdocs.yml `hooks:`): the pages generated from the code at each build, so they cannot drift.

- `api.md` and `openapi.json`: the REST API, from the Django app's own OpenAPI schema (django-ninja's
  `api.get_openapi_schema()`, what `/api/v1/openapi.json` serves).
- `settings.md`: every environment variable the console reads, with its default and the comment above it in
  `console/settings.py` (read with `ast`, not imported), then those read elsewhere (`env_*` helpers or
  `os.environ.get` with a literal name), and the parsing rules of `console/env.py`'s helpers.
"""

from __future__ import annotations

import ast
import json
import os
import sys
import tempfile
from pathlib import Path

from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parent.parent
SETTINGS = ROOT / "console" / "settings.py"
ENV = ROOT / "console" / "env.py"
SCANNED = ("console", "endpoints", "models_registry", "workers")
HTTP_METHODS = ("get", "post", "put", "patch", "delete")


def on_files(files, config):
    files.append(File.generated(config, "api.md", content=api_page(openapi_schema())))
    files.append(File.generated(config, "openapi.json", content=json.dumps(openapi_schema(), indent=2)))
    files.append(File.generated(config, "settings.md", content=settings_page()))
    return files


# --- the API ---------------------------------------------------------------------------------------------------

_schema_cache: dict = {}


def openapi_schema() -> dict:
    """The app's schema, built once per build. A throwaway DATA_DIR unless one is set: settings make a secret key
    there on first use, and a docs build writes nothing into a console's data."""
    if not _schema_cache:
        os.environ.setdefault("DJANGO_SETTINGS_MODULE", "console.settings")
        os.environ.setdefault("DATA_DIR", tempfile.mkdtemp(prefix="console-docs-"))
        sys.path.insert(0, str(ROOT))
        import django

        django.setup()
        from console.api import api

        _schema_cache.update(api.get_openapi_schema())
    return _schema_cache


def _type(schema: dict) -> str:
    if "$ref" in schema:
        name = schema["$ref"].rsplit("/", 1)[-1]
        return f"[{name}](#{name.lower()})"
    if "anyOf" in schema:
        return " or ".join(_type(s) for s in schema["anyOf"])
    if schema.get("type") == "array":
        return f"array of {_type(schema.get('items', {}))}"
    if "enum" in schema:
        return " \\| ".join(f"`{v}`" for v in schema["enum"])
    return schema.get("type", "any")


def _cell(text) -> str:
    return " ".join(str(text or "").split()).replace("|", "\\|")


def api_page(schema: dict) -> str:
    out = [
        "# API",
        "",
        (
            "Generated at build time from the console's own OpenAPI schema (`console/api.py`, django-ninja; the same "
            "document a running console serves at `/api/v1/openapi.json` to a Viewer's token, with its Swagger UI at "
            "`/api/v1/docs`). The raw schema of this build: [openapi.json](openapi.json)."
        ),
        "",
        (
            "Authentication: `Authorization: Bearer <token>` (a user's API token: *API tokens* page, or "
            "`python manage.py create_api_token USERNAME`), or the browser session with its CSRF token. Every route "
            "checks a role on the server: Viewers read, Operators act, Admins administer "
            "([Security model](security.md)). Errors are JSON: "
            '`{"detail": ..., "errors"?: {field: message}, "link"?: ...}`; an `/api/` path without credentials answers '
            "401, an unknown one 404, a body over the upload limit 413."
        ),
        "",
    ]
    by_tag: dict[str, list[tuple[str, str, dict]]] = {}
    for path, item in schema["paths"].items():
        for method in HTTP_METHODS:
            if method in item:
                op = item[method]
                by_tag.setdefault((op.get("tags") or ["other"])[0], []).append((method, path, op))
    for tag in sorted(by_tag):
        out += [f"## {tag}", ""]
        for method, path, op in by_tag[tag]:
            out += [f"### `{method.upper()} {path}`", "", f"**{op.get('summary', '')}**", ""]
            if op.get("description"):
                out += [op["description"].strip(), ""]
            params = op.get("parameters") or []
            if params:
                out += ["| parameter | in | required | type | description |", "|---|---|---|---|---|"]
                for p in params:
                    out.append(
                        f"| `{p['name']}` | {p['in']} | {'yes' if p.get('required') else 'no'} | "
                        f"{_cell(_type(p.get('schema', {})))} | {_cell(p.get('description'))} |"
                    )
                out.append("")
            body = op.get("requestBody", {}).get("content", {})
            for content_type, media in body.items():
                out += [f"Body ({content_type}): {_type(media.get('schema', {}))}", ""]
            codes = ", ".join(f"{code} {resp.get('description', '')}" for code, resp in op.get("responses", {}).items())
            out += [f"Responses: {codes}", ""]
    schemas = schema.get("components", {}).get("schemas", {})
    if schemas:
        out += ["## Schemas", ""]
        for name in sorted(schemas):
            component = schemas[name]
            out += [f"### {name}", ""]
            if component.get("description"):
                out += [component["description"].strip(), ""]
            required = set(component.get("required", []))
            props = component.get("properties", {})
            if props:
                out += ["| field | type | required | default | description |", "|---|---|---|---|---|"]
                for field, spec in props.items():
                    default = f"`{json.dumps(spec['default'])}`" if "default" in spec else ""
                    out.append(
                        f"| `{field}` | {_cell(_type(spec))} | {'yes' if field in required else 'no'} | "
                        f"{_cell(default)} | {_cell(spec.get('description'))} |"
                    )
                out.append("")
    return "\n".join(out) + "\n"


# --- settings ----------------------------------------------------------------------------------------------------


def _env_calls(tree: ast.AST):
    """(variable name, helper, default source, call node) for each env helper call with a literal name."""
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or not node.args:
            continue
        first = node.args[0]
        if not (isinstance(first, ast.Constant) and isinstance(first.value, str)):
            continue
        func = node.func
        if isinstance(func, ast.Name) and func.id.startswith("env_"):
            default = ast.unparse(node.args[1]) if len(node.args) > 1 else ""
            yield first.value, func.id, default, node
        elif (
            isinstance(func, ast.Attribute)
            and func.attr in ("get", "getenv")
            and ast.unparse(func.value) in ("os.environ", "os")
        ):
            default = ast.unparse(node.args[1]) if len(node.args) > 1 else ""
            yield first.value, "os.environ", default, node


def _is_comment(line: str) -> bool:
    return line.strip().startswith("#")


def _comment_text(block: list[str]) -> str:
    # Section rulers ("# --- Nodes and endpoints ---") name a part of the file, not a setting.
    return " ".join(t for t in (line.strip().lstrip("#").strip() for line in block) if not t.startswith("---"))


def _comment_above(lines: list[str], statement: ast.stmt, call_line: int) -> str:
    """The comment of a setting: its inline comment; else the comment block right above it; else, in a paragraph
    (no blank line) that opens with a comment block and has no other, that block, which speaks for the group."""
    end = statement.end_lineno or statement.lineno
    for line in dict.fromkeys((lines[call_line - 1], lines[end - 1])):
        inline = line.split("  # ", 1)
        if len(inline) == 2:
            return inline[1].strip()
    start = statement.lineno - 1  # 0-based index of the statement's first line
    top = start
    while top > 0 and lines[top - 1].strip():
        top -= 1
    above = start
    while above > top and _is_comment(lines[above - 1]):
        above -= 1
    if above < start:
        return _comment_text(lines[above:start])
    opening = top
    while opening < start and _is_comment(lines[opening]):
        opening += 1
    if opening > top and not any(_is_comment(line) for line in lines[opening:start]):
        return _comment_text(lines[top:opening])
    return ""


def _default_text(helper: str, default: str) -> str:
    if helper == "env_pairs":
        return "(none)"
    if not default:
        return {"env_bool": "`False`", "env_list": "`[]`"}.get(helper, '`""`')
    return f"`{default}`"


def settings_page() -> str:
    source = SETTINGS.read_text()
    lines = source.splitlines()
    tree = ast.parse(source)
    parent_of = {}
    for statement in tree.body:
        for node in ast.walk(statement):
            parent_of[node] = statement
    rows, seen = [], set()
    for name, helper, default, call in sorted(_env_calls(tree), key=lambda found: found[3].lineno):
        if name in seen:
            continue
        seen.add(name)
        statement = parent_of[call]
        secret = f" (or `{name}_FILE`)" if helper == "env_secret" else ""
        rows.append(
            f"| `{name}`{secret} | {_cell(_default_text(helper, default))} | {helper.removeprefix('env_')} | "
            f"{_cell(_comment_above(lines, statement, call.lineno))} | {statement.lineno} |"
        )
    elsewhere = []
    for package in SCANNED:
        for path in sorted((ROOT / package).rglob("*.py")):
            if path in (SETTINGS, ENV) or "migrations" in path.parts:
                continue
            text = path.read_text()
            if "environ" not in text and "env_" not in text:
                continue
            for name, helper, default, _call in _env_calls(ast.parse(text)):
                if name not in seen and name.isupper():
                    seen.add(name)
                    where = path.relative_to(ROOT)
                    elsewhere.append(f"| `{name}` | {_cell(_default_text(helper, default))} | `{where}` |")
    helpers = []
    for node in ast.parse(ENV.read_text()).body:
        if isinstance(node, ast.FunctionDef) and node.name.startswith("env_"):
            helpers.append(f"- `{node.name}`: {_cell(ast.get_docstring(node))}")
    return "\n".join(
        [
            "# Settings",
            "",
            (
                "Generated at build time from `console/settings.py` (every value read from the environment through "
                "`console/env.py`'s typed helpers) and from the modules that read a variable of their own. The meaning "
                "is the comment beside or above the setting in the code; where several settings share one comment, "
                "it is shown for each. Defaults that are expressions (`DATA_DIR / 'models'`) are shown as written. "
                "`make run` needs none of them: the defaults run a console on one machine (SQLite under `DATA_DIR`, "
                "Redis on localhost)."
            ),
            "",
            "## console/settings.py",
            "",
            "| variable | default | type | meaning | line |",
            "|---|---|---|---|---|",
            *rows,
            "",
            "## Read elsewhere",
            "",
            "| variable | default | read by |",
            "|---|---|---|",
            *elsewhere,
            "",
            "## How values are parsed (`console/env.py`)",
            "",
            (
                "A secret (`env_secret`) may come from `NAME` or from the file named by `NAME_FILE` (Docker and "
                "Kubernetes secrets); the file wins. A bad number or boolean stops the process at start with "
                "`ImproperlyConfigured` naming the variable."
            ),
            "",
            *helpers,
            "",
        ]
    )
