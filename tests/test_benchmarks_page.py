"""BENCHMARKS.md reproduces from the documents committed beside it (benchmarks/results/):
each section whose documents are kept there renders, byte for byte, to what the page
holds between its markers. Sections measured before documents were kept are listed by
name, so the list can only shrink: a section re-measured with `make bench` keeps its
documents, and a new section cannot join the page without them."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from specmoe.bench import report, summary
from specmoe.bench.report import section_block
from specmoe.bench.sections import COMMANDS_FILE, SECTIONS, keep_documents, render, write_report

ROOT = Path(__file__).resolve().parent.parent
KEPT = ROOT / "benchmarks" / "results"
PAGE = ROOT / "BENCHMARKS.md"

# Their figures predate benchmarks/results/: re-measuring a section (make bench, or
# benchmarks/run_all.py --only NAME) keeps its documents and takes it off this list.
MEASURED_BEFORE_DOCUMENTS_WERE_KEPT: set[str] = set()


# A measured figure in prose: a decimal, a ratio (2x), a share (30 %), or a quantity with a
# unit. Settings (B = 16, gamma 4), dates, commits and model names (Mixtral-8x7B) are none.
FIGURE = re.compile(r"\d+\.\d+|\b\d+\s?(x|×|%)(?!\w)|\b\d+\s?(tok/s|[KMG]i?B|ms|us|s)\b")
BEGIN = re.compile(r"<!-- specmoe bench: begin (\S+) -->")


def hand_written(page: str) -> list[str]:
    """The page's lines outside every section's markers."""
    out, inside = [], False
    for line in page.splitlines():
        if BEGIN.match(line):
            inside = True
        elif line.startswith("<!-- specmoe bench: end"):
            inside = False
        elif not inside:
            out.append(line)
    return out


def kept(section) -> bool:
    return all((KEPT / run.output).is_file() for run in section.runs)


def test_every_section_on_the_page_has_its_documents_or_is_listed_as_older():
    without = {s.name for s in SECTIONS if section_block(PAGE.read_text(), s.name) is not None and not kept(s)}
    assert without == MEASURED_BEFORE_DOCUMENTS_WERE_KEPT


@pytest.mark.parametrize("section", [s for s in SECTIONS if kept(s)], ids=lambda s: s.name)
def test_section_renders_byte_for_byte_from_its_committed_documents(section):
    assert render(section, KEPT) == section_block(PAGE.read_text(), section.name)


def test_a_changed_figure_in_a_document_changes_the_rendered_section(tmp_path):
    section = next(s for s in SECTIONS if s.name == "real-size")
    for path in KEPT.iterdir():
        shutil.copy(path, tmp_path / path.name)
    doc_path = tmp_path / section.runs[0].output
    doc = json.loads(doc_path.read_text())
    record = next(r for r in doc["records"] if r.get("decode_tokens_per_s"))
    record["decode_tokens_per_s"] *= 1.5
    doc_path.write_text(json.dumps(doc))
    assert render(section, tmp_path) != section_block(PAGE.read_text(), section.name)


def test_keep_documents_copies_a_sections_documents_and_their_commands(tmp_path):
    results, kept_dir = tmp_path / "results", tmp_path / "kept"
    results.mkdir()
    section = next(s for s in SECTIONS if s.name == "real-size")
    for run in section.runs:
        (results / run.output).write_text(json.dumps({"which": run.output}))
    (results / "grid.json").write_text("{}")  # another section's document stays behind
    (results / COMMANDS_FILE).write_text(json.dumps({run.output: f"cmd {run.output}" for run in section.runs}))
    (kept_dir).mkdir()
    (kept_dir / COMMANDS_FILE).write_text(json.dumps({"grid.json": "older grid command"}))

    copied = keep_documents(results, kept_dir, ["real-size"])

    assert copied == [run.output for run in section.runs]
    assert sorted(p.name for p in kept_dir.iterdir()) == sorted([COMMANDS_FILE, *copied])
    assert json.loads((kept_dir / section.runs[0].output).read_text()) == {"which": section.runs[0].output}
    commands = json.loads((kept_dir / COMMANDS_FILE).read_text())
    assert commands == {"grid.json": "older grid command", **{r.output: f"cmd {r.output}" for r in section.runs}}


def test_hand_written_text_holds_no_figures_and_runs_no_commands_of_its_own():
    """Every figure is inside a generated section; the only commands outside are the make
    targets that run or render the sections (a hand-run command's figures cannot be renewed)."""
    lines, fenced, in_code = hand_written(PAGE.read_text()), [], False
    for line in lines:
        if line.startswith("```"):
            in_code = not in_code
        elif in_code:
            fenced.append(line)
    prose = [line for line in lines if not line.startswith("```") and line not in fenced]
    assert [line for line in prose if FIGURE.search(re.sub(r"`[^`]*`", "", line))] == []
    assert all(line.startswith("make bench") for line in fenced), fenced


def test_the_figure_check_sees_a_figure_in_prose():
    for text in ("1.96x faster", "2x ondemand", "at 30 % budget", "164.1 tok/s", "1.5 MiB", "42 ms"):
        assert FIGURE.search(text), text
    for text in ("at B = 16", "gamma 4 and 16", "Mixtral-8x7B layer shape", "measured on 2026-12-02", "float32"):
        assert not FIGURE.search(text), text


def test_every_section_on_the_page_is_one_that_run_all_runs():
    assert set(BEGIN.findall(PAGE.read_text())) <= {s.name for s in SECTIONS} | {summary.SUMMARY}


def _entries(results: Path):
    return summary.headlines(SECTIONS, [results])


def test_the_page_opens_with_its_summary_rendered_from_the_committed_documents():
    page = PAGE.read_text()
    assert page.split("\n")[2] == report.BEGIN.format(summary.SUMMARY)  # under the title, before any section
    assert section_block(page, summary.SUMMARY) == summary.page_summary(_entries(KEPT))


def test_readmes_headline_table_is_rendered_from_the_committed_documents():
    readme = (ROOT / "README.md").read_text()
    assert section_block(readme, summary.HEADLINES) == summary.front_table(_entries(KEPT))


def test_readmes_rows_are_llama_cpp_on_the_same_file_and_specmoe_against_ondemand():
    front = section_block((ROOT / "README.md").read_text(), summary.HEADLINES)
    for name in ("same-file", "gguf-disk", "real-size"):
        title = next(s.title for s in SECTIONS if s.name == name)
        assert f"(BENCHMARKS.md#{summary.slug(title)})" in front


def test_the_summary_names_every_section_with_ratios_and_links_to_headings_on_the_page():
    page = PAGE.read_text()
    headings = {summary.slug(line.lstrip("#").strip()) for line in page.splitlines() if line.startswith("## ")}
    block = section_block(page, summary.SUMMARY)
    links = re.findall(r"\]\(#([^)]+)\)", block)
    assert links and set(links) <= headings
    for section, rows, _ in _entries(KEPT):
        assert f"(#{summary.slug(section.title)})" in block
        assert all(f"| {h.what} |" in block for h in rows)


def test_a_changed_figure_changes_the_summary_and_readmes_table(tmp_path):
    for path in KEPT.iterdir():
        shutil.copy(path, tmp_path / path.name)
    doc = json.loads((tmp_path / "same-file.json").read_text())
    row = next(r for r in doc["records"] if r["type"] == "Q4_K_M")
    row["ratio_median"], row["ratio_low"] = 0.5, 0.4
    (tmp_path / "same-file.json").write_text(json.dumps(doc))
    changed = _entries(tmp_path)
    assert summary.page_summary(changed) != summary.page_summary(_entries(KEPT))
    assert "0.50x" in summary.front_table(changed) and "not met" in summary.front_table(changed)


def test_write_report_puts_the_summary_at_the_top_and_rewrites_readmes_table(tmp_path):
    page, readme = tmp_path / "BENCHMARKS.md", tmp_path / "README.md"
    page.write_text("# Benchmarks\n\nHand-written.\n")
    readme.write_text(f"# x\n\n{report.BEGIN.format(summary.HEADLINES)}\nold\n{report.END.format(summary.HEADLINES)}\n")
    write_report(KEPT, page)
    text = page.read_text()
    assert text.startswith(f"# Benchmarks\n\n{report.BEGIN.format(summary.SUMMARY)}\n## Summary")
    assert text.index("Hand-written.") < text.index(report.BEGIN.format("same-file"))
    assert section_block(readme.read_text(), summary.HEADLINES) == summary.front_table(_entries(KEPT))
    write_report(KEPT, page)  # a second time: the same page, one summary
    assert page.read_text() == text


def test_slug_is_githubs_heading_anchor():
    assert summary.slug("The same GGUF file as llama.cpp") == "the-same-gguf-file-as-llamacpp"
    assert summary.slug("Real size: every policy's start-up and memory") == "real-size-every-policys-start-up-and-memory"
    assert summary.slug("`--policy auto` against the best fixed policy") == "--policy-auto-against-the-best-fixed-policy"
