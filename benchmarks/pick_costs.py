"""What a draft pick costs in each way the draft can hold its expert, and in each block,
measured from the draft's acceptance; beside what the allocator weighs instead (the
relative output error, and each block's share of the residual stream).

The model: a drafted token survives each of its P picks (top_k per drafting block) held
way w with chance exp(-c_w), independently, so its acceptance is exp(-P * sum_w s_w c_w),
s_w the share of the draft's picks held w (the run's `draft_picks_by_way`).

1. Every drafting expert held one way (int8 .. int2 copies of all of them): c_w = -ln(a) / P.
2. int8 copies of the most picked experts, the rest substituted, at two draft memories:
   c_substitute from what the substituted share adds.
3. Block by block: one block's experts held int2 (then: its less picked half substituted),
   every other expert an int8 copy: what a pick costs in that block.

    python benchmarks/pick_costs.py --json pick-costs.json
    python benchmarks/pick_costs.py --model specmoe-demo-translate \\
        --prompts-file benchmarks/prompts/translate_heldout.jsonl --prompts-skip 200 --json pick-costs-translate.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
from pathlib import Path

from specmoe import LLM, SamplingParams
from specmoe.base.checkpoint import Checkpoint
from specmoe.base.paths import offload_dir, resolve_model_dir
from specmoe.bench.draft_memory import COPY_WAYS
from specmoe.policies.specmoe import draft_memory
from specmoe.policies.specmoe.allocation import FULL, SUBSTITUTE, Allocation, pick_cost
from specmoe.policies.specmoe.draft_quality import RESIDUAL_SHARE, block_weights, cached_errors, mean_errors

TRAIN = Path(__file__).resolve().parent / "prompts" / "train.jsonl"
# int8 copies of about half and three quarters of the drafting experts: the rest substituted
SUBSTITUTED_AT = (0.5, 0.75)
EVERYTHING = 2**62  # a draft memory that holds copies of every expert in any way


class Runs:
    """One engine per draft over the same prompts (no full-precision draft experts: every
    expert is a copy or substituted); what each measured."""

    def __init__(self, model, prompts, batch: int, tokens: int):
        self.model, self.prompts, self.batch = model, prompts, batch
        self.params = SamplingParams(max_tokens=tokens, temperature=0.0)

    def run(self, quant: str, memory: int) -> dict:
        llm = LLM(model=self.model, policy="specmoe", offload="host", draft_quant=quant, draft_memory=str(memory),
                  draft_experts=0, threads=1, max_batch_size=self.batch)
        try:
            llm.generate(self.prompts, self.params)
        finally:
            llm.close()
        s = llm.last_stats
        return {"draft_quant": quant, "draft_memory": memory, "tokens_per_step": s["tokens_per_step"],
                "acceptance_per_token": s["acceptance_per_token"], "picks_by_way": s["draft_picks_by_way"],
                "held": s["draft_held"], "copies_bytes": s["draft_copies_bytes"]}


@contextlib.contextmanager
def holding(held_of):
    """The draft holds what `held_of(shares)` says ((layer, expert) -> way) instead of what
    the allocator would choose."""
    keep = draft_memory.allocate

    def fixed(shares, options, budget, exclude=None, at_least_one=False):
        held = held_of(shares)
        return Allocation(held, sum(options.nbytes.get(h, 0) for h in held.values() if h != SUBSTITUTE), 0.0)

    draft_memory.allocate = fixed
    try:
        yield
    finally:
        draft_memory.allocate = keep


def per_pick(record: dict, picks_per_token: int, known: dict[str, float], way: str) -> float:
    """The cost of `way` in `record`, every other way's cost `known`, from its acceptance."""
    lost = -math.log(max(record["acceptance_per_token"], 1e-9)) / picks_per_token
    lost -= sum(share * known[w] for w, share in record["picks_by_way"].items() if w != way)
    return lost / record["picks_by_way"][way]


def measure_costs(runs: Runs, picks_per_token: int) -> tuple[dict[str, float], dict]:
    """Each way's cost per pick, over every block (1 and 2 above), and the runs behind them."""
    alone = [runs.run(w, EVERYTHING) for w in COPY_WAYS]
    copies_of_all = alone[0]["copies_bytes"]  # int8 copies of every drafting expert
    costs = {FULL: 0.0}
    for record in alone:
        costs[record["draft_quant"]] = per_pick(record, picks_per_token, costs, record["draft_quant"])
    substituted = []
    for share in SUBSTITUTED_AT:
        record = runs.run("int8", int(share * copies_of_all))
        record["cost"] = per_pick(record, picks_per_token, costs, SUBSTITUTE)
        substituted.append(record)
    costs[SUBSTITUTE] = sum(r["cost"] * r["picks_by_way"][SUBSTITUTE] for r in substituted) / sum(
        r["picks_by_way"][SUBSTITUTE] for r in substituted)  # weighted by the picks each measured
    return costs, {"alone": alone, "substituted": substituted}


def block_costs(runs: Runs, layers: list[int], picks_per_token: int, costs: dict[str, float]) -> list[dict]:
    """What a pick costs in each block (3 above): int2 there, then its less picked half
    substituted, every other expert int8."""
    rows = []
    for layer in layers:
        row = {"layer": layer}
        for way in ("int2", SUBSTITUTE):
            def held_of(shares, layer=layer, way=way):
                held = {}
                for l, picked in shares.items():
                    order = sorted(range(len(picked)), key=lambda e: (-picked[e], e))
                    for rank, e in enumerate(order):
                        cold = rank >= len(picked) // 2
                        held[(l, e)] = way if l == layer and (way == "int2" or cold) else "int8"
                return held

            with holding(held_of):
                record = runs.run("auto", EVERYTHING)
            row[way] = per_pick(record, picks_per_token, {**costs, way: 0.0}, way)
            row[f"{way}_record"] = record
        rows.append(row)
        print(f"block {layer}: int2 {row['int2']:.5f}, substitute {row[SUBSTITUTE]:.5f}", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="model directory (default: the bundled demo model)")
    ap.add_argument("--prompts-file", default=str(TRAIN))
    ap.add_argument("--prompts-skip", type=int, default=0)
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--json", metavar="FILE", required=True)
    args = ap.parse_args()
    lines = Path(args.prompts_file).read_text().splitlines()[args.prompts_skip:args.prompts_skip + args.num_prompts]
    prompts = [json.loads(line)["prompt"] for line in lines]
    runs = Runs(args.model, prompts, args.batch_size, args.max_tokens)
    ckpt = Checkpoint(resolve_model_dir(args.model))
    c = ckpt.config
    layers = list(c.draft_layer_ids)
    picks_per_token = c.top_k * len(layers)
    costs, measured = measure_costs(runs, picks_per_token)
    print("per-pick costs:", {w: round(v, 5) for w, v in costs.items()}, flush=True)
    blocks = block_costs(runs, layers, picks_per_token, costs)
    # what the engine measured and weighs (the block runs hold every way: their table covers them)
    table = cached_errors(ckpt, offload_dir(), COPY_WAYS)
    errors, weights = mean_errors(table), block_weights(table)
    for row in blocks:
        row.update(residual_share=table[row["layer"]][RESIDUAL_SHARE], weight=weights[row["layer"]])
    doc = {"model": args.model or "demo", "prompts_file": Path(args.prompts_file).name,
           "prompts_skip": args.prompts_skip, "prompts": len(prompts), "batch_size": args.batch_size,
           "max_tokens": args.max_tokens, "picks_per_token": picks_per_token, "costs": costs,
           "errors": {w: errors[w] for w in costs}, "error_costs": {w: pick_cost(errors[w]) for w in costs},
           **measured, "blocks": blocks}
    Path(args.json).write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
