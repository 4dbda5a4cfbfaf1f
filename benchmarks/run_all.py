"""Run every benchmark behind BENCHMARKS.md and rewrite it: `make bench`.

Each section of BENCHMARKS.md (src/specmoe/bench/sections.py) names the commands that
measure it; each writes one JSON document into --results. This script runs them in
order (the calibration first: `auto` in the grid and the validation use it), records
the exact command behind each document (commands.json), then rewrites the sections from
the documents (what `make bench-report` / `specmoe bench --report` does alone). The
documents of every section it measured, and their commands, are then copied into
benchmarks/results/, which is committed with the page: rendering from there reproduces
it byte for byte (tests/test_benchmarks_page.py).

    python benchmarks/run_all.py                        # everything (about an hour on 2 cores)
    python benchmarks/run_all.py --only projections     # some sections
    python benchmarks/run_all.py --smoke --results /tmp/smoke   # every command's reduced form, in minutes

--smoke runs each command's reduced form into its own results dir and renders a copy of
the report there (never BENCHMARKS.md itself), with a private cache dir: it proves the
commands and the rendering work, its figures mean nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

from specmoe.bench.sections import COMMANDS_FILE, SECTIONS, keep_documents, write_report

ROOT = Path(__file__).resolve().parent.parent
KEPT = ROOT / "benchmarks" / "results"  # committed: the documents behind BENCHMARKS.md (tests/test_benchmarks_page.py)


def shell_command(command: str, results: Path) -> str:
    """The command as run: {out} filled in, `python` this interpreter."""
    command = command.replace("{out}", shlex.quote(str(results)))
    return sys.executable + command[len("python"):] if command.startswith("python ") else command


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--results", default="bench-results", help="where the JSON documents go (default bench-results)")
    ap.add_argument("--markdown", help="the file to rewrite (default BENCHMARKS.md; with --smoke RESULTS/BENCHMARKS.md)")
    ap.add_argument("--only", help="comma-separated section names: " + ", ".join(s.name for s in SECTIONS))
    ap.add_argument("--smoke", action="store_true", help="each command's reduced form (proves it works; figures meaningless)")
    args = ap.parse_args(argv)
    only = [n.strip() for n in args.only.split(",")] if args.only else None
    unknown = set(only or ()) - {s.name for s in SECTIONS}
    if unknown:
        ap.error(f"unknown section(s) {', '.join(sorted(unknown))}; choose from {', '.join(s.name for s in SECTIONS)}")
    results = Path(args.results)
    results.mkdir(parents=True, exist_ok=True)
    markdown = Path(args.markdown) if args.markdown else (results / "BENCHMARKS.md" if args.smoke else ROOT / "BENCHMARKS.md")
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    if args.smoke:
        env.setdefault("SPECMOE_CACHE_DIR", str(results / "cache"))
    failed = []
    for section in SECTIONS:
        if only and section.name not in only:
            continue
        for run in section.runs:
            command = (run.smoke if args.smoke else run.command).replace("{out}", str(results))
            print(f"run_all [{section.name}] {command}", file=sys.stderr, flush=True)
            (results / run.output).unlink(missing_ok=True)  # a failed command leaves no stale figures
            start = time.perf_counter()
            done = subprocess.run(shell_command(run.smoke if args.smoke else run.command, results), shell=True,
                                  cwd=ROOT, env=env, executable="/bin/bash")
            print(f"run_all [{section.name}] exit {done.returncode} after {time.perf_counter() - start:.0f} s",
                  file=sys.stderr, flush=True)
            if done.returncode != 0 or not (results / run.output).is_file():
                failed.append(f"{section.name} (exit {done.returncode}): {command}")
            if (results / run.output).is_file():  # shown beside its figures, even when they report a failure
                # read again: another run_all may have recorded its sections into the same dir meanwhile
                recorded = json.loads((results / COMMANDS_FILE).read_text()) if (results / COMMANDS_FILE).is_file() else {}
                recorded[run.output] = command
                (results / COMMANDS_FILE).write_text(json.dumps(recorded, indent=1) + "\n")
    measured = write_report(results, markdown)  # every section, so the page keeps its order
    print(f"run_all: rewrote {markdown}: {', '.join(measured) or 'no section'} with figures", file=sys.stderr)
    if not args.smoke and markdown.resolve() == (ROOT / "BENCHMARKS.md").resolve():
        ran = [s.name for s in SECTIONS if (not only or s.name in only) and s.name in measured]
        kept = keep_documents(results, KEPT, ran)
        print(f"run_all: kept {len(kept)} document(s) in {KEPT.relative_to(ROOT)} (commit them with the page)",
              file=sys.stderr)
    for f in failed:
        print(f"run_all: FAILED {f}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
