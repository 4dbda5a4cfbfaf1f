"""Engine replicas on Ray: offline throughput of one engine against 1 and N replicas on
this machine, and (--project) how replicas scale on a multi-GPU cluster by the
performance model.

Measured: one Ray cluster on this machine's CPUs; each round runs one engine in this
process (no Ray), then `ReplicatedLLM` with each replica count sharing the CPUs evenly
(threads: half of each replica's CPUs, as one engine takes half the machine's), on the
same held-out prompts; replica start-up is not timed. Rounds interleave the setups so
that machine noise hits them alike; the figure is generated tokens over wall time, its
ratio against one replica measured in the same round. Every setup's outputs must be
identical (token_ids_sha256), or the run fails.

    python benchmarks/replicas.py --json replicas.json                 # the demo model, 1 and 2 replicas
    python benchmarks/replicas.py --project --json projection.json     # the performance model, no Ray

Projected: N replicas are N independent engines, so a cluster's throughput is the sum of
its replicas'; what they share is per node: with the host tier each GPU has its own PCIe
link, but every copy comes out of the node's DRAM (a replica gets at most its share of
the DRAM bandwidth, and each replica keeps its own copy of the experts in host memory);
with the disk tier the replicas of a node divide its SSD's bandwidth (one shared file).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent
PROJECTION_GPUS = 8  # the cluster of the projection: 8 GPUs as 8 x 1, 4 x 2, 2 x 4, 1 x 8 per node
PROJECTION_TIERS = {"host": "h100-pcie5", "disk": "h100-pcie5-ssd"}


def load_prompts(path: Path, n: int) -> list[str]:
    prompts = [json.loads(line)["prompt"] for line in path.read_text().splitlines() if line.strip()]
    if len(prompts) < n:
        raise SystemExit(f"{path} holds {len(prompts)} prompts, {n} asked")
    return prompts[:n]


# --- measured on this machine ---------------------------------------------------------------------


def timed(generate, prompts, params) -> float:
    start = time.perf_counter()
    generate(prompts, params)
    return time.perf_counter() - start


def one_round(args, prompts, params, engine: dict, cpus: int) -> list[dict]:
    """One engine in this process, then each replica count: one record each."""
    from specmoe import LLM
    from specmoe.distributed import ReplicatedLLM

    records = []
    llm = LLM(model=args.model, **engine)
    llm.generate(prompts[:2], params)  # warm-up: first passes, file caches
    wall = timed(llm.generate, prompts, params)
    records.append(record("one engine, no Ray", 0, wall, llm.last_stats))
    llm.close()
    for n in args.replica_counts:
        with ReplicatedLLM(args.model, replicas=n, replica_cpus=cpus / n, **engine) as replicas:
            replicas.generate(prompts[: 2 * n], params)
            wall = timed(replicas.generate, prompts, params)
            records.append(record(f"{n} replica{'s' if n > 1 else ''}", n, wall, replicas.last_stats))
    return records


def record(setup: str, replicas: int, wall_s: float, stats: dict) -> dict:
    return {"setup": setup, "replicas": replicas, "wall_s": wall_s, "generated_tokens": stats["generated_tokens"],
            "tokens_per_s": stats["generated_tokens"] / wall_s, "token_ids_sha256": stats["token_ids_sha256"]}


def measure(args) -> dict:
    import ray

    from specmoe import SamplingParams

    cpus = os.cpu_count() or 1
    prompts = load_prompts(Path(args.prompts), args.num_prompts)
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    engine = dict(device="cpu", policy=args.policy, offload=args.offload, device_memory=args.device_memory,
                  max_batch_size=args.batch_size, max_model_len=args.max_model_len)
    ray.init(num_cpus=cpus, include_dashboard=False, logging_level="WARNING")
    try:
        records = [dict(r, round=i) for i in range(args.rounds) for r in one_round(args, prompts, params, engine, cpus)]
    finally:
        ray.shutdown()
    if len({r["token_ids_sha256"] for r in records}) != 1:
        raise SystemExit("the setups' outputs differ: " + json.dumps(records))
    return {"cpus": cpus, "config": {**engine, **vars(args)}, "records": records, "summary": summarize(records)}


def summarize(records: list[dict]) -> list[dict]:
    """Median tokens/s per setup, and its median ratio against one replica in the same round."""
    one = {r["round"]: r["tokens_per_s"] for r in records if r["replicas"] == 1}
    rows = []
    for setup in dict.fromkeys(r["setup"] for r in records):
        mine = [r for r in records if r["setup"] == setup]
        ratios = [r["tokens_per_s"] / one[r["round"]] for r in mine if r["round"] in one]
        rows.append({"setup": setup, "replicas": mine[0]["replicas"],
                     "tokens_per_s": statistics.median(r["tokens_per_s"] for r in mine),
                     "x_one_replica": statistics.median(ratios) if ratios else None})
    return rows


# --- projected by the performance model ----------------------------------------------------------


def project(args) -> dict:
    from specmoe.costmodel import cost_model
    from specmoe.costmodel.cost_model import Scenario
    from specmoe.costmodel.hardware import load_profile
    from specmoe.costmodel.routing import DEFAULT_ACCEPTANCE, DEFAULT_DRAFT_EXPERTS
    from specmoe.costmodel.shapes import load_shape

    shape = load_shape(args.model_shape)
    rows = []
    for tier, profile in PROJECTION_TIERS.items():
        hw = load_profile(profile)
        for per_node in (1, 2, 4, 8):
            shared = per_replica_link(hw, per_node)
            sc = Scenario(shape, shared)
            for batch in args.project_batch_sizes:
                spec = cost_model.specmoe(sc, batch, args.gamma, DEFAULT_DRAFT_EXPERTS, DEFAULT_ACCEPTANCE)
                ondemand = cost_model.estimate("ondemand", sc, batch)
                rows.append({
                    "tier": tier, "hardware": profile, "gpus_per_node": per_node, "batch_per_replica": batch,
                    "fetch_bw_per_replica": shared.fetch_bw, "specmoe_tokens_per_s": spec.decode_tokens_per_s,
                    "ondemand_tokens_per_s": ondemand.decode_tokens_per_s,
                    "cluster_tokens_per_s": PROJECTION_GPUS * spec.decode_tokens_per_s,
                    # host tier: each replica its own copy in DRAM; disk tier: one file the replicas share
                    "expert_bytes_per_node": (per_node if tier == "host" else 1) * shape.expert_bytes_total,
                })
    for row in rows:  # against one replica with a node to itself
        alone = next(r for r in rows if r["tier"] == row["tier"] and r["gpus_per_node"] == 1
                     and r["batch_per_replica"] == row["batch_per_replica"])
        row["x_one_replica"] = row["cluster_tokens_per_s"] / alone["specmoe_tokens_per_s"]
    return {"model_shape": shape.name, "gpus": PROJECTION_GPUS, "gamma": args.gamma,
            "draft_experts": DEFAULT_DRAFT_EXPERTS, "acceptance": DEFAULT_ACCEPTANCE, "rows": rows}


def per_replica_link(hw, per_node: int):
    """The profile as one of `per_node` replicas on a node sees it: host tier, its own
    PCIe link but a share of the DRAM bandwidth; disk tier, a share of the SSD."""
    if hw.slow_tier == "host":
        link = min(hw.h2d_bw, hw.host_mem_bw / per_node)
        return dataclasses.replace(hw, h2d_bw=link, slow_tier_read_bw=link)
    return dataclasses.replace(hw, slow_tier_read_bw=hw.slow_tier_read_bw / per_node)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="model directory (default: the bundled demo model)")
    p.add_argument("--prompts", default=str(ROOT / "prompts" / "heldout.jsonl"))
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=16, help="each replica's batch (and chunk) size")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--max-model-len", type=int, default=256)
    p.add_argument("--policy", default="specmoe")
    p.add_argument("--offload", default="disk")
    p.add_argument("--device-memory", default="30%")
    p.add_argument("--replicas", default="1,2", help="replica counts to measure, e.g. 1,2")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--project", action="store_true", help="the performance model's projection instead (no Ray)")
    p.add_argument("--model-shape", default="mixtral-8x7b", help="--project: the model shape")
    p.add_argument("--project-batch-sizes", default="64,256", help="--project: batch per replica")
    p.add_argument("--gamma", type=int, default=5, help="--project: draft tokens per step")
    p.add_argument("--json", metavar="FILE", help="write the document BENCHMARKS.md is rendered from")
    args = p.parse_args(argv)
    args.replica_counts = [int(n) for n in args.replicas.split(",")]
    args.project_batch_sizes = [int(b) for b in args.project_batch_sizes.split(",")]
    if args.project:
        doc = project(args)
        for r in doc["rows"]:
            print(f"{r['tier']} tier, {r['gpus_per_node']} GPUs/node, B={r['batch_per_replica']}: "
                  f"{r['specmoe_tokens_per_s']:.0f} tok/s per replica, {doc['gpus']} GPUs "
                  f"{r['cluster_tokens_per_s']:.0f} tok/s ({r['x_one_replica']:.2f}x one replica)")
    else:
        doc = measure(args)
        print("; ".join(f"{r['setup']}: {r['tokens_per_s']:.1f} tok/s"
                        + (f" ({r['x_one_replica']:.2f}x one replica)" if r["x_one_replica"] else "")
                        for r in doc["summary"]) + f" on {doc['cpus']} CPUs")
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
