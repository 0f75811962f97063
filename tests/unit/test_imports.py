"""The import graph of the project's packages, read from the source: no module imports itself
through others, and the engines (ps/, allreduce/) import nothing of the harness
(experiments/) or of the analysis (analysis/), and experiments/'s subpackages import only
from their own layer or those below (LAYERS). Imports inside functions count too: a cycle
hidden in a function is still a cycle."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("ps", "allreduce", "experiments", "analysis")
ENGINES, ABOVE = ("ps", "allreduce"), ("experiments", "analysis")


def modules() -> dict[str, Path]:
    out = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The project modules `name` imports, anywhere in its source."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            target = ".".join(base + ([node.module] if node.module else []))
            candidates = [target] + [f"{target}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Import):
            candidates = [alias.name for alias in node.names]
        else:
            continue
        found.update(c for c in candidates if c in known and c != name)
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles_and_the_engines_stand_alone():
    known = modules()
    graph = {name: imports(name, path, known) for name, path in known.items()}
    assert len(graph) > 50 and graph["analysis.costmodel"]  # the graph was read
    assert cycles(graph) == []
    upward = sorted((m, t) for m, targets in graph.items() for t in targets
                    if m.split(".")[0] in ENGINES and t.split(".")[0] in ABOVE)
    assert upward == []


def test_a_cycle_is_found():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


# experiments/ in layers, lowest first: a module imports from its own layer or below only.
LAYERS = (("engines", "workloads", "rundir", "compression"), ("settings",), ("harness",),
          ("runtime",), ("comparisons", "bench"), ("api", "cli", "examples"))


def layer_of(module: str) -> int:
    part = module.split(".")[1]
    return next(i for i, names in enumerate(LAYERS) if part in names)


def test_experiments_subpackages_import_only_downwards():
    known = modules()
    inside = {name: path for name, path in known.items() if name.startswith("experiments.")}
    assert {name.split(".")[1] for name in inside} == {n for names in LAYERS for n in names}
    upward = sorted((m, t) for m, path in inside.items() for t in imports(m, path, known)
                    if t.startswith("experiments.") and layer_of(t) > layer_of(m))
    assert upward == []
