"""How far each way of holding an expert for the draft puts the draft's output from the
model's, per MoE block: what the allocation (allocation.py) trades against bytes.

Measured on the block's real inputs (the hidden states a prefill routed into it): for
the block's most picked experts, the relative L2 error ||y' - y|| / ||y|| of the expert's
output y when it is replaced by its quantized copy (each mode) or by its nearest other
expert (substitution, by the affinity table). Averaged over those experts: one figure
per block and way. Beside them, each block's share of the residual stream (its output's
norm over the stream's after it, `RESIDUAL_SHARE`): the same relative error moves the
stream, and the drafted token, more where the block writes more of it (`block_weights`).
Cached next to the quantized copies, keyed by the checkpoint, so it is measured once per
model.

Before anything is measured, `DEFAULT_ERRORS` stands in (measured this way on the bundled
demo model, rounded up).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ...base.checkpoint import Checkpoint
from ...base.files import keep
from ...experts.quant import BITS, quantize_expert, quantized_expert_forward
from ...model.moe import run_expert
from .allocation import FULL, SUBSTITUTE

DEFAULT_ERRORS = {FULL: 0.0, "int8": 0.01, "int4": 0.12, "int3": 0.25, "int2": 0.45, SUBSTITUTE: 1.3}
SAMPLED_EXPERTS = 2  # per block: the most picked (what the error weighs most)
SAMPLE_ROWS = 64  # a prefill's block inputs measured on, per block
RESIDUAL_SHARE = "residual_share"  # in a block's row, beside its ways' errors: not a way


def default_errors(layers) -> dict[int, dict[str, float]]:
    return {layer: dict(DEFAULT_ERRORS) for layer in layers}


def mean_errors(table: dict[int, dict[str, float]]) -> dict[str, float]:
    """Each way's error averaged over the blocks (what the allocation weighs)."""
    ways = set.intersection(*(set(row) for row in table.values())) - {RESIDUAL_SHARE}
    return {w: sum(row[w] for row in table.values()) / len(table) for w in sorted(ways)}


def block_weights(table: dict[int, dict[str, float]]) -> dict[int, float]:
    """How much a pick in each block counts against one in the average block: the square
    of its share of the residual stream, over the mean square (all 1 before it is measured).

    On the demo model the first MoE block writes about all of the stream (0.98) and the
    others a sixth to a fifth, and their output errors are alike; a pick's cost measured
    from the draft's acceptance (benchmarks/pick_costs.py) was 2.8x the blocks' mean in the
    first block for int2 and 3.5x for substitution, and in the others it rose with the share
    (int2: 0.009 at 0.16 to 0.019 at 0.21). The share itself would weigh the first block
    3.4x; its square (6.4x) drafted more tokens per step, at 5 and 10 % of the expert bytes
    (demo model, 32 training prompts, B = 16; square root / share / square: 4.21 / 4.48 /
    4.80 at 5 %, 9.08 / 9.62 / 10.31 at 10 %; cubed 4.76 and 10.13; no weights 3.03, 9.02).
    On the translation model's two drafting blocks (shares 0.75 and 0.54) the squares weigh
    1.32 and 0.68, and the measured costs were 1.31-1.36x and 0.64-0.69x their mean."""
    squares = {layer: row.get(RESIDUAL_SHARE, 1.0) ** 2 for layer, row in table.items()}
    mean = sum(squares.values()) / len(squares)
    return {layer: s / mean if mean > 0 else 1.0 for layer, s in squares.items()}


def errors_path(ckpt: Checkpoint, cache_dir: Path) -> Path:
    return Path(cache_dir) / f"draft-errors-{ckpt.fingerprint()}.json"


def cached_errors(ckpt: Checkpoint, cache_dir: Path | None, ways) -> dict[int, dict[str, float]] | None:
    """The cached table when it covers every drafting block and way, with each block's share
    of the residual stream, else None (measured again)."""
    if cache_dir is None or not errors_path(ckpt, cache_dir).is_file():
        return None
    try:
        raw = json.loads(errors_path(ckpt, cache_dir).read_text())
        table = {int(layer): {w: float(v) for w, v in row.items()} for layer, row in raw.items()}
    except (ValueError, AttributeError, TypeError):
        return None  # damaged: measured again
    whole = set(table) == set(ckpt.config.draft_layer_ids) and all(
        {*ways, RESIDUAL_SHARE} <= set(row) and all(0 <= v < 100 for v in row.values()) for row in table.values())
    return table if whole else None


@torch.no_grad()
def measure_block(ckpt: Checkpoint, layer: int, x: torch.Tensor, counts: list[int],
                  distances: torch.Tensor | None, modes) -> dict[str, float]:
    """One block's row of the table, from its inputs `x` [T, D] (the first SAMPLE_ROWS are
    used): the relative output error of each quantized `mode` and of substitution, averaged
    over its SAMPLED_EXPERTS most picked experts (`counts`: picks per expert)."""
    spec = ckpt.config.expert
    x = x[:SAMPLE_ROWS].float().cpu()  # the experts are read to the host: measured there, no device bytes
    experts = sorted(range(len(counts)), key=lambda e: (-counts[e], e))[:SAMPLED_EXPERTS]
    sums = {w: 0.0 for w in (*modes, SUBSTITUTE)}
    for e in experts:
        buf = ckpt.expert_buffer(layer, e, torch.float32)
        y = run_expert(buf, x, spec)
        for mode in modes:
            y_q = quantized_expert_forward(x, quantize_expert(buf, spec, BITS[mode]), spec)
            sums[mode] += _relative(y_q, y)
        other = _nearest(distances, e, len(counts))
        sums[SUBSTITUTE] += _relative(run_expert(ckpt.expert_buffer(layer, other, torch.float32), x, spec), y)
    return {FULL: 0.0, **{w: v / len(experts) for w, v in sums.items()}}


def save_errors(ckpt: Checkpoint, cache_dir: Path | None, table: dict[int, dict[str, float]]) -> None:
    if cache_dir is None:
        return
    text = json.dumps({str(layer): row for layer, row in sorted(table.items())}, indent=1)
    keep(errors_path(ckpt, cache_dir), lambda tmp: Path(tmp).write_text(text), "the draft's measured errors")


def _relative(approx: torch.Tensor, exact: torch.Tensor) -> float:
    return float((approx - exact).norm() / exact.norm().clamp_min(1e-30))


def _nearest(distances: torch.Tensor | None, e: int, num_experts: int) -> int:
    """The expert substitution would run for `e` if `e` were not held: its nearest other."""
    if distances is None:
        return (e + 1) % num_experts
    d = distances[e].clone()
    d[e] = float("inf")
    return int(torch.argmin(d))
