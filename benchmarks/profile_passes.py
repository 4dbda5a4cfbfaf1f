"""Where the time of a decode step goes, at each batch size: a plain decode step
(resident), a draft forward and the verify part of a speculative step (SpecMoE on the disk
tier, 30 % budget), on the demo model's held-out prompts. Writes one JSON document.

    python benchmarks/profile_passes.py --json profile.json                 # this tree
    python benchmarks/profile_passes.py --source-rev c95390e --json before.json   # an older tree, same method
    python benchmarks/profile_passes.py --model bench-results/real-size-k8-m16 --policies specmoe \
        --batch-sizes 16 --gamma 10 --threads 1 --repeats 1 --json real-size-profile.json
    python benchmarks/profile_passes.py --model rs-Q4_K_M.gguf --dtype float32 ...   # the reference encoding

Method (src/specmoe/bench/profile.py): each unit is timed unprofiled (thread CPU time
and wall time, median of --repeats runs after a warm-up), then profiled once without
stacks (the share of time between operators) and once with Python stacks (each
operator's time and count by the code that called it).

--source-rev REV extracts REV's src/ into a temporary directory (git archive) and runs
this script against that package, with this tree's profiling code: the "before" of a
before/after table measured with one method.

--pair REV loads REV's package beside this tree's in one process (renamed, so both
import) and times their units in alternating rounds, no profiler: a before/after ratio
per round that holds when the machine's speed drifts between two separate runs.

    python benchmarks/profile_passes.py --pair c95390e --batch-sizes 16 --repeats 5 --json pair.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from specmoe import LLM, SamplingParams

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = ROOT / "benchmarks" / "prompts" / "heldout.jsonl"
PROFILE_MODULE = ROOT / "src" / "specmoe" / "bench" / "profile.py"


def load_profile_module():
    """This tree's profiling code, whichever specmoe package is imported (--source-rev)."""
    spec = importlib.util.spec_from_file_location("specmoe_profile", PROFILE_MODULE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def extract_src(rev: str, tmp: str) -> Path:
    """REV's src/ written under tmp (git archive); returns that src directory."""
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "src"], check=True, capture_output=True)
    subprocess.run(["tar", "-x", "-C", tmp], input=archive.stdout, check=True)
    return Path(tmp) / "src"


def run_at_source(rev: str, argv: list[str]) -> int:
    """Run this script again against REV's package (its src/ put first on the path)."""
    with tempfile.TemporaryDirectory(prefix="specmoe-src-") as tmp:
        env = dict(os.environ, PYTHONPATH=str(extract_src(rev, tmp)))
        rest, skip = [], False
        for a in argv:  # drop --source-rev REV; record it as the label
            if skip or a == "--source-rev" or a.startswith("--source-rev="):
                skip = a == "--source-rev"
                continue
            rest.append(a)
        return subprocess.run([sys.executable, __file__, *rest, "--source", rev], env=env).returncode


def package_at(rev: str, tmp: str):
    """REV's specmoe package imported as `specmoe_REV` (its imports are relative)."""
    src = extract_src(rev, tmp)
    alias = "specmoe_" + rev.replace("-", "_")
    os.rename(src / "specmoe", src / alias)
    sys.path.insert(0, str(src))
    return importlib.import_module(alias)


def measure_pair(prof, llms: dict, prompts, params, repeats: int) -> dict:
    """Per unit: each LLM's thread CPU ms per unit in every round, the LLMs taking turns
    (the order flips every round)."""
    inst = {name: prof.Instrumented(llm.engine) for name, llm in llms.items()}
    for llm in llms.values():
        llm.generate(prompts, params)  # warm-up
    rounds = {name: [] for name in llms}
    for r in range(repeats):
        for name in (list(llms) if r % 2 == 0 else list(llms)[::-1]):
            inst[name].clock.reset()
            llms[name].generate(prompts, params)
            clock = inst[name].clock
            rounds[name].append({u: 1e3 * clock.cpu[u] / n for u, n in clock.count.items() if n})
    return rounds


def run_pair(prof, args, prompts, params) -> list[dict]:
    rows = []
    with tempfile.TemporaryDirectory(prefix="specmoe-pair-") as tmp:
        old = package_at(args.pair, tmp)
        for batch, policy, options in setups(args):
            llms = {"before": old.LLM(**options), "after": LLM(**options)}
            rounds = measure_pair(prof, llms, prompts[: 2 * batch], params, args.repeats)
            for llm in llms.values():
                llm.close()
            for unit in rounds["after"][0]:
                before = [r[unit] for r in rounds["before"]]
                after = [r[unit] for r in rounds["after"]]
                ratios = [b / a for b, a in zip(before, after)]
                rows.append({"unit": unit, "batch_size": batch, "policy": policy,
                             "before_ms": before, "after_ms": after, "ratios": ratios,
                             "median_ratio": statistics.median(ratios)})
                print(f"B={batch} {policy} {unit}: before {statistics.median(before):.1f} ms, after "
                      f"{statistics.median(after):.1f} ms, per-round ratio median {statistics.median(ratios):.2f}x "
                      f"[{min(ratios):.2f}-{max(ratios):.2f}]", file=sys.stderr, flush=True)
    return rows


POLICIES = ("resident", "specmoe")


def policy_list(text: str) -> list[str]:
    """--policies: names from POLICIES, comma-separated."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in POLICIES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"{','.join(unknown) or text!r} is not a policy this script profiles; "
                                         f"choose from {', '.join(POLICIES)}")
    return names


def setups(args):
    """(batch size, policy, LLM options) of every measured configuration."""
    for batch in [int(b) for b in args.batch_sizes.split(",")]:
        common = dict(model=args.model, max_batch_size=batch, max_model_len=320, threads=args.threads, dtype=args.dtype)
        options = {"resident": dict(policy="resident", **common),
                   "specmoe": dict(policy="specmoe", offload="disk", device_memory="30%", gamma=args.gamma, **common)}
        for policy in args.policies:
            yield batch, policy, options[policy]


def write_doc(path: str, doc: dict) -> None:
    Path(path).write_text(json.dumps(doc, indent=1) + "\n")
    print(f"profile_passes: wrote {path}", file=sys.stderr)


def measure_policy(prof, llm, prompts, params, repeats: int) -> dict:
    """Unit timings (median run) and the two profiles of one LLM."""
    inst = prof.Instrumented(llm.engine)
    llm.generate(prompts, params)  # warm-up: caches, expert file, first draft set
    runs = []
    for _ in range(repeats):
        inst.clock.reset()
        llm.generate(prompts, params)
        runs.append({u: (inst.clock.cpu[u] / n, inst.clock.wall[u] / n, n)
                     for u, n in inst.clock.count.items() if n})
    units = {u: {"cpu_ms": 1e3 * statistics.median(r[u][0] for r in runs),
                 "wall_ms": 1e3 * statistics.median(r[u][1] for r in runs),
                 "units_per_run": runs[0][u][2]} for u in runs[0]}
    inst.clock.reset()
    with profile(activities=[ProfilerActivity.CPU]) as plain:
        llm.generate(prompts, params)
    outside = prof.outside_share(plain.events())
    inst.clock.reset()
    with profile(activities=[ProfilerActivity.CPU], with_stack=True) as stacked:
        llm.generate(prompts, params)
    shares = prof.operator_shares(stacked.events(), inst.clock.count)
    for u, row in units.items():
        row.update(outside_share=outside.get(u), **shares.get(u, {"operators": None, "categories": {}}))
    return units


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch-sizes", default="1,16,64")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--gamma", type=int, default=5)
    ap.add_argument("--threads", type=int, help="torch threads (default: the engine's)")
    ap.add_argument("--model", help="model directory or GGUF file (default: the bundled demo model)")
    ap.add_argument("--dtype", default="auto", help="the engine's --dtype (float32: the reference encoding, every "
                    "weight dequantized to float32 as it is multiplied)")
    ap.add_argument("--policies", type=policy_list, default="resident,specmoe",
                    help="comma-separated, from: " + ", ".join(POLICIES))
    ap.add_argument("--source-rev", help="profile this git revision's package instead of this tree's")
    ap.add_argument("--source", help=argparse.SUPPRESS)  # set by --source-rev in the child run
    ap.add_argument("--pair", metavar="REV", help="time REV's package against this tree's in one process, alternating")
    ap.add_argument("--json", metavar="FILE", required=True)
    args = ap.parse_args(argv)
    if args.source_rev:
        return run_at_source(args.source_rev, argv)
    prof = load_profile_module()
    prompts = [json.loads(line)["prompt"] for line in PROMPTS.open()]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    if args.pair:
        doc = {"kind": "profile-pair", "before": args.pair, "after": "this tree",
               "command": "python benchmarks/profile_passes.py " + " ".join(argv),
               "rows": run_pair(prof, args, prompts, params)}
        write_doc(args.json, doc)
        return 0
    rows = []
    for batch, policy, options in setups(args):
        llm = LLM(**options)
        units = measure_policy(prof, llm, prompts[: 2 * batch], params, args.repeats)
        draft_quant = (llm.last_stats or {}).get("draft_quant")
        llm.close()
        for unit, row in units.items():
            rows.append({"unit": unit, "batch_size": batch, "policy": policy, "draft_quant": draft_quant, **row})
        print(f"B={batch} {policy}: " + ", ".join(f"{u} {r['cpu_ms']:.1f} ms cpu ({r['operators'] or 0:.0f} ops)"
                                                 for u, r in units.items()), file=sys.stderr, flush=True)
    doc = {"kind": "profile-passes", "source": args.source or "this tree",
           "command": "python benchmarks/profile_passes.py " + " ".join(argv),
           "config": {"batch_sizes": args.batch_sizes, "max_tokens": args.max_tokens, "repeats": args.repeats,
                      "gamma": args.gamma, "threads": torch.get_num_threads(), "torch": torch.__version__,
                      "model": args.model, "dtype": args.dtype},
           "categories": list(prof.CATEGORIES), "rows": rows}
    write_doc(args.json, doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
