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
(`dtorch/errors.py`, `trust.py`, `docio.py`, `process_group.py`, `eventlog.py`) are the floor: every room may
import them, and they import no room."""

KNOWN_EXCEPTIONS: dict[tuple[str, str], str] = {
}
"""Arrows against the flow that exist today, each with the reason and what removes it."""


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
            out.extend((node.lineno, f"{mod}.{a.name}" if (mod == "dtorch" or not node.module) else mod)
                       for a in node.names)
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
