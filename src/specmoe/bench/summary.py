"""The summary at the top of BENCHMARKS.md and the headline table of README.md, both made
from the sections' own documents (headlines.py), so that re-rendering the page keeps them
true. Each row is a ratio measured within one run, with its goal and a link to the
section that shows the command, the machine and every figure behind it."""

from __future__ import annotations

import json
import re
from pathlib import Path

from .headlines import BY_SECTION, Headline
from .report import BEGIN, END, has_section, md_table, update_markdown
from .section import Section

SUMMARY = "summary"  # the marker name of the page's summary (report.BEGIN / END)
HEADLINES = "headlines"  # the marker name of README's headline table


def slug(title: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")


def documents(section: Section, dirs: list[Path]) -> dict[str, dict] | None:
    """The section's documents from the first of `dirs` that holds all of them; None if none does."""
    for d in dirs:
        if all((d / run.output).is_file() for run in section.runs):
            return {run.output: json.loads((d / run.output).read_text()) for run in section.runs}
    return None


def headlines(sections, dirs: list[Path]) -> list[tuple[Section, list[Headline], dict | None]]:
    """(section, its ratios, the machine its documents name) for every section with ratios
    whose documents are in `dirs`, in BY_SECTION's order (README's sections first)."""
    by_name = {s.name: s for s in sections}
    out = []
    for name, ratios in BY_SECTION.items():
        if (section := by_name.get(name)) is None or (docs := documents(section, dirs)) is None:
            continue
        rows = ratios(docs)
        if rows:
            machine = next((d["machine"] for d in docs.values() if isinstance(d, dict) and "machine" in d), None)
            out.append((section, rows, machine))
    return out


def _goal(h: Headline) -> str:
    if h.goal is None:
        return "–"
    return f"{'≤' if h.at_most else '≥'} {h.goal:.1f}x" if round(h.goal, 1) == h.goal else \
        f"{'≤' if h.at_most else '≥'} {h.goal:.2f}x"


def _met(h: Headline) -> str:
    return "–" if h.met is None else ("yes" if h.met else "no")


def _measured(h: Headline, link: str | None = None) -> str:
    ratio = f"[{h.ratio:.2f}x]({link})" if link else f"{h.ratio:.2f}x"
    return f"{ratio} ({h.spread})" if h.spread else ratio


def _machine(machine: dict | None) -> str:
    if not machine:
        return "–"
    gpu = f", GPU {machine['gpu']}" if machine.get("gpu") else ""
    return f"{machine['cores']}-core {machine['cpu']}{gpu}"


def page_summary(entries) -> str:
    """BENCHMARKS.md's summary: every ratio, its goal, whether it is met and its section."""
    rows = [[h.what, _measured(h), _goal(h), _met(h), f"[{section.title}](#{slug(section.title)})"]
            for section, found, _ in entries for h in found]
    return ("## Summary\n\nEvery ratio a section below sets a goal for, and the ones README.md shows, each "
            "of two figures measured in the same run. Met: by the section's own rule, which can ask more than "
            "the median shown here (every round, or every repeat, above the goal). The section has the "
            "command, the machine and the figures behind each row.\n\n"
            + md_table(["ratio", "measured", "goal", "met", "section"], rows) + "\n")


def front_table(entries, page: str = "BENCHMARKS.md") -> str:
    """README's headline table: the `front` ratios, each linking to its section of `page`."""
    rows = []
    for section, found, machine in entries:
        link = f"{page}#{slug(section.title)}"
        rows += [[h.what, _measured(h, link), f"{_goal(h)}: {'met' if h.met else 'not met'}"
                  if h.met is not None else _goal(h), _machine(machine)] for h in found if h.front]
    return (md_table(["measured within one run", "ratio", "goal", "machine"], rows) + "\n\n"
            "Each ratio links to its section of BENCHMARKS.md: the command, the date and every figure behind it. "
            "The table is rewritten from the same documents as that page.\n")


def write_summaries(markdown: Path, sections, dirs: list[Path]) -> None:
    """Rewrite the summary of `markdown` (put at its top, under the title, when it has none)
    and, where README.md beside it holds the headline markers, README's table."""
    entries = headlines(sections, dirs)
    body = page_summary(entries)
    if has_section(markdown, SUMMARY):
        update_markdown(markdown, SUMMARY, body)
    else:
        title, _, rest = markdown.read_text().partition("\n")
        block = f"{BEGIN.format(SUMMARY)}\n{body}{END.format(SUMMARY)}\n"
        markdown.write_text(f"{title}\n\n{block}\n{rest.lstrip(chr(10))}")
    readme = markdown.parent / "README.md"
    if has_section(readme, HEADLINES):
        update_markdown(readme, HEADLINES, front_table(entries, markdown.name))
