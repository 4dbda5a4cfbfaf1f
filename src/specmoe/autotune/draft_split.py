"""`--draft-memory auto`: how the device budget is split between the draft and
verification's pool, chosen for this model, batch size and machine when the engine starts.

A bigger draft accepts more tokens per step but leaves verification fewer pool slots,
so each verify pass fetches more; its copies' format sets what a draft pass costs. Each
candidate is a draft memory D, a share of the room the budget leaves for experts, with
the ways its experts may be held: the allocator's mix (`--draft-quant auto`), one copy
format, or the paper's draft of full experts only (`none`, D a whole count of them per
block). Full experts are pinned in the pool, where verification uses them too. Each is
planned as the engine would start it (`Start`: the allocation before routing is seen,
with its expected cost) and predicted in decode tokens/s:

- tokens per step from the per-token acceptance an earlier run of this model measured
  with that draft memory and ways (history.py), else from the allocation's expected cost
  (`prior_acceptance`) at this model's rate (`fitted_rate`: the drafts it measured, else
  the demo model's COST_RATE), so that a prior kinder than measurement does not win the
  split over the drafts that were measured;
- step time: gamma draft passes and one verify pass over B (gamma + 1) positions, at the
  run's gamma, or where gamma is tuned step by step (the default) at the gamma predicted
  fastest (where the tuner takes the run); each pass its non-expert work from the cost
  model on this machine's calibrated profile plus its experts at the time one expert of
  this model takes here on that many rows, held each way (`time_experts`:
  a fused int8 or int4 kernel, or the portable layout that dequantizes per call, which at
  real sizes is many times slower than accuracy alone would say), and the verify pass's
  fetches: the experts it picks beyond each block's N full-precision draft experts and
  the pool's other slots keep (`kept_by_lru`), as far as verification's compute does
  not hide them.

Its best candidates are often predicted within a few percent of each other, closer than
the model's error (real-size model, B = 16: 32.1 to 33.4 tok/s predicted for 70 to 90 %
of the room, where 70 % ran 10 % faster than 90 %). So every split is ranked by its
prediction scaled by the median measured / predicted of the splits earlier runs timed here
at this batch size (speeds.py, runs of four steps or more), and a timed split's is held
within the range its runs measured (`with_measured_speeds`): one run decides by its
measurement, runs spread over hours of a shared machine leave the model to rank within
their spread; nothing measured: the model alone.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, replace

import torch

from ..base.config import MAX_GAMMA
from ..base.errors import SpecMoEError
from ..base.units import format_bytes
from ..costmodel.cost_model import Scenario, pass_work
from ..costmodel.routing import tokens_per_step
from ..experts.quant import BITS, draft_kernel_choices, quantize_expert, quantized_expert_forward
from ..policies.specmoe import WORKING_SLOTS
from ..policies.specmoe.allocation import FULL, SUBSTITUTE
from ..policies.specmoe.draft_memory import Start, draft_ways
from .measure import timed

# Draft memories tried, as shares of the room the budget leaves for experts.
SHARES = (0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)
# Per-token acceptance from the allocation's expected cost (a sum over blocks of each
# pick's chance to change the drafted token): 1 - COST_RATE * sqrt(cost). Fitted on the
# demo model's training prompts (B = 16, the 30 % budget, gamma 16, 48 tokens), in
# relative terms: costs 0.004 .. 3.6 measured acceptance 0.987 .. 0.48, each within a third
# of 1 - a (an exponential in the cost, fitted the same way, capped the acceptance at 0.98
# and could not tell a draft of int8 copies of every expert, 0.99+, from one at 0.98:
# at gamma 16 that is 15.7 tokens per step against 13.9). A run's measured acceptance
# replaces it for its draft. Fitted again once the allocator weighed blocks by their share of
# the residual stream (training prompts, B = 16, 20 to 70 %: costs 0.54 .. 0.0007, acceptance
# 0.85 .. 0.99): 0.221.
COST_RATE = 0.22
LEAST_VERIFY_SLOTS = WORKING_SLOTS + 1  # fewer than this and verification streams every expert twice
MIN_TIME_S = 0.05  # each expert timing repeated at least this long


@dataclass(frozen=True)
class SplitPoint:
    """One candidate split, predicted."""

    draft_memory: int
    draft_quant: str  # the ways: auto (the allocator's mix) or one copy format
    verify_slots: int  # pool slots beside the draft's full-precision experts
    full_per_block: int
    acceptance: float
    measured: bool  # acceptance from an earlier run of this draft, not the prior
    tokens_per_step: float
    step_s: float
    batch: int
    gamma: int  # drafted tokens per step: the run's fixed gamma, or the one the tuner is predicted to settle at
    key: str = ""  # the draft as history.py and speeds.py keep it (history_key)
    scale: float = 1.0  # measured / predicted of the splits that were measured (median)
    seen_runs: tuple[float, ...] = ()  # tokens/s of this split's runs here at this batch size
    rate: float = COST_RATE  # the prior's rejection rate per sqrt(cost) (fitted_rate)

    @property
    def predicted_tokens_per_s(self) -> float:
        return self.batch * self.tokens_per_step / self.step_s

    @property
    def seen_tokens_per_s(self) -> float | None:
        """Where runs timed this split: its scaled prediction, held within their range."""
        if not self.seen_runs:
            return None
        return min(max(self.predicted_tokens_per_s * self.scale, min(self.seen_runs)), max(self.seen_runs))

    @property
    def tokens_per_s(self) -> float:
        seen = self.seen_tokens_per_s
        return self.predicted_tokens_per_s * self.scale if seen is None else seen

    def describe(self, room: int) -> str:
        source = ("measured" if self.measured else "prior" if self.rate == COST_RATE
                  else f"prior at this model's measured rate {self.rate:.2f}")
        if len(self.seen_runs) == 1:
            speed = f"{self.tokens_per_s:.1f} tok/s measured here ({self.predicted_tokens_per_s:.1f} predicted)"
        elif self.seen_runs:
            speed = (f"{self.tokens_per_s:.1f} tok/s: {self.predicted_tokens_per_s:.1f} predicted, scaled by "
                     f"{self.scale:.2f} and held within the {min(self.seen_runs):.1f}-{max(self.seen_runs):.1f} "
                     f"its {len(self.seen_runs)} runs measured here")
        elif self.scale != 1.0:
            speed = (f"{self.tokens_per_s:.1f} tok/s predicted, scaled by {self.scale:.2f} as the splits "
                     "measured here ran")
        else:
            speed = f"{self.tokens_per_s:.1f} tok/s predicted"
        return (f"draft memory {format_bytes(self.draft_memory)} ({self.draft_memory / room:.0%} of the expert room, "
                f"{self.draft_quant}), {self.verify_slots} verify slots: {self.tokens_per_step:.2f} tokens/step "
                f"at gamma {self.gamma} ({source}), {speed}")


def prior_acceptance(cost: float, rate: float = COST_RATE) -> float:
    return max(0.0, 1.0 - rate * math.sqrt(max(0.0, cost)))


def fitted_rate(measured: list[tuple[float, float]]) -> float:
    """The prior's rate for this model: the median of (1 - acceptance) / sqrt(cost) over its
    drafts that earlier runs measured ((expected cost, per-token acceptance) pairs), else
    COST_RATE. Measured: on the real-size Q4_K_M file at 50 % of the experts, the demo model's
    rate put an unmeasured 60 % draft at 0.79 and it accepted 0.69, while the measured 90 %
    draft (0.74) ran faster; refitted on that one measured draft, the prior says 0.69.
    A draft no run ever rejected is no fit: its rate of 0 promised every draft of the model
    every token (the demo model's Q4_K file at B = 16: a 10 % draft, predicted 6.0 tokens
    a step, accepted 13 %)."""
    rates = _rates(measured)
    return statistics.median(rates) if rates else COST_RATE


def _rates(measured: list[tuple[float, float]]) -> list[float]:
    """(1 - acceptance) / sqrt(cost) of each draft that can be fitted on: one with a cost,
    that some run rejected."""
    return [(1.0 - a) / math.sqrt(cost) for cost, a in measured if cost > 1e-9 and a < 1.0]


def rates_by_ways(measured: list[tuple[str, float, float]]):
    """ways -> the prior's rate for drafts held those ways: fitted on the measured drafts of
    the same ways ((ways, cost, acceptance) triples), else on all of them but never below
    COST_RATE. Substitution and copies err differently per unit of expected cost: on the
    demo model at B = 1, the rate its int4 drafts showed (0.09) put an unmeasured paper's
    draft at 3.8 tokens a step, and it drafted 1.7."""
    overall = max(COST_RATE, fitted_rate([(cost, a) for _, cost, a in measured]))

    def rate(ways: str) -> float:
        same = [(cost, a) for w, cost, a in measured if w == ways]
        return fitted_rate(same) if _rates(same) else overall

    return rate


def ways_of(key: str) -> str:
    """The ways of a history_key ("memory@40.0%:auto" -> "auto")."""
    return key.rsplit(":", 1)[-1]


def history_key(draft_quant: str, draft_memory: int, config, slot_bytes: int) -> str:
    """The draft's key in history.py: its ways and its memory in percent of the drafting
    blocks' expert bytes (so that a budget given another way finds the same entry)."""
    expert_bytes = len(config.draft_layer_ids) * config.num_experts * slot_bytes
    return f"memory@{100 * draft_memory / expert_bytes:.1f}%:{draft_quant}"


def split_candidates(room: int, slot_bytes: int, ways: str = "auto", blocks: int = 1) -> list[int]:
    """Draft memories that leave verification at least LEAST_VERIFY_SLOTS slots: shares of
    the room, or for the paper's draft (`none`) each count of full experts per block."""
    most = room - LEAST_VERIFY_SLOTS * slot_bytes
    if ways == "none":
        return [n * blocks * slot_bytes for n in range(1, most // (blocks * slot_bytes) + 1)]
    return [int(share * room) for share in SHARES if int(share * room) <= most]


def ways_to_try(fused_modes: tuple[str, ...]) -> tuple[str, ...]:
    """The allocator's mix of every way, each copy format this machine multiplies with a
    fused kernel (the portable layout dequantizes a matrix per call: at real sizes the
    allocator's accuracy-only choice can be many times slower), and the paper's draft:
    the allocator weighs the draft's accuracy alone, and would hold copies as big as the
    experts (int4 of Q4_K) where pinning the experts also spares verification its reads."""
    return ("auto", *fused_modes, "none")


@dataclass(frozen=True)
class ExpertTimes:
    """Seconds one expert of this model takes here, held each way, on the rows a draft
    pass gives it (`draft`), and in full precision on the rows verify passes give it
    (`verify`: rows -> seconds, timed at the shortest and longest draft planned)."""

    draft: dict[str, float]
    verify: dict[int, float]

    def verify_s(self, rows: float) -> float:
        """Seconds at `rows`: the line through the row counts timed (one timed: that time),
        never below the fastest of them (a small pass still reads the whole expert)."""
        (r0, t0), (r1, t1) = min(self.verify.items()), max(self.verify.items())
        if r1 == r0:
            return t0
        return max(min(t0, t1), t0 + (t1 - t0) * (rows - r0) / (r1 - r0))


@torch.no_grad()
def time_experts(ckpt, pool_format, ways: tuple[str, ...], device, dtype, draft_rows: int,
                 verify_rows: tuple[int, ...], blocks: bool = False) -> ExpertTimes:
    """One expert of the first drafting block, timed in full precision as the pool holds it
    (`pool_format`: the runtime's expert_format; on the draft's rows, and on each of
    `verify_rows`) and as each quantized copy in the layout this device multiplies it in
    (quant.device_layout)."""
    spec, layer = ckpt.config.expert, ckpt.config.draft_layer_ids[0]
    exact = ckpt.expert_buffer(layer, 0, torch.float32)
    run_full = pool_expert(ckpt, layer, pool_format, device)
    x_draft = torch.randn(max(1, draft_rows), spec.hidden, device=device, dtype=dtype)
    times = {FULL: timed(lambda: run_full(x_draft), MIN_TIME_S)}
    for mode in ways:
        if mode != FULL:
            copy = quantize_expert(exact, spec, BITS[mode]).to(device, draft_kernel_choices(spec, mode, device, blocks),
                                                               blocks)
            times[mode] = timed(lambda: quantized_expert_forward(x_draft, copy, spec), MIN_TIME_S)
    verify = {}
    for rows in sorted({max(1, r) for r in verify_rows}):
        x_verify = torch.randn(rows, spec.hidden, device=device, dtype=dtype)
        verify[rows] = timed(lambda: run_full(x_verify), MIN_TIME_S)
    return ExpertTimes(times, verify)


def pool_expert(ckpt, layer: int, fmt, device):
    """Expert 0 of `layer` in a slot of format `fmt` (x -> output), as the pool computes it:
    a GGUF file's blocks multiplied as stored. Timed widened to float32 instead, a Q4_K
    expert was charged 3.2 ms at two rows on the real-size file, several times what the
    block kernel takes, and every split was predicted bound by compute."""
    slot = torch.empty(fmt.slot_numel, dtype=fmt.slot_dtype, device=device)
    fmt.prepare(fmt.read(ckpt, layer, 0).to(device), slot)
    return lambda x: fmt.forward(slot, x)


def with_measured_speeds(points: list[SplitPoint], seen: dict[str, list[float]]) -> list[SplitPoint]:
    """The points with the tokens/s runs measured here (`seen`: key -> its runs' tokens/s at
    this batch size). Every split is ranked by its prediction scaled by the median measured /
    predicted; a measured split's is held within the range its runs measured. One run: its
    measurement. Several: where they disagree by more than the model's differences, the
    model ranks within their spread. Runs of different splits come from different hours: on
    the real-size Q4_K_M file (disk tier, 50 %, B = 16) 7 pinned experts a block had run at
    32.5-40.6 tok/s and 4 at 31.7-42.1, predicted 68 and 39; ranked by its runs' medians the
    planner took 4, which reads 35 MB a token against 25 and ran 28 tok/s where 7 ran 43."""
    runs = {p.key: seen[p.key] for p in points if seen.get(p.key)}
    ratios = [statistics.median(runs[p.key]) / p.predicted_tokens_per_s for p in points
              if p.key in runs and p.predicted_tokens_per_s > 0]
    scale = statistics.median(ratios) if ratios else 1.0
    return [replace(p, scale=scale, seen_runs=tuple(runs.get(p.key, ()))) for p in points]


def verify_rows(sc: Scenario, batch: int, gamma: int) -> int:
    """Rows one full-precision expert gets in a verify pass at `gamma` (B (gamma + 1) positions)."""
    return math.ceil(batch * sc.shape.top_k * (gamma + 1) / sc.distinct(batch, gamma + 1))


def predict(start: Start, sc: Scenario, room: int, slot_bytes: int, batch: int, gamma: int,
            acceptance: float | None, times: ExpertTimes, key: str = "", rate: float = COST_RATE,
            adapt: bool = False) -> SplitPoint:
    """The split `start` describes, predicted on scenario `sc` with the experts' measured
    times, at `gamma`, or (`adapt`: gamma tuned step by step, engine/gamma.py) at the gamma
    up to MAX_GAMMA predicted fastest, where the tuner takes a run. Predicted at its first
    gamma instead (16), a draft accepting half its tokens was charged 16 draft passes for
    two tokens a step, and the splits' predictions ran 2-4x below what their runs measured."""
    plan, s = start.plan, sc.shape
    measured = acceptance is not None
    a = acceptance if measured else prior_acceptance(plan.cost, rate)
    verify_slots = (room - start.limit) // slot_bytes
    held = [how for how in plan.held.values() if how != SUBSTITUTE]  # a substituted pick runs one of these
    per_expert = sum(times.draft[how] for how in held) / len(held)
    draft = pass_work(sc, batch, 1, 0, routed=False).time_s + s.step_moe_layers * sc.distinct(batch) * per_expert

    def step_s(g: int) -> float:
        L = g + 1
        verify = (pass_work(sc, batch, L, 0, routed=False).time_s
                  + s.step_moe_layers * sc.distinct(batch, L) * times.verify_s(verify_rows(sc, batch, g)))
        kept = plan.full_per_block + kept_by_lru(sc, batch, L, plan.full_per_block, verify_slots)
        xfer = s.step_moe_layers * sc.fetch_s(sc.distinct(batch, L, exclude_hottest=min(s.num_experts, kept)))
        return g * draft + verify + max(0.0, xfer - sc.hardware.transfer_overlap * verify)

    gammas = range(0, max(gamma, MAX_GAMMA) + 1) if adapt else (gamma,)
    tokens, seconds, g = max(((tokens_per_step(a, g), step_s(g), g) for g in gammas), key=lambda t: t[0] / t[1])
    quant = start.options.allowed[-1] if len(start.options.allowed) == 1 else "auto"
    quant = "none" if quant == FULL else quant  # the paper's draft: full experts only
    return SplitPoint(start.limit, quant, verify_slots, plan.full_per_block, a, measured,
                      tokens, seconds, batch, g, key, rate=rate)


def kept_by_lru(sc: Scenario, batch: int, positions: int, pinned: int, slots: int) -> int:
    """Experts per block the pool's unpinned slots still hold when a verify pass comes back
    to the block. They are reused least recently first, and passes visit the blocks in turn,
    so they keep a block's experts only where a whole step's fetches fit in them; otherwise
    every slot is taken by the blocks after it before it is read again (a cyclic pattern,
    LRU's worst case). Counted as keeping the block's hottest, as an earlier model did for
    every slot: on the real-size Q4_K_M file at 50 %, B = 16, its 24 unpinned slots were
    predicted to keep 3 experts a block, and the verify passes read 121 of the 128 experts
    every step."""
    s = sc.shape
    fetched = s.step_moe_layers * sc.distinct(batch, positions, exclude_hottest=pinned)
    return slots // max(1, s.step_moe_layers) if slots >= fetched else 0


def choose_split(ckpt, pool_format, sc: Scenario, budget_limit: int, room: int, slot_bytes: int, device, dtype,
                 cache, batch: int, gamma: int, measured: dict[str, float],
                 fused_modes: tuple[str, ...], speeds_here: dict[str, list[float]] | None = None, blocks: bool = False,
                 adapt: bool = False) -> tuple[SplitPoint, list[SplitPoint]]:
    """(the fastest split, every split predicted). `pool_format`: how the pool holds an
    expert (the runtime's expert_format); `measured`: per-token acceptance earlier runs
    measured (history.py); `speeds_here`: their runs' tokens/s at this batch size (speeds.py);
    `adapt`: gamma is tuned step by step (predict's)."""
    c = ckpt.config
    longest = max(gamma, MAX_GAMMA) if adapt else gamma
    times = time_experts(ckpt, pool_format, draft_ways("auto", c.expert_quant), device, dtype,
                         math.ceil(batch * c.top_k / sc.distinct(batch)),
                         (verify_rows(sc, batch, 1 if adapt else gamma), verify_rows(sc, batch, longest)), blocks)
    starts = []
    for ways in ways_to_try(fused_modes):
        for memory in split_candidates(room, slot_bytes, ways, len(c.draft_layer_ids)):
            try:
                start = Start(ckpt, memory, budget_limit, slot_bytes, device, dtype, ways, cache, blocks=blocks)
            except SpecMoEError:
                continue  # holds nothing in some block
            starts.append((start, history_key(ways, memory, c, slot_bytes)))
    rates = rates_by_ways([(ways_of(key), start.plan.cost, measured[key]) for start, key in starts if key in measured])
    points = [predict(start, sc, room, slot_bytes, batch, gamma, measured.get(key), times, key,
                      rates(ways_of(key)), adapt) for start, key in starts]
    if not points:
        raise SpecMoEError(f"--draft-memory auto: the {format_bytes(room)} the budget leaves for experts hold no "
                           f"draft beside {LEAST_VERIFY_SLOTS} verification slots; raise --device-memory")
    points = with_measured_speeds(points, speeds_here or {})
    return max(points, key=lambda p: p.tokens_per_s), points
