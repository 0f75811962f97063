"""The documentation stays true to the code: the settings page is what the generator makes
of the config dataclasses now, every relative link in README.md and docs/ resolves (file and
anchor), and the README stays a short start."""

from __future__ import annotations

import re
from pathlib import Path

from experiments.settings.reference import COMMAND, render

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")
README_MAX_LINES = 170


def _anchors(page: Path) -> set[str]:
    """GitHub's anchors of a page's headings: lower case, punctuation dropped, spaces to '-'."""
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    heads = re.findall(r"^#+\s+(.*?)\s*$", text, flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h.replace("`", "").lower()).replace(" ", "-") for h in heads}


def _links(page: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # code blocks hold no links
    return [a or b for a, b in LINK.findall(text)]


def test_settings_page_is_what_the_generator_makes_now():
    page = ROOT / "docs" / "settings.md"
    assert page.exists(), f"docs/settings.md is missing: run `{COMMAND}` (or `make docs`)"
    assert page.read_text() == render(), (
        f"docs/settings.md is stale (a config field or its docstring changed): run `{COMMAND}` "
        "(or `make docs`) and commit the page")


def test_every_relative_link_resolves():
    broken = []
    for page in PAGES:
        for target in _links(page):
            if re.match(r"^[a-z]+:", target):  # http:, https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no heading #{anchor})")
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_readme_is_a_short_start():
    lines = len((ROOT / "README.md").read_text().splitlines())
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; move detail to a docs/ page"


def test_the_link_check_can_fail(tmp_path):
    page = tmp_path / "p.md"
    page.write_text("# A title\n[ok](p.md#a-title) [gone](missing.md) [bad](p.md#nope)\n```\n[x](y.md)\n```\n")
    assert _links(page) == ["p.md#a-title", "missing.md", "p.md#nope"]
    assert _anchors(page) == {"a-title"}


def test_the_script_diff_is_the_whole_difference_of_the_examples():
    """docs/your-own-script.md's diff is every line in which convnet_psar.py's main() differs
    from convnet_ddp.py's, nothing left out."""
    import ast
    import difflib

    def main_of(name: str) -> list[str]:
        text = (ROOT / "experiments" / "examples" / name).read_text()
        fn = next(n for n in ast.parse(text).body if isinstance(n, ast.FunctionDef) and n.name == "main")
        return text.splitlines()[fn.lineno - 1: fn.end_lineno]

    whole = list(difflib.unified_diff(main_of("convnet_ddp.py"), main_of("convnet_psar.py"), lineterm="", n=1000))[3:]
    page = (ROOT / "docs" / "your-own-script.md").read_text()
    shown = re.search(r"```diff\n(.*?)\n```", page, flags=re.S).group(1).splitlines()
    assert shown == whole
