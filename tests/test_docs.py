"""docs/laneformer.md is the description the code cites: every `docs/laneformer.md §N` in the code and
the README names a section that exists there, no `§` in the code points anywhere else, and the
sections are numbered in order."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "laneformer.md"
FOLDERS = ("engine", "kernels", "app", "bench", "evals", "storage", "laneplay", "static", "tests")
NUMBER = r"\d+(?:\.\d+)*"
# "docs/laneformer.md §4", "... §1-§7", "... §9.4's"
CITATION = re.compile(rf"docs/laneformer\.md §({NUMBER})(?:\s*-\s*§({NUMBER}))?")
HEADING = re.compile(rf"^(#{{2,4}}) ({NUMBER})\.? ", re.M)


def sources() -> list[Path]:
    files = [p for folder in FOLDERS for p in (ROOT / folder).rglob("*.py") if p != Path(__file__).resolve()]
    return files + [ROOT / "README.md", *sorted((ROOT / "bench" / "results").glob("*.md"))]


def citations(text: str) -> list[str]:
    return [n for m in CITATION.finditer(text) for n in m.groups() if n]


def sections() -> list[str]:
    return [m.group(2) for m in HEADING.finditer(DOC.read_text())]


def test_the_sections_are_numbered_in_order():
    numbers = sections()
    top = [n for n in numbers if "." not in n]
    assert top == [str(i) for i in range(1, len(top) + 1)] and len(top) >= 8
    for parent in top:
        subs = [n for n in numbers if n.startswith(parent + ".")]
        assert subs == [f"{parent}.{i}" for i in range(1, len(subs) + 1)], parent


def test_every_citation_in_the_code_names_a_section_of_the_doc():
    have = set(sections())
    cited: dict[str, list[str]] = {}
    stray = []
    for path in sources():
        text = path.read_text()
        rel = str(path.relative_to(ROOT))
        for n in citations(text):
            cited.setdefault(n, []).append(rel)
        if text.count("§") != len(citations(text)):  # a § that is not a citation of the doc
            stray.append(rel)
    assert {n: files for n, files in cited.items() if n not in have} == {}
    assert stray == []
    assert len(cited) >= 10  # the model, the reduce, the windows, RoPE, the head, DTP and the config are cited


def test_the_checks_catch_a_bad_citation():
    assert citations("see docs/laneformer.md §3-§7 and docs/laneformer.md §9.4's gather") == ["3", "7", "9.4"]
    assert citations("spec §1.6") == []
    assert "42" not in set(sections())
