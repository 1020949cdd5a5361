"""The layering of ``src/specdraft``, read from the source (AST only: no import, fast).

Checked: no import cycle between specdraft's modules (module-level and function-level
imports alike, resolved to specdraft modules; only ``if TYPE_CHECKING:`` imports are left
out, as they never run), argparse and ``specdraft.cli`` only inside the command line,
no source file over 500 lines, no function over 60 lines.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src"
PACKAGE = "specdraft"
MAX_FILE_LINES, MAX_FUNCTION_LINES = 500, 60


def module_files() -> dict[str, Path]:
    """Dotted module name -> file, every module of the package (a package is its __init__)."""
    mods = {}
    for path in sorted((SRC / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        mods[".".join(parts)] = path
    return mods


def runtime_imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement, at any depth, except under ``if TYPE_CHECKING:``."""
    found, stack = [], [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            stack.extend(node.orelse)  # the body never runs
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        stack.extend(ast.iter_child_nodes(node))
    return found


def imported_names(module: str, is_package: bool, node: ast.Import | ast.ImportFrom) -> list[str]:
    """Absolute dotted names an import statement of ``module`` may refer to."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    base = node.module or ""
    if node.level:
        anchor = module.split(".") if is_package else module.split(".")[:-1]
        anchor = anchor[: len(anchor) - (node.level - 1)]
        base = ".".join(anchor + ([base] if base else []))
    return [f"{base}.{a.name}" for a in node.names]  # a name, or a submodule: resolve() decides


def resolve(name: str, modules: set[str]) -> str | None:
    """The specdraft module ``name`` denotes: itself, else its nearest enclosing module."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def import_graph() -> dict[str, set[str]]:
    """module -> the specdraft modules it imports (explicit imports only)."""
    files = module_files()
    graph = {}
    for module, path in files.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        targets = set()
        for node in runtime_imports(tree):
            for name in imported_names(module, path.name == "__init__.py", node):
                target = resolve(name, set(files))
                if target and target != module:
                    targets.add(target)
        graph[module] = targets
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index, low, on_stack, stack, out, counter = {}, {}, set(), [], [], [0]

    def visit(root: str) -> None:
        work = [(root, iter(sorted(graph.get(root, ()))))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        out.append(sorted(component))
            elif child not in index:
                index[child] = low[child] = counter[0]
                counter[0] += 1
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(graph.get(child, ())))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return out


def in_cli(module: str) -> bool:
    """The command line: the cli package, and ``python -m specdraft``'s entry point, which runs it."""
    if module in (f"{PACKAGE}.cli", f"{PACKAGE}.__main__"):
        return True
    return module.startswith(f"{PACKAGE}.cli.") or module.startswith(f"{PACKAGE}.cli_")


# ---- the checker itself ---------------------------------------------------------------------


def test_cycle_finder_on_a_known_graph():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e"}, "f": set()}
    assert cycles(graph) == [["a", "b", "c"]]


def test_relative_imports_resolve_to_modules():
    node = ast.parse("from ..errors import SpecdraftError").body[0]
    modules = set(module_files())
    assert resolve(imported_names("specdraft.bench.peers", False, node)[0], modules) == "specdraft.errors"
    node = ast.parse("from .lookup import LookupDrafter").body[0]
    assert resolve(imported_names("specdraft.drafters", True, node)[0], modules) == "specdraft.drafters.lookup"
    node = ast.parse("from . import lookup").body[0]  # the submodule, not the package's __init__
    assert resolve(imported_names("specdraft.drafters.registry", False, node)[0], modules) == "specdraft.drafters.lookup"


def test_function_level_and_type_checking_imports():
    tree = ast.parse("def f():\n    import x\nif TYPE_CHECKING:\n    import y\n")
    assert [a.name for n in runtime_imports(tree) for a in n.names] == ["x"]


# ---- the tree -------------------------------------------------------------------------------


def test_no_import_cycle_between_modules():
    assert cycles(import_graph()) == []


def test_argparse_and_cli_only_inside_the_command_line():
    offenders = []
    for module, path in module_files().items():
        if in_cli(module):
            continue
        for node in runtime_imports(ast.parse(path.read_text(encoding="utf-8"))):
            for name in imported_names(module, path.name == "__init__.py", node):
                if name.split(".")[0] == "argparse" or in_cli(name):
                    offenders.append(f"{module}: {name}")
    assert offenders == []


def test_no_source_file_over_the_limit():
    long = {m: n for m, p in module_files().items() if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_FILE_LINES}
    assert long == {}


def test_no_function_over_the_limit():
    long = []
    for module, path in module_files().items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                size = node.end_lineno - node.lineno + 1
                if size > MAX_FUNCTION_LINES:
                    long.append(f"{module}.{node.name}: {size}")
    assert long == []
