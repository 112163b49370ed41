"""``docs/benchmarks.md`` is exactly what ``benchmarks/tables.py`` renders from the JSON results."""

from __future__ import annotations

from benchmarks.tables import PAGE, RESULTS, SECTIONS, render


def test_benchmark_page_matches_the_results():
    assert PAGE.read_text() == render(), "docs/benchmarks.md is out of date: run python benchmarks/tables.py"


def test_every_results_file_has_a_table():
    page = render()
    assert len(SECTIONS) == page.count("\n## ")
    rendered = {name for name in (p.name for p in RESULTS.glob("*.json"))}
    folder = PAGE.parent.parent / "benchmarks"
    sources = "".join((folder / name).read_text() for name in ("tables.py", "tables_llm.py"))
    assert all(f'"{name}"' in sources for name in rendered), rendered
