"""BENCHMARKS.md's replicas section, from the documents `benchmarks/replicas.py` writes:
offline throughput of one engine and of 1 and N replicas on this machine, and the
performance model's projection of replicas on a multi-GPU cluster."""

from __future__ import annotations

from .report import md_table


def measured(doc: dict) -> str:
    c = doc["config"]
    rows = [[r["setup"], f"{r['tokens_per_s']:.1f}", "–" if r["x_one_replica"] is None else f"{r['x_one_replica']:.2f}x"]
            for r in doc["summary"]]
    return (f"{doc['cpus']} CPUs shared evenly by the replicas; {c['num_prompts']} held-out prompts, "
            f"{c['max_tokens']} new tokens each, batch {c['batch_size']} per replica, policy {c['policy']}, "
            f"{c['offload']} tier, budget {c['device_memory']}; median of {c['rounds']} interleaved rounds, "
            "outputs identical in every setup.\n\n"
            + md_table(["setup", "generated tok/s", "× 1 replica"], rows) + "\n")


def projection(doc: dict) -> str:
    rows = [[r["tier"], str(r["gpus_per_node"]), str(r["batch_per_replica"]),
             f"{r['fetch_bw_per_replica'] / 1e9:.1f}", f"{r['specmoe_tokens_per_s']:.0f}",
             f"{r['cluster_tokens_per_s']:.0f}", f"{r['x_one_replica']:.2f}x",
             f"{r['expert_bytes_per_node'] / 2**30:.0f} GiB {'in DRAM' if r['tier'] == 'host' else 'on disk'}"]
            for r in doc["rows"]]
    return (f"{doc['model_shape']}, SpecMoE (γ = {doc['gamma']}, N = {doc['draft_experts']}, acceptance "
            f"{doc['acceptance']} per token), {doc['gpus']} GPUs as nodes of 1 to 8 GPUs, one replica per GPU:\n\n"
            + md_table(["tier", "GPUs/node", "B/replica", "fetch GB/s per replica", "tok/s per replica",
                        f"{doc['gpus']} GPUs tok/s", "× 1 replica", "experts held per node"],
                       rows) + "\n")
