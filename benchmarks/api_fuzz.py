"""schemathesis against `specmoe serve` as a client developer runs it: every check, 100 examples
per operation, on the demo model and on the translation model (whose document has src_lang
and tgt_lang).

    python benchmarks/api_fuzz.py                                   # both bundled models
    python benchmarks/api_fuzz.py --models specmoe-demo --examples 20 --json fuzz.json

For each model it starts `specmoe serve` on a free loopback port and runs the schemathesis
CLI on its /openapi.json (`-c all -n N --seed S --request-timeout T --max-response-time T
--generation-database none`: no example database, so that a run replays nothing another
run found), prints the run's summary and, with --json, writes the counts. Exit status 1
when a run found a failure or an error. tests/test_server_fuzz.py runs the same checks in
the suite, on fewer examples.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from load_test import Server

MODELS = ("specmoe-demo", "specmoe-demo-translate")
SUMMARY = re.compile(r"^\s*(\d+) generated, (.+)$", re.MULTILINE)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default=",".join(MODELS), help=f"comma-separated (default {','.join(MODELS)})")
    p.add_argument("--examples", type=int, default=100, help="examples per operation (-n; default 100)")
    p.add_argument("--seed", type=int, default=1)
    # a chat request without max_tokens may fill the demo's 1024-token context: 6 s or more on 2 busy
    # cores, past schemathesis's default 10 s limits (its request timeout and `-c all`'s response time)
    p.add_argument("--request-timeout", type=float, default=60.0, help="seconds per request (default 60)")
    p.add_argument("--time-limit", type=float, default=180.0, help="seconds for a server to start (default 180)")
    p.add_argument("--json", help="write the runs' counts to this file")
    args = p.parse_args(argv)
    if args.examples < 1:
        p.error("--examples must be at least 1")
    return args


def schemathesis_command(url: str, args) -> list[str]:
    exe = shutil.which("schemathesis", path=str(Path(sys.executable).parent)) or shutil.which("schemathesis")
    if exe is None:
        raise SystemExit("api_fuzz: no schemathesis command: pip install -e '.[test]'")
    return [exe, "run", f"{url}/openapi.json", "-c", "all", "-n", str(args.examples), "--seed", str(args.seed),
            "--request-timeout", f"{args.request_timeout:g}", "--max-response-time", f"{args.request_timeout:g}",
            "--generation-database", "none"]


def fuzz(model: str, args) -> dict:
    """One model: serve it, run schemathesis on it, and read the counts off its summary."""
    server = Server(None if model == "specmoe-demo" else model, [], time.perf_counter() + args.time_limit)
    try:
        command = schemathesis_command(server.url, args)
        start = time.perf_counter()
        with tempfile.TemporaryDirectory() as scratch:  # its crash cache (.schemathesis/) goes there, not here
            done = subprocess.run(command, capture_output=True, text=True, check=False, cwd=scratch)
        seconds = time.perf_counter() - start
    finally:
        server.close()
    print(done.stdout[-3000:], done.stderr[-2000:], sep="", flush=True)
    found = SUMMARY.search(done.stdout)
    shown = " ".join(["schemathesis", *command[1:]]).replace(server.url, "http://127.0.0.1:PORT")
    return {"model": model, "command": shown, "exit": done.returncode, "seconds": round(seconds, 1),
            "generated": int(found.group(1)) if found else None, "outcome": found.group(2) if found else None}


def main(argv=None) -> int:
    args = parse_args(argv)
    runs = [fuzz(model.strip(), args) for model in args.models.split(",") if model.strip()]
    for run in runs:
        print(f"api_fuzz: {run['model']}: {run['generated']} generated, {run['outcome']} "
              f"(exit {run['exit']}, {run['seconds']:.0f} s)", file=sys.stderr)
    if args.json:
        Path(args.json).write_text(json.dumps({"examples": args.examples, "seed": args.seed, "runs": runs}, indent=1)
                                   + "\n")
    return 0 if all(run["exit"] == 0 for run in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
