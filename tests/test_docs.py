"""README.md and docs/ stay true: every `specmoe ...` command they show parses with the
command's own parser (an unknown command or flag, or a bad value, fails), every Python
block runs against the bundled demo models unless its first line says what else it
needs (`# needs: ...`), and every link between the pages leads to a file and heading
that exist."""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import shlex
from pathlib import Path

import pytest

from specmoe.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
NEEDS = "# needs:"  # a Python block's first line: what it needs beyond the demo models (it is not run here)
FENCE = re.compile(r"^```(\S*)")
OPERATORS = {"&&", "||", ";", "|", "&", ">", ">>", "<", "2>", "2>&1", "&>"}


def blocks(page: Path) -> list[tuple[str, int, list[str]]]:
    """(language, line number of its first line, its lines) of every fenced block."""
    out, current = [], None
    for number, line in enumerate(page.read_text().splitlines(), 1):
        if current is None and (m := FENCE.match(line)):
            current = (m.group(1), number + 1, [])
        elif current is not None and line.startswith("```"):
            out.append(current)
            current = None
        elif current is not None:
            current[2].append(line)
    assert current is None, f"{page.name}: a code block is not closed"
    return out


def prose(page: Path) -> list[tuple[int, str]]:
    """(line number, line) of the page outside its fenced blocks."""
    out, inside = [], False
    for number, line in enumerate(page.read_text().splitlines(), 1):
        if line.startswith("```"):
            inside = not inside
        elif not inside:
            out.append((number, line))
    return out


def split_commands(text: str) -> list[list[str]]:
    """The simple commands of one shell line (comments dropped; `&&`, `|`, `&`, `;` and
    redirections end a command)."""
    lexer = shlex.shlex(text, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    commands, current = [], []
    for token in lexer:
        if token in OPERATORS or set(token) <= set("&|;<>"):
            commands.append(current)
            current = []
        else:
            current.append(token)
    return [c for c in commands + [current] if c]


def specmoe_commands() -> list[tuple[str, list[str]]]:
    """(where, argv after `specmoe`) of every command in the pages' shell blocks (a line
    continued with `\\`, or inside an open quote, joined to the next)."""
    found = []
    for page in PAGES:
        for language, first, lines in blocks(page):
            if language not in ("", "bash", "sh", "shell", "console"):
                continue
            joined, start = "", first
            for number, line in enumerate(lines, first):
                if not joined:
                    start = number
                joined += line[:-1] + " " if line.endswith("\\") else line
                if line.endswith("\\"):
                    continue
                try:
                    commands = split_commands(joined)
                except ValueError:  # a quote that the next line closes
                    joined += "\n"
                    continue
                for command in commands:
                    if command[0] == "specmoe":
                        found.append((f"{page.name}:{start}", command[1:]))
                joined = ""
            assert not joined, f"{page.name}:{start}: a command is not finished"
    return found


def inline_commands() -> list[tuple[str, list[str]]]:
    """(where, argv after `specmoe`) of every command named in inline code of the prose:
    often a part of one (`specmoe info --device-memory SIZE`), so only its command and
    flags are checked, not its values or the flags it leaves out."""
    return [(f"{page.name}:{number}", shlex.split(span)) for page in PAGES for number, line in prose(page)
            for span in re.findall(r"`specmoe( [^`]*)`", line)]


COMMANDS, INLINE = specmoe_commands(), inline_commands()


def parse(argv: list[str]) -> str | None:
    """None where the parser takes `argv`, else its error."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            build_parser().parse_args(argv)
    except SystemExit as exc:
        return err.getvalue().strip() or f"exit {exc.code}"
    return None


def unknown_words(argv: list[str]) -> list[str]:
    """The command and flags of `argv` that the parser does not have."""
    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    words = [w for w in argv if w.startswith("-")] if argv[0].startswith("-") else argv[1:]
    command = next((w for w in argv if not w.startswith("-")), None)
    if command not in commands:
        return [command]
    known = set(parser._option_string_actions) | set(commands[command]._option_string_actions)
    return [w for w in words if w.startswith("--") and w.split("=")[0] not in known]


def test_the_pages_show_commands_of_every_kind():
    shown = {argv[0] for _, argv in COMMANDS if argv and not argv[0].startswith("-")}
    assert {"generate", "serve", "info", "bench", "calibrate", "simulate", "quantize"} <= shown
    assert len(COMMANDS) > 20 and len(INLINE) > 20


@pytest.mark.parametrize("where,argv", COMMANDS, ids=[f"{w} {' '.join(a)[:60]}" for w, a in COMMANDS])
def test_every_specmoe_command_in_the_docs_parses(where, argv):
    assert parse(argv) is None, f"{where}: specmoe {' '.join(argv)}: {parse(argv)}"


@pytest.mark.parametrize("where,argv", INLINE, ids=[f"{w} {' '.join(a)[:60]}" for w, a in INLINE])
def test_every_specmoe_command_named_in_the_prose_exists_with_its_flags(where, argv):
    assert unknown_words(argv) == [], f"{where}: specmoe {' '.join(argv)}"


def test_an_unknown_flag_or_command_fails_the_check():
    assert unknown_words(["info", "--device-memory", "SIZE"]) == []
    assert unknown_words(["--debug", "generate", "..."]) == []
    assert unknown_words(["info", "--no-such-flag", "SIZE"]) == ["--no-such-flag"]
    assert unknown_words(["no-such-command"]) == ["no-such-command"]
    assert parse(["generate", "--max-tokens", "8", "--policy", "specmoe"]) is None
    assert "unrecognized arguments: --no-such-flag" in parse(["generate", "--no-such-flag"])
    assert "invalid choice" in parse(["no-such-command"])
    assert "invalid int value" in parse(["generate", "--max-tokens", "many"])
    lines = split_commands("specmoe serve --port 8000 &  # the demo model")
    assert lines == [["specmoe", "serve", "--port", "8000"]]
    assert split_commands("make anchors && specmoe bench --json a.json > out") == [
        ["make", "anchors"], ["specmoe", "bench", "--json", "a.json"], ["out"]]


def python_blocks(page: Path) -> list[tuple[int, str, bool]]:
    """(line, code, runs here) of each Python block of the page."""
    return [(first, "\n".join(lines), not (lines and lines[0].startswith(NEEDS)))
            for language, first, lines in blocks(page) if language == "python"]


RUNNABLE = [page for page in PAGES if any(runs for _, _, runs in python_blocks(page))]


@pytest.mark.parametrize("page", RUNNABLE, ids=lambda p: p.name)
def test_every_python_block_runs_against_the_demo_models(page, capsys):
    """The page's blocks run in order in one namespace, as a reader runs them one after
    another in one session."""
    namespace: dict = {"__name__": "__docs__"}
    for first, code, runs in python_blocks(page):
        if runs:
            exec(compile(code, f"{page.name}:{first}", "exec"), namespace)  # noqa: S102
    assert capsys.readouterr().out.strip(), f"{page.name}: its blocks printed nothing"


def test_a_block_that_is_not_run_says_what_it_needs():
    skipped = [(page.name, first, code) for page in PAGES for first, code, runs in python_blocks(page) if not runs]
    assert skipped, "no block is marked: the marker check below checks nothing"
    for name, first, code in skipped:
        reason = code.splitlines()[0][len(NEEDS):].strip()
        assert len(reason) > 10, f"{name}:{first}: say what the block needs"


def _anchors(page: Path) -> set[str]:
    """The anchors of the page's headings, as GitHub makes them (a repeated one gets -1, -2, ...)."""
    from specmoe.bench.summary import slug

    seen: dict[str, int] = {}
    for _, line in prose(page):
        if m := re.match(r"#+ (.*)", line):
            base = slug(m.group(1))
            seen[base] = seen.get(base, -1) + 1
    return {f"{a}-{n}" if n else a for a, count in seen.items() for n in range(count + 1)}


def test_every_link_between_the_pages_leads_somewhere():
    broken = []
    for page in PAGES:
        text = "\n".join(line for _, line in prose(page))
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                broken.append(f"{page.name}: {target}")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                broken.append(f"{page.name}: {target} (no such heading)")
    assert broken == []


def test_every_page_links_every_other_page():
    for page in PAGES[1:]:
        text = page.read_text()
        missing = [p.name for p in PAGES[1:] if p != page and f"]({p.name})" not in text]
        assert missing == [] and "](../README.md)" in text, f"{page.name} does not link {missing}"
        assert "../shared" not in text
    readme = PAGES[0].read_text()
    assert [p.name for p in PAGES[1:] if f"](docs/{p.name})" not in readme] == []


def test_readme_is_a_front_door_and_no_page_repeats_another():
    assert len(PAGES[0].read_text().splitlines()) <= 150
    seen: dict[str, str] = {}
    repeated = []
    for page in PAGES:
        for _, line in prose(page):
            if len(line) >= 60 and not line.startswith("[README]"):  # the pages' common links aside
                if seen.setdefault(line, page.name) != page.name:
                    repeated.append(f"{seen[line]} and {page.name}: {line}")
    assert repeated == []
