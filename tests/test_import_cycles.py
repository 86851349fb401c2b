"""No import cycles among deepinfer's modules, so the ones removed (cli <-> bench.peer, recipe.chat <->
recipe.parser, worker.model_runner <-> worker.spec_decode) cannot come back.

The graph is read from the sources with ``ast``: every ``import`` and ``from ... import`` a module
makes, at module level (``if TYPE_CHECKING:`` blocks included: a type-only cycle is still two modules
that cannot be understood apart) and inside functions (a lazy import hides a cycle, it does not remove
it). Two kinds of edge are left out: an import of a module that holds a backend's op table (``OPS =
OpTable(...)``; the op-registration pattern: that module imports the backend's op modules, which
register into its table), and the one declared below.
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.conftest import REPO_ROOT

# Folders and the package names they are imported under (see deepinfer/__init__.py).
ROOTS = {
    "deepinfer": "deepinfer",
    "backends": "deepinfer.backends",
    "ops_cuda": "deepinfer.ops_cuda",
    "ops_ascend": "deepinfer.ops_ascend",
    "platform": "deepinfer.platform",
}
# The op registry reads the interface's function list when a backend registers an op (a lazy import);
# the interface's dispatch functions call the registry's active table. One concept split in two.
ALLOWED = {("deepinfer.backends.registry", "deepinfer.backends.ops")}


def module_files() -> dict[str, Path]:
    modules = {}
    for folder, prefix in ROOTS.items():
        for path in sorted((REPO_ROOT / folder).rglob("*.py")):
            parts = list(path.relative_to(REPO_ROOT / folder).with_suffix("").parts)
            if folder == "deepinfer" and parts[0] in ROOTS:
                continue
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join([prefix, *parts])] = path
    return modules


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    tables = {name for name, path in modules.items() if _holds_op_table(path)}
    graph = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets.update(resolve(alias.name) for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*anchor, base] if base else anchor)
                for alias in node.names:
                    full = f"{base}.{alias.name}"
                    targets.add(full if full in modules else resolve(base))
        graph[name] = {
            t for t in targets if t is not None and t != name and t not in tables and (name, t) not in ALLOWED
        }
    return graph


def _holds_op_table(path: Path) -> bool:
    """Whether the module assigns ``OPS = OpTable(...)`` at module level."""
    for node in ast.parse(path.read_text()).body:
        if (
            isinstance(node, ast.Assign)
            and any(isinstance(t, ast.Name) and t.id == "OPS" for t in node.targets)
            and isinstance(node.value, ast.Call)
            and getattr(node.value.func, "id", None) == "OpTable"
        ):
            return True
    return False


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
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
                    found.append(sorted(component))
    return found


def test_no_import_cycles() -> None:
    modules = module_files()
    assert {"deepinfer.cli", "deepinfer.bench.peer", "deepinfer.worker.model_runner"} <= set(modules)
    assert cycles(import_graph(modules)) == []


def test_the_cycle_finder_finds_cycles() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e2"}, "e2": {"e"}, "f": set()}
    assert sorted(cycles(graph)) == [["a", "b", "c"], ["e", "e2"]]
    modules = module_files()
    graph = import_graph(modules)
    assert "deepinfer.worker.inputs" in graph["deepinfer.worker.spec_decode"]
    assert "deepinfer.malloc_tuning" in graph["deepinfer.bench.peer"]
    assert _holds_op_table(modules["deepinfer.ops_cuda"])
    assert not _holds_op_table(modules["deepinfer.ops_cuda.sampling"])


# Imports run down the process chain (ARCHITECTURE.md, conventions): a package never imports one of
# the layers above it. What two layers share lives below both (``deepinfer.web`` for the HTTP
# processes, ``deepinfer.core.load`` for the load report, ``deepinfer.engine.kv_connector`` for the
# engine's hooks into the store).
ABOVE = {
    "deepinfer.server": {"deepinfer.router"},
    "deepinfer.web": {"deepinfer.router", "deepinfer.server", "deepinfer.core", "deepinfer.engine"},
    "deepinfer.core": {"deepinfer.router", "deepinfer.server", "deepinfer.web"},
    "deepinfer.engine": {"deepinfer.router", "deepinfer.server", "deepinfer.web", "deepinfer.core"},
    "deepinfer.worker": {"deepinfer.router", "deepinfer.server", "deepinfer.web", "deepinfer.core"},
    "deepinfer.model": {"deepinfer.router", "deepinfer.server", "deepinfer.web", "deepinfer.core"},
    "deepinfer.kvstore": {"deepinfer.router", "deepinfer.server", "deepinfer.core", "deepinfer.engine"},
}


def upward_imports(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """(module, imported module) pairs where a package imports a layer above it (``ABOVE``)."""

    def package_of(module: str, packages) -> str | None:
        return next((p for p in packages if module == p or module.startswith(p + ".")), None)

    found = []
    for module, targets in sorted(graph.items()):
        package = package_of(module, ABOVE)
        if package is None:
            continue
        found.extend((module, t) for t in sorted(targets) if package_of(t, ABOVE[package]))
    return found


def test_imports_run_down_the_process_chain() -> None:
    assert upward_imports(import_graph(module_files())) == []
    assert upward_imports({"deepinfer.server.app": {"deepinfer.router.load"}}) == [
        ("deepinfer.server.app", "deepinfer.router.load")
    ]
