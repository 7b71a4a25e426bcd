"""Every document the code cites exists: "docs/design.md section N" names a section of docs/design.md,
and every ``*.md`` file named in the code is in the repository."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCES = sorted(p for folder in ("hyscale_hf", "scripts", "tests") for p in (ROOT / folder).rglob("*")
                 if p.suffix in (".py", ".sh", ".yaml", ".md"))
CITATION = re.compile(r"docs/design\.md section (\d+)")
MARKDOWN_NAME = re.compile(r"[\w./-]*[A-Za-z_]\w*\.md\b")


def _sections(text: str) -> set[int]:
    return {int(n) for n in re.findall(r"^## (\d+)\. ", text, flags=re.M)}


def _citations(sources) -> list[tuple[str, int]]:
    found = []
    for path in sources:
        text = path.read_text(errors="replace")
        found += [(f"{path.relative_to(ROOT)}:{text.count(chr(10), 0, m.start()) + 1}", int(m.group(1)))
                  for m in CITATION.finditer(text)]
    return found


def test_section_parser_reads_numbered_headings():
    assert _sections("# title\n## 1. One\ntext\n## 12. Twelve\n### 3. not a section\n") == {1, 12}


def test_the_code_cites_the_design_page():
    # The layout, the math and replay are cited from the code; losing all citations would make the
    # next test pass vacuously.
    assert {2, 3, 7} <= {n for _, n in _citations(SOURCES)}


def test_every_design_citation_names_an_existing_section():
    sections = _sections((ROOT / "docs" / "design.md").read_text())
    missing = [(where, n) for where, n in _citations(SOURCES) if n not in sections]
    assert not missing, f"cited sections absent from docs/design.md (it has {sorted(sections)}): {missing}"


def test_every_markdown_file_the_code_names_exists():
    known = {p.relative_to(ROOT).as_posix() for p in ROOT.rglob("*.md") if ".venv" not in p.parts}
    names = {p.rsplit("/", 1)[-1] for p in known}
    missing = []
    for path in SOURCES:
        for name in MARKDOWN_NAME.findall(path.read_text(errors="replace")):
            if name.strip("./") not in known and name.rsplit("/", 1)[-1] not in names:
                missing.append(f"{path.relative_to(ROOT)}: {name}")
    assert not missing, missing


def test_no_citation_of_a_design_document_outside_the_repo():
    stale = [f"{p.relative_to(ROOT)}" for p in SOURCES if p != Path(__file__).resolve()
             and re.search(r"\bDESIGN\b", p.read_text(errors="replace"))]
    assert not stale, f"'DESIGN' names no document in the repository (cite docs/design.md): {stale}"


def test_every_result_file_the_benchmark_docs_cite_exists():
    cited = set()
    for doc in ("BENCHMARKS.md", "benchmarks/notes.md"):
        cited |= set(re.findall(r"benchmarks/results/[\w./-]+\.(?:json|png|log)", (ROOT / doc).read_text()))
    assert cited, "the benchmark docs cite no result file"
    assert not [c for c in cited if not (ROOT / c).is_file()]
