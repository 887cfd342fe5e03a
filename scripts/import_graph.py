"""Figures of the import graph for issue 14's rules, printed (run: .venv/bin/python scripts/import_graph.py).

import-linter (`make lint-imports`) enforces the rules; this prints the numbers behind them: import cycles
between modules (strongly connected components of grimp's graph, the one import-linter builds), the
function-level imports of project modules outside AppConfig.ready(), and the largest modules."""

import ast
import sys
from pathlib import Path

import grimp

ROOT = Path(__file__).resolve().parent.parent
APPS = ("console", "models_registry", "endpoints", "workers")


def cycles(graph) -> list[list[str]]:
    """Tarjan's strongly connected components of more than one module (written here: grimp finds chains
    between given modules, not the components themselves)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(module):
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for imported in graph.find_modules_directly_imported_by(module):
            if imported not in index:
                visit(imported)
                low[module] = min(low[module], low[imported])
            elif imported in on_stack:
                low[module] = min(low[module], index[imported])
        if low[module] == index[module]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == module:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(10_000)
    for module in sorted(graph.modules):
        if module not in index:
            visit(module)
    return found


def function_level_imports() -> list[str]:
    found = []
    for app in APPS:
        for path in sorted((ROOT / app).rglob("*.py")):
            if "migrations" in path.parts:
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name != "ready":
                    for inner in ast.walk(node):
                        module = (
                            inner.module
                            if isinstance(inner, ast.ImportFrom)
                            else (inner.names[0].name if isinstance(inner, ast.Import) else None)
                        )
                        if module and module.split(".")[0] in APPS:
                            found.append(f"{path.relative_to(ROOT)}:{inner.lineno} {module}")
    return found


def main() -> None:
    sys.path.insert(0, str(ROOT))
    graph = grimp.build_graph(*APPS)
    found = cycles(graph)
    print(f"modules: {len(graph.modules)}; import cycles: {len(found)}")
    for component in found:
        print("  cycle:", ", ".join(component))
    imports = function_level_imports()
    print(f"function-level imports of project modules (outside AppConfig.ready): {len(imports)}")
    for line in imports:
        print("  ", line)
    sizes = sorted(
        (
            (sum(1 for _ in p.open()), str(p.relative_to(ROOT)))
            for folder in (*APPS, "tests")
            for p in (ROOT / folder).rglob("*.py")
            if "migrations" not in p.parts
        ),
        reverse=True,
    )
    print("largest modules:", ", ".join(f"{name} {lines}" for lines, name in sizes[:5]))


if __name__ == "__main__":
    main()
