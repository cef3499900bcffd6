"""The package's imports run one way down the data flow, between rooms (dtorch's subpackages).

Read from the source with `ast` (nothing is imported or run), including imports inside functions
(DTorch imports torch-heavy modules lazily) and `importlib.import_module("dtorch...")` by name;
an import under `if __name__ == "__main__":` is a script's entry point, not a dependency, and is
not counted. The order is the one docs/design.md ("Which room may import which") documents.
Runs in well under a second.
"""

from __future__ import annotations

import ast
import functools
from collections import defaultdict
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "dtorch"

LAYERS: list[tuple[str, ...]] = [
    ("cluster", "models"),  # what the hardware is; the reference models (neither imports DTorch rooms)
    ("model",),  # the model's profile and structure
    ("plan",),  # the planner: pure, cluster + profile in, Plan out
    ("parallel",),  # the executor: applies a Plan
    ("checkpoint", "monitor", "integrations"),  # what the runtime writes to and reports through
    ("train",),  # the runtime loop
    ("elastic",),  # launches and watches the runtime (through the one-way hook seam)
    ("cli",),  # the roof
]
"""Rooms from the bottom up. A room may import rooms of its own layer or below, never above; no
circle may form, within a layer either. Single-file modules at the top of the package
(`dtorch/errors.py`, `env.py`, `trust.py`, `docio.py`, `process_group.py`, `eventlog.py`, `progress.py`) are the
floor: every room may import them, and they import no room."""

KNOWN_EXCEPTIONS: dict[tuple[str, str], str] = {
}
"""Arrows against the flow that exist today, each with the reason and what removes it."""

KNOWN_MODULE_CYCLES: dict[frozenset[str], str] = {
}
"""Modules that import each other today (a strongly connected component of the module graph), each
with the reason and what removes it. A component found must be one of these, exactly."""


def _level() -> dict[str, int]:
    return {room: i for i, layer in enumerate(LAYERS) for room in layer}


def _module_name(path: Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _room(module: str) -> str | None:
    """The room of a dtorch module ("" for the floor), None outside dtorch."""
    parts = module.split(".")
    if parts[0] != "dtorch":
        return None
    if len(parts) == 1:
        return ""
    return parts[1] if (PKG / parts[1]).is_dir() else ""


def _is_main_guard(node: ast.AST) -> bool:
    return (isinstance(node, ast.If) and isinstance(node.test, ast.Compare)
            and isinstance(node.test.left, ast.Name) and node.test.left.id == "__name__"
            and any(isinstance(c, ast.Constant) and c.value == "__main__" for c in node.test.comparators))


def _is_module(name: str) -> bool:
    """`dtorch.a.b` is a file (`dtorch/a/b.py`) or a package (`dtorch/a/b/__init__.py`)."""
    path = PKG.parent.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _imported(path: Path) -> list[tuple[int, str]]:
    """(line, module) for every import in the file, at any depth, outside `__main__` guards."""
    module = _module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out: list[tuple[int, str]] = []

    def visit(node: ast.AST) -> None:
        if _is_main_guard(node):
            return
        if isinstance(node, ast.Import):
            out.extend((node.lineno, a.name) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            # `from dtorch import trust` imports dtorch.trust; `from dtorch.plan import Plan` dtorch.plan
            out.extend((node.lineno, f"{mod}.{a.name}" if (not node.module or _is_module(f"{mod}.{a.name}"))
                        else mod) for a in node.names)
        elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str) and node.args[0].value.startswith("dtorch.")
              and ((isinstance(node.func, ast.Attribute) and node.func.attr == "import_module")
                   or (isinstance(node.func, ast.Name) and node.func.id in ("import_module", "__import__")))):
            out.append((node.lineno, node.args[0].value))  # imported by name
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text(), str(path)))
    return out


@functools.cache
def room_edges() -> dict[tuple[str, str], list[str]]:
    """(from room, to room) -> where ("file:line imports module"), for every import between rooms."""
    edges: dict[tuple[str, str], list[str]] = defaultdict(list)
    for path in sorted(PKG.rglob("*.py")):
        src = _room(_module_name(path))
        for line, mod in _imported(path):
            dst = _room(mod)
            if dst is None or dst == src:
                continue
            edges[(src or "", dst)].append(f"{path.relative_to(PKG.parent)}:{line} imports {mod}")
    return edges


@functools.cache
def module_graph() -> dict[str, set[str]]:
    """dtorch module -> the dtorch modules it imports (at any depth, lazily too). An import names the
    longest module it reaches (`from dtorch.elastic import events` is dtorch.elastic.events). A
    module's import of its own package (`dtorch.cluster.probe` of `dtorch.cluster`) is not counted:
    a package's __init__ re-exports its modules, so every such import would read as a circle."""
    modules = {_module_name(p): p for p in sorted(PKG.rglob("*.py"))}
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for m, path in modules.items():
        for _, target in _imported(path):
            parts = target.split(".")
            while parts and ".".join(parts) not in modules:
                parts.pop()
            dst = ".".join(parts)
            if dst and dst != m and not m.startswith(dst + "."):
                graph[m].add(dst)
    return graph


def module_cycles(graph: dict[str, set[str]] | None = None) -> set[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    graph = module_graph() if graph is None else graph
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: set[frozenset[str]] = set()
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = set()
                while True:
                    x = stack.pop()
                    on_stack.discard(x)
                    comp.add(x)
                    if x == v:
                        break
                if len(comp) > 1:
                    found.add(frozenset(comp))
    return found


def test_every_room_has_a_place_in_the_order():
    rooms = {p.name for p in PKG.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert rooms == set(_level()), f"place these rooms in LAYERS (and docs/design.md): {rooms ^ set(_level())}"


def test_no_import_runs_against_the_data_flow():
    level = _level()
    bad = []
    for (src, dst), where in sorted(room_edges().items()):
        if (src, dst) in KNOWN_EXCEPTIONS:
            continue
        if src == "" or (dst != "" and level[dst] > level[src]):
            bad += [f"{src or 'the floor'} -> {dst}: {w}" for w in where]
    assert not bad, "imports against the data flow (see LAYERS):\n" + "\n".join(bad)


def test_no_import_circle_between_rooms():
    graph: dict[str, set[str]] = defaultdict(set)
    for (src, dst) in room_edges():
        if src and dst and (src, dst) not in KNOWN_EXCEPTIONS:
            graph[src].add(dst)

    def reaches(a: str, b: str) -> bool:
        seen, todo = set(), [a]
        while todo:
            x = todo.pop()
            for y in graph[x]:
                if y == b:
                    return True
                if y not in seen:
                    seen.add(y)
                    todo.append(y)
        return False

    circles = sorted({tuple(sorted((a, b))) for a in list(graph) for b in graph[a] if reaches(b, a)})
    assert not circles, f"import circles between rooms (each pair reaches the other): {circles}"


def test_known_exceptions_are_still_real():
    """An allowed arrow that no longer exists must leave the allow-list (so none hides a new one)."""
    edges = room_edges()
    stale = [k for k in KNOWN_EXCEPTIONS if k not in edges]
    assert not stale, f"delete these from KNOWN_EXCEPTIONS, they are gone: {stale}"


def test_the_walk_sees_lazy_imports_and_skips_entry_points():
    edges = room_edges()
    # CheckpointManager is imported inside Trainer._setup, not at the top of the file
    assert any("train/trainer.py" in w and "dtorch.checkpoint" in w for w in edges[("train", "checkpoint")])
    # cluster/probe.py runs the CLI under `if __name__ == "__main__":` only: no dependency on the roof
    assert ("cluster", "cli") not in edges


def test_no_import_cycle_between_modules():
    new = [sorted(c) for c in module_cycles() if c not in KNOWN_MODULE_CYCLES]
    assert not new, ("modules that import each other (move what they share into a leaf module):\n"
                     + "\n".join(" <-> ".join(c) for c in new))


def test_known_module_cycles_are_still_real():
    """An allowed circle that no longer exists must leave the allow-list (so none hides a new one)."""
    stale = [sorted(c) for c in KNOWN_MODULE_CYCLES if c not in module_cycles()]
    assert not stale, f"delete these from KNOWN_MODULE_CYCLES, they are gone: {stale}"


def test_the_module_walk_resolves_modules_and_finds_circles():
    # `from package import module` names the module, not the package
    graph = module_graph()
    assert "dtorch.elastic.events" in graph["dtorch.elastic.agent"]
    assert "dtorch.cluster.machine" in graph["dtorch.cluster.local"]
    toy = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": {"e"}, "e": {"d"}, "f": {"a"}}
    assert module_cycles(toy) == {frozenset("abc"), frozenset("de")}
