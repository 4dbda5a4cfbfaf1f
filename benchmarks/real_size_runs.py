"""Real size, as a user runs it: every policy's start-up and memory, first and cached runs.

Each run is its own `specmoe generate` process on the real-size model (real_size_model.py:
the demo model widened, 24 MiB bf16 experts), B = 16, held-out prompts, the disk tier at a
30 % budget. Measured from outside the process: its anonymous resident memory (RssAnon in
/proc, polled every 5 ms) against the bound a CPU run promises (1.15 x budget + 256 MiB),
its wall time, and start-up (wall time minus the generation's own). The runs, in order:
every expert resident; ondemand, caching and overlap each with a fresh cache dir (each
builds the disk tier's file) and again from ondemand's; SpecMoE with a fresh cache dir (it
builds the file and quantizes the int8 draft copies), then SpecMoE again from its caches:
the run that segfaulted in torch's int8 kernel before the kernel guard. Then ondemand and
SpecMoE again from those caches, --warm-rounds times in turn (4 tokens): the start-up with
warm caches compared on medians, not on one run each.

With --startup-against REV, SpecMoE's first run (fresh cache dir) of this tree and of REV's
package alternate for --rounds rounds after the runs above, so that their start-up times
are compared in one run.

usage: python benchmarks/real_size_runs.py --json OUT.json [--model DIR] [--smoke] [--warm-rounds 3]
                                           [--startup-against REV [--rounds 2]]
  --model: a checkpoint (default: the real-size model, built into the directory of OUT.json
  when it is not there yet)
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

from profile_passes import extract_src  # noqa: E402
from real_size_model import DEMO, write  # noqa: E402

from specmoe.base.checkpoint import Checkpoint  # noqa: E402
from specmoe.base.memory import anon_rss_bytes  # noqa: E402

OFFLOAD = ["--offload", "disk", "--device-memory", "30%"]
# (label, cache dir: a fresh one per policy's first run, policy flags)
RUNS = (("resident", "a", ["--policy", "resident"]),
        ("ondemand, first run", "a", ["--policy", "ondemand", *OFFLOAD]),
        ("ondemand", "a", ["--policy", "ondemand", *OFFLOAD]),
        ("caching, first run", "c", ["--policy", "caching", *OFFLOAD]),
        ("caching", "a", ["--policy", "caching", *OFFLOAD]),
        ("overlap, first run", "d", ["--policy", "overlap", *OFFLOAD]),
        ("overlap", "a", ["--policy", "overlap", *OFFLOAD]),
        ("specmoe, first run", "b", ["--policy", "specmoe", *OFFLOAD]),
        ("specmoe, from the caches", "b", ["--policy", "specmoe", *OFFLOAD]))


def generate(model: Path, cache: Path, extra: list[str], prompts: int, tokens: int, max_len: int | None,
             source: Path | None = None) -> dict:
    """One `specmoe generate` process (of the package under `source`, default this tree's):
    exit status, times, its peak anonymous RSS seen from outside, stats."""
    cmd = [sys.executable, "-m", "specmoe.cli", "generate", "--model", str(model), "--prompts-file", str(PROMPTS),
           "--num-prompts", str(prompts), "--batch-size", str(prompts), "--max-tokens", str(tokens), "--ignore-eos",
           "--json", *(["--max-model-len", str(max_len)] if max_len else []), *extra]
    start, peak = time.perf_counter(), 0
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        env = dict(os.environ, SPECMOE_CACHE_DIR=str(cache), **({"PYTHONPATH": str(source)} if source else {}))
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, env=env)
        while proc.poll() is None:
            peak = max(peak, anon_rss_bytes(proc.pid) or 0)
            time.sleep(0.005)
        wall = time.perf_counter() - start
        out.seek(0), err.seek(0)
        stdout, stderr = out.read().decode(errors="replace"), err.read().decode(errors="replace")
    stats = json.loads(stdout)["stats"] if proc.returncode == 0 else {}
    return {"command": "specmoe " + " ".join(cmd[3:]), "exit_status": proc.returncode, "wall_s": wall,
            "startup_s": wall - stats["wall_s"] if stats else None, "peak_anon_bytes": peak,
            "stderr_tail": stderr.strip().splitlines()[-3:], **{k: stats.get(k) for k in (
                "device_memory", "host_peak_bytes", "token_ids_sha256", "decode_tokens_per_s", "fused_kernels")}}


def startup_rounds(rev: str, rounds: int, model: Path, prompts: int, max_len: int | None) -> list[dict]:
    """SpecMoE's first run, this tree's and REV's in turn, each with a fresh cache dir: start-up per round."""
    out = []
    with tempfile.TemporaryDirectory(prefix="specmoe-src-") as tmp:
        sources = {"this tree": None, rev: extract_src(rev, tmp)}
        for i in range(rounds):
            for label, source in sources.items():
                cache = Path(tempfile.mkdtemp(prefix="real-size-cache-startup-"))
                try:
                    r = generate(model, cache, ["--policy", "specmoe", *OFFLOAD], prompts, 4, max_len, source)
                finally:
                    shutil.rmtree(cache, ignore_errors=True)
                out.append({"round": i, "source": label, **{k: r[k] for k in ("exit_status", "startup_s", "wall_s",
                                                                                "peak_anon_bytes")}})
                print(f"real_size_runs: start-up of {label}, round {i}: {r['startup_s']} s", file=sys.stderr,
                      flush=True)
    return out


def warm_rounds(rounds: int, model: Path, caches: dict[str, Path], prompts: int, tokens: int,
                max_len: int | None) -> list[dict]:
    """Start-up from warm caches, ondemand's and SpecMoE's in turn (a single run's start-up
    moves by seconds with the page cache and the import of torch): start-up per round."""
    out = []
    for i in range(rounds):
        for policy, cache in (("ondemand", "a"), ("specmoe", "b")):
            r = generate(model, caches[cache], ["--policy", policy, *OFFLOAD], prompts, tokens, max_len)
            out.append({"round": i, "policy": policy, **{k: r[k] for k in ("exit_status", "startup_s", "wall_s")}})
            print(f"real_size_runs: warm start-up of {policy}, round {i}: {r['startup_s']} s", file=sys.stderr,
                  flush=True)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", required=True, type=Path)
    p.add_argument("--model", type=Path, help="checkpoint directory (default: the real-size model)")
    p.add_argument("--smoke", action="store_true", help="a small widening, 4 prompts, 4 tokens: proves the script")
    p.add_argument("--startup-against", metavar="REV", help="also time SpecMoE's first start-up against REV's package")
    p.add_argument("--rounds", type=int, default=2, help="alternating rounds of --startup-against (default 2)")
    p.add_argument("--warm-rounds", type=int, default=3,
                   help="alternating rounds of ondemand's and SpecMoE's start-up from warm caches (default 3)")
    args = p.parse_args(argv)
    model = args.model
    if model is None:
        factors = (2, 2) if args.smoke else (8, 16)
        model = args.json.resolve().parent / f"real-size-k{factors[0]}-m{factors[1]}"
        if not (model / "config.json").is_file():
            write(DEMO, model, *factors)
    prompts, tokens, max_len = (4, 4, 256) if args.smoke else (16, 32, None)
    caches = {name: Path(tempfile.mkdtemp(prefix=f"real-size-cache-{name}-")) for name in {c for _, c, _ in RUNS}}
    try:
        runs = []
        for label, cache, extra in RUNS:
            runs.append({"run": label, **generate(model, caches[cache], extra, prompts, tokens, max_len)})
            print(f"real_size_runs: {label}: exit {runs[-1]['exit_status']} after {runs[-1]['wall_s']:.0f} s, peak "
                  f"anonymous {runs[-1]['peak_anon_bytes'] / 2**30:.2f} GiB", file=sys.stderr, flush=True)
        warm = warm_rounds(args.warm_rounds, model, caches, prompts, 4, max_len)
    finally:
        for cache in caches.values():
            shutil.rmtree(cache, ignore_errors=True)
    c = Checkpoint(model).config
    experts = c.expert_bytes(2) * len(c.moe_layer_ids) * c.num_experts  # as the checkpoint stores them, bf16
    doc = {"model": str(model), "expert_bytes": experts, "batch_size": prompts, "max_tokens": tokens, "runs": runs,
           "warm_startup": warm}
    if args.startup_against:
        doc["startup_against"] = {"rev": args.startup_against,
                                  "rounds": startup_rounds(args.startup_against, args.rounds, model, prompts, max_len)}
    args.json.write_text(json.dumps(doc, indent=1) + "\n")
    return 0 if all(r["exit_status"] == 0 for r in runs + warm) else 1


if __name__ == "__main__":
    sys.exit(main())
