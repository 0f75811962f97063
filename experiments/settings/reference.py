"""docs/settings.md, generated from the config dataclasses' field docstrings.

A field's docstring is the string literal right after it; dataclasses do not keep those, so
this module reads the source with `ast` (and imports no torch). It starts at RunConfig and
follows every field whose type is a dataclass into a section of its own, so a `--set` key is
the field's dotted path (ps.bucket_kb). The model and data sections belong to each experiment:
their configs are listed with the presets that use them.

    python -m experiments.settings.reference > docs/settings.md     # or: make docs
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from experiments.engines import engines, matches

ROOT = Path(__file__).resolve().parents[2]
RUN_CONFIG = ("experiments.settings.config", "RunConfig")
PRESETS = "experiments.settings.presets"
PER_EXPERIMENT = ("model", "data")
COMMAND = "python -m experiments.settings.reference > docs/settings.md"


@dataclass(frozen=True)
class Field:
    key: str
    type: str
    default: str
    doc: str
    section: tuple[str, str] | None = None
    """(module, class) when the field is itself a dataclass: a section of its own."""


def _path(name: str) -> Path:
    """The source of module `name`: NAME.py, or a package's NAME/__init__.py."""
    base = ROOT / name.replace(".", "/")
    return base / "__init__.py" if base.is_dir() else base.with_suffix(".py")


@lru_cache(maxsize=None)
def _module(name: str) -> ast.Module:
    path = _path(name)
    return ast.parse(path.read_text(), str(path))


def _classes(module: str) -> dict[str, ast.ClassDef]:
    return {node.name: node for node in _module(module).body if isinstance(node, ast.ClassDef)}


def _imports(module: str) -> dict[str, str]:
    """{name: module it is imported from} for `from X import name` in module."""
    return {alias.asname or alias.name: node.module for node in _module(module).body
            if isinstance(node, ast.ImportFrom) and node.module for alias in node.names}


def _is_dataclass(node: ast.ClassDef) -> bool:
    def name(d: ast.expr) -> str:
        d = d.func if isinstance(d, ast.Call) else d
        return d.attr if isinstance(d, ast.Attribute) else getattr(d, "id", "")
    return any(name(d) == "dataclass" for d in node.decorator_list)


def find_class(module: str, name: str) -> tuple[str, ast.ClassDef] | None:
    """The dataclass `name` as seen from `module`: defined there or imported into it."""
    node = _classes(module).get(name)
    if node is not None:
        return (module, node) if _is_dataclass(node) else None
    source = _imports(module).get(name)
    if source and _path(source).exists():
        return find_class(source, name)
    return None


def _doc(text: str) -> str:
    return " ".join(text.split())


def class_doc(module: str, name: str) -> str:
    """The class's docstring, else the first paragraph of its module's."""
    text = ast.get_docstring(_classes(module)[name]) or ast.get_docstring(_module(module)) or ""
    return _doc(text.split("\n\n")[0])


def fields(module: str, name: str, prefix: str = "") -> list[Field]:
    """The fields of dataclass `name` in `module`, in order, with their docstrings."""
    body = _classes(module)[name].body
    out = []
    for i, node in enumerate(body):
        if not isinstance(node, ast.AnnAssign) or not isinstance(node.target, ast.Name):
            continue
        kind = ast.unparse(node.annotation)
        if kind.startswith("ClassVar"):
            continue
        nxt = body[i + 1] if i + 1 < len(body) else None
        doc = nxt.value.value if (isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                                  and isinstance(nxt.value.value, str)) else ""
        value, section = node.value, None
        if value is None:
            default = "(required)"
        elif isinstance(value, ast.Call) and getattr(value.func, "id", "") == "field":
            factory = next((k.value for k in value.keywords if k.arg == "default_factory"), None)
            found = find_class(module, ast.unparse(factory)) if factory is not None else None
            section = (found[0], found[1].name) if found else None
            default = "(section)" if section else ast.unparse(value)
        else:
            default = ast.unparse(value)
        out.append(Field(prefix + node.target.id, kind, default, _doc(doc), section))
    return out


def _readers(key: str) -> str:
    """Which of psar's own engines read `key` ("every engine" where none lists it)."""
    own = [s for s in engines().values() if s.build.startswith("experiments.harness.builders:")]
    if not any(matches(key, s.reads) for s in own):
        return "all"
    return ", ".join(s.name for s in own if s.reads_setting(key))


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _table(rows: list[Field], readers: bool = True) -> list[str]:
    head = "| `--set` key | type | default | read by | what it does |" if readers else \
        "| `--set` key | type | default | what it does |"
    lines = [head, "|" + "---|" * (5 if readers else 4)]
    for f in rows:
        cells = [f"`{f.key}`", f"`{_cell(f.type)}`", f"`{_cell(f.default)}`"]
        cells += [_readers(f.key)] if readers else []
        lines.append("| " + " | ".join(cells + [_cell(f.doc)]) + " |")
    return lines


def _sections(module: str, name: str, prefix: str = "") -> list[tuple[str, str, str, list[Field]]]:
    """(title, module, class, scalar fields) for the class and every dataclass under it."""
    own = fields(module, name, prefix)
    out = [(prefix.rstrip(".") or "run", module, name, [f for f in own if not f.section])]
    for f in own:
        if f.section:
            out += _sections(*f.section, prefix=f.key + ".")
    return out


def _presets() -> list[tuple[str, dict[str, str]]]:
    """(experiment, {RunConfig keyword: its source}) of every preset in PRESETS, in order."""
    tree = _module(PRESETS)
    funcs = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
    table = next(n.value for n in tree.body if isinstance(n, ast.AnnAssign)
                 and getattr(n.target, "id", "") == "PRESETS")
    out = []
    for key, value in zip(table.keys, table.values):
        ret = next(n for n in ast.walk(funcs[value.id]) if isinstance(n, ast.Return))
        out.append((key.value, {k.arg: ast.unparse(k.value) for k in ret.value.keywords}))
    return out


def render() -> str:
    module, name = RUN_CONFIG
    lines = [
        "# Settings",
        "",
        f"<!-- Generated by `{COMMAND}` (or `make docs`) from the config",
        "dataclasses' field docstrings; tests/unit/test_docs.py fails when this page is stale. -->",
        "",
        "Every setting of a run, as `psar run`, `compare`, `launch`, `worker` and `server` take it:",
        "`--set KEY=VALUE`, KEY the dotted path below (`--set ps.bucket_kb=256`,",
        "`--set optim.lr=0.01`). Unknown keys and wrong types are refused with a message that lists",
        "what exists; a setting the chosen engine never reads is named in a warning (\"read by\"",
        "below: `all` means every engine reads it). The resolved config is saved as",
        "`config.json` in every run directory. The defaults here are the dataclasses'; each",
        "experiment sets its own steps, batch size, target loss and optimizer (see",
        "[Experiments](#experiments)), and `psar COMMAND --help` gives the flags that set some",
        "of these keys directly (`--engine`, `--workers`, `--servers`, `--steps`, `--seed`,",
        "`--device`, `--net`, `--trace`, `--tensorboard`).",
        "",
    ]
    for title, mod, cls, rows in _sections(module, name):
        lines += [f"## {title}", "", f"`{cls}` ({mod.replace('.', '/')}.py): {class_doc(mod, cls)}".rstrip(), ""]
        lines += _table(rows) + [""]
    lines += [
        "## Experiments",
        "",
        "`model` and `data` belong to each experiment (`psar list`): each is one of the configs",
        "below, and `--set model.KEY=VALUE` or `--set data.KEY=VALUE` changes a field of the",
        "experiment's own. A script run (`psar launch`) has neither: its model and data are the",
        "script's.",
        "",
        "| experiment | model | data | steps | batch_size | target_loss | optim |",
        "|---|---|---|---|---|---|---|",
    ]
    used: dict[str, list[str]] = {}
    for experiment, kw in _presets():
        cells = [f"`{_cell(kw.get(k, '-'))}`" for k in ("model", "data", "steps", "batch_size", "target_loss", "optim")]
        lines.append(f"| `{experiment}` | " + " | ".join(cells) + " |")
        for part in PER_EXPERIMENT:
            if part in kw:
                used.setdefault(kw[part].split("(")[0], []).append(experiment)
    lines.append("")
    for part in PER_EXPERIMENT:
        source = _imports(PRESETS)
        for cls in [c for c in used if source.get(c) == f"experiments.workloads.{'models' if part == 'model' else 'data'}"]:
            mod = source[cls]
            lines += [f"### {part}: {cls}", "",
                      f"{class_doc(mod, cls)} Used by: {', '.join(f'`{e}`' for e in used[cls])}.", ""]
            lines += _table(fields(mod, cls, part + "."), readers=False) + [""]
    return "\n".join(lines).rstrip() + "\n"


def main() -> None:
    sys.stdout.write(render())


if __name__ == "__main__":
    main()
