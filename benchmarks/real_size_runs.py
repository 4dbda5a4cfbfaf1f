"""The fused-kernel guard at real size: the run that used to segfault, twice from one cache dir.

On an AVX-512 machine the int8 draft copies of a real-size model, read back from their
safetensors cache by the second run, crashed torch's int8 CPU kernel (the tensors start at
8-byte offsets). This runs what a user runs, as separate processes: `specmoe generate` with
every expert resident, then `--policy specmoe --offload disk --device-memory 30%` twice with
one fresh cache dir (the first run quantizes the experts and builds the disk tier's file,
the second reads both back), and records each run's exit status, wall time, peak RSS,
token_ids_sha256 and the fused kernels it used.

usage: python benchmarks/kernel_guard.py --json OUT.json [--model DIR] [--smoke]
  --model: a checkpoint (default: the real-size model, built by real_size_model.py into
  the results dir beside OUT.json when it is not there yet)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
PROMPTS = HERE / "prompts" / "heldout.jsonl"
sys.path.insert(0, str(HERE))

from real_size_model import DEMO, write  # noqa: E402

RUNS = (("resident", ["--policy", "resident"]),
        ("specmoe, first run", ["--policy", "specmoe", "--offload", "disk", "--device-memory", "30%"]),
        ("specmoe, from the caches", ["--policy", "specmoe", "--offload", "disk", "--device-memory", "30%"]))


def generate(model: Path, cache: Path, extra: list[str], prompts: int, tokens: int) -> dict:
    """One `specmoe generate` process: exit status, wall time, peak RSS (its own rusage), stats."""
    cmd = [sys.executable, "-m", "specmoe.cli", "generate", "--model", str(model), "--prompts-file", str(PROMPTS),
           "--num-prompts", str(prompts), "--batch-size", str(prompts), "--max-tokens", str(tokens), "--ignore-eos",
           "--json", *extra]
    start = time.perf_counter()
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, env=dict(os.environ, SPECMOE_CACHE_DIR=str(cache)))
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - start
        out.seek(0), err.seek(0)
        stdout, stderr = out.read().decode(errors="replace"), err.read().decode(errors="replace")
    code = os.waitstatus_to_exitcode(status)
    stats = json.loads(stdout)["stats"] if code == 0 else {}
    return {"command": "specmoe " + " ".join(cmd[3:]), "exit_status": code, "wall_s": wall,
            "peak_rss_bytes": usage.ru_maxrss * 1024, "stderr_tail": stderr.strip().splitlines()[-3:],
            "token_ids_sha256": stats.get("token_ids_sha256"), "fused_kernels": stats.get("fused_kernels", {}),
            "decode_tokens_per_s": stats.get("decode_tokens_per_s")}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", required=True, type=Path)
    p.add_argument("--model", type=Path, help="checkpoint directory (default: the real-size model)")
    p.add_argument("--smoke", action="store_true", help="a small widening, 4 prompts, 4 tokens: proves the script")
    args = p.parse_args(argv)
    model = args.model
    if model is None:
        factors = (2, 2) if args.smoke else (8, 16)
        model = args.json.resolve().parent / f"real-size-k{factors[0]}-m{factors[1]}"
        if not (model / "config.json").is_file():
            write(DEMO, model, *factors)
    prompts, tokens = (4, 4) if args.smoke else (16, 32)
    cache = Path(tempfile.mkdtemp(prefix="kernel-guard-cache-"))
    try:
        runs = []
        for label, extra in RUNS:
            runs.append({"run": label, **generate(model, cache, extra, prompts, tokens)})
            print(f"kernel_guard: {label}: exit {runs[-1]['exit_status']} after {runs[-1]['wall_s']:.0f} s",
                  file=sys.stderr, flush=True)
        machine = json.loads((cache / "kernels.json").read_text()) if (cache / "kernels.json").is_file() else {}
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    doc = {"model": str(model), "batch_size": prompts, "max_tokens": tokens, "runs": runs, "kernel_verdicts": machine}
    args.json.write_text(json.dumps(doc, indent=1) + "\n")
    return 0 if all(r["exit_status"] == 0 for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
