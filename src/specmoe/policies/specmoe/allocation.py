"""What the draft holds under a memory budget, expert by expert (`--draft-memory`).

Each expert of a drafting block can be held for the draft in one of several ways, each
with its device bytes and how far the draft's output then is from the model's (measured
per block, averaged over blocks: draft_quality.py):

- `full`: the expert itself, pinned in the device pool (the paper's draft experts);
- `int8` .. `int2`: a quantized copy;
- `substitute`: nothing; a pick of it runs the nearest held expert instead (0 bytes).

The draft's expected cost is the sum, over blocks and experts, of how often the expert
is picked (its share of the block's picks) times the cost of the way it is held: a
model of the chance that a pick held so changes the drafted token, from its relative
output error (`pick_cost`), times the block's weight (how much of the residual stream
the block writes: a pick in the first block of the demo model costs several times one
in the others). Which way minimizes it within the budget is a multiple-choice
knapsack; `allocate` solves its relaxation greedily (each expert's choices on their lower
convex hull of bytes against cost, upgrades taken most cost saved per byte first), which
is within one upgrade of the optimum. Full-precision experts come first, as a count per
block (`choose_full`): they are pool slots, sized when the engine starts, holding the
run's hottest experts; the copies are chosen for the rest.

Plain Python: no tensors.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import Counter
from dataclasses import dataclass, field

FULL, SUBSTITUTE = "full", "substitute"
# A prior share of picks every expert gets (as if each had been picked once more than
# counted): routing counted over a few prompts misses experts that are picked later.
PRIOR_PICKS = 1.0
# What a pick held one way costs the draft: a model of the chance that it changes the
# drafted token, 1 - exp(-(error / ERROR_SCALE) ** ERROR_POWER) of its relative output
# error. It grows faster than the error while the error is small, and saturates: a
# substituted pick (error 1.1-1.4, from two sampled experts) is a likely miss whatever its
# exact error. First chosen on the demo model (training prompts, B = 16, gamma 16) as a
# cube, where a substitution cost about 16x an int2 copy per pick and int2 about 12x int4,
# against 2.7x and 3.7x in error: with the error itself as the cost the allocator spent 5 %
# of the expert bytes on int3 copies and substituted half the picks; cubed without
# saturation, it starved blocks whose two sampled substitutes happened to be closer.
# Measured from the draft's acceptance one way at a time (benchmarks/pick_costs.py), a pick's
# cost grows about linearly with the error; but with the error itself as the cost (block
# weights on) the allocator substituted 92 of 128 experts at 5 % and drafted 0.64x the tokens
# per step (0.86x at 10 %): substitutions cost more together than one at a time.
# Squared, not cubed, since the block weights. Tokens per step at 5 % (and 10 %), training
# prompts, squared against cubed: demo, B = 16: 5.01 (10.20) against 4.91 (9.97); B = 1: 4.39
# (9.21) against 4.56 (9.16); B = 64: 3.97 (9.46) against 4.11 (9.53); translation, B = 1,
# prompts 201-232: 11.47 against 12.16 (int3 alone 10.82), 265-296: 11.97 against 9.87 (int3
# 10.38), 297-360: 11.28 against 10.17 (int3 11.30). Against the best single format on the
# same prompts (int3 alone; demo 4.76 (9.18) at B = 16, 4.04 (9.93) at B = 1, 3.77 (8.67) at
# B = 64) the cube fell short at three of these nine points (demo, B = 1, 10 %: 0.92x;
# translation 265-296 and 297-360: 0.95x and 0.90x), the square at one (the same demo point:
# 0.93x; 1.00x on the held-out sample) and tied one (translation 297-360: 1.00x). On the
# translation model the square holds int3 copies of about half the experts where the cube held
# int2 (14 int2, 15 int3 and 3 substituted, against 24-28 int2 and 4-7 int3). Held out, the
# cube was 0.903x int3 alone at 5 %, B = 1 (192 translation prompts pooled), the square 1.022x.
# Where the draft is ample (every expert at least int4) the two hold the same: the upgrades
# left are int4 to int8, one step the same for every expert, taken most picked first.
# Also tried with the block weights: power 1.5: demo 3.64 (8.99), translation 11.26 (265-296); a
# smaller scale (0.6: substitution saturated, int2 over int3 as measured on the demo model):
# demo 4.08 (9.93), translation 11.52 (201-232); the measured costs themselves: demo 3.55 (8.91).
ERROR_SCALE, ERROR_POWER = 1.1, 2
# No 1-bit way: copies of each weight's sign times its group's mean |W| (half int2's bytes,
# output error 0.77 on the demo model) were tried at 5 % of its expert bytes, held for the
# rarely picked experts instead of substituting them. Tokens per step against int2 alone:
# 1.23x (B = 16) and 1.01x (B = 1) on training prompts, but 1.02x and 0.91x on held-out
# ones (12 of 16 requests lower); held alone they gave 0.7x int2's (translation: 0.45x),
# so a pick of one costs more than pick_cost of its error says. The relative error is not
# the whole story: leaving a pick out errs less than substituting it (the block's output:
# 0.61 against 0.74) yet drafted 0.81x the tokens per step (5 %, B = 16, training prompts).


def pick_cost(error: float) -> float:
    return 1.0 - math.exp(-((error / ERROR_SCALE) ** ERROR_POWER))


Key = tuple[int, int]
_ORDER = itertools.count()  # ties in the heap: first pushed first


@dataclass(frozen=True)
class Allocation:
    """How the draft holds each expert, the bytes that takes and its expected cost."""

    held: dict[Key, str]  # (layer, expert) -> full | int8 | ... | substitute
    nbytes: int
    cost: float  # sum over blocks of the picks' expected cost, pick_cost x block weight (0: the model's own experts)
    full_per_block: int = 0

    def count(self) -> dict[str, int]:
        return dict(sorted(Counter(self.held.values()).items()))

    def copies(self) -> dict[Key, str]:
        """The quantized copies to load: every expert held neither in full nor substituted."""
        return {k: how for k, how in self.held.items() if how not in (FULL, SUBSTITUTE)}

    def covered(self, layer: int) -> list[int]:
        """The experts of `layer` the draft can compute without substituting."""
        return sorted(e for (l, e), how in self.held.items() if l == layer and how != SUBSTITUTE)


@dataclass
class Options:
    """The ways an expert may be held: their device bytes per expert, and the draft's
    relative output error each gives (`errors[how]`; `full` is 0), measured per block and
    averaged over blocks: two sampled experts a block cannot rank blocks (at 5 % of the
    demo model's expert bytes, per-block figures moved int2 copies between blocks and
    cost a tenth of the acceptance: 0.129 against 0.146)."""

    nbytes: dict[str, int]
    errors: dict[str, float]
    allowed: tuple[str, ...] = field(default=())  # default: every key of nbytes
    # how much a pick in each block counts (draft_quality.block_weights); missing: 1
    block_weights: dict[int, float] | None = None

    def ways(self) -> list[str]:
        return [w for w in (self.allowed or tuple(self.nbytes)) if w in self.nbytes]

    def weight(self, layer: int) -> float:
        return (self.block_weights or {}).get(layer, 1.0)


def pick_shares(counts: dict[int, list[float]]) -> dict[int, list[float]]:
    """Each expert's share of its block's picks, with PRIOR_PICKS added to every count."""
    out = {}
    for layer, row in counts.items():
        smoothed = [c + PRIOR_PICKS for c in row]
        total = sum(smoothed)
        out[layer] = [c / total for c in smoothed]
    return out


def allocate(shares: dict[int, list[float]], options: Options, budget: int,
             exclude: dict[int, list[int]] | None = None, at_least_one: bool = False) -> Allocation:
    """The copies that minimize the draft's expected cost within `budget` bytes.

    `shares`: layer -> each expert's share of picks; `exclude`: experts held in full
    already (not given copies). Every other expert starts substituted. `at_least_one`:
    first, in each block that holds nothing in full, the most picked expert gets its first
    step up (substitution needs something held to substitute with), where the budget allows."""
    exclude = exclude or {}
    held: dict[Key, str] = {}
    heap: list[tuple[float, int, Key, int]] = []  # (-cost saved per byte, tie order, expert, its step)
    ladders: dict[Key, list[tuple[int, float, str]]] = {}
    total = 0.0
    cost = {w: pick_cost(e) for w, e in options.errors.items()}
    for layer, row in shares.items():
        sub_cost, weight = cost[SUBSTITUTE], options.weight(layer)
        for e, picked in enumerate(row):
            share = picked * weight  # what its picks count for
            key = (layer, e)
            if e in exclude.get(layer, ()):
                held[key] = FULL
                continue
            held[key] = SUBSTITUTE
            total += share * sub_cost
            ladder = _hull([(options.nbytes[w], share * cost[w], w)
                            for w in options.ways() if w not in (FULL,)] + [(0, share * sub_cost, SUBSTITUTE)])
            ladders[key] = ladder
            _push_next(heap, key, ladder, 0)
    spent, position = 0, {k: 0 for k in ladders}
    if at_least_one:
        for layer, row in shares.items():
            if exclude.get(layer):
                continue
            key = (layer, min(range(len(row)), key=lambda e: (-row[e], e)))
            ladder = ladders[key]
            if len(ladder) > 1 and spent + ladder[1][0] <= budget:
                spent += ladder[1][0]
                total -= ladder[0][1] - ladder[1][1]
                held[key], position[key] = ladder[1][2], 1
                _push_next(heap, key, ladder, 1)
    while heap:
        _, _, key, i = heapq.heappop(heap)
        ladder = ladders[key]
        if i != position[key]:
            continue  # stale: the floor above moved this expert on
        (b0, e0, _), (b1, e1, how) = ladder[i], ladder[i + 1]
        if spent + b1 - b0 > budget:
            continue  # this expert stays where it is; cheaper upgrades of others may still fit
        spent += b1 - b0
        total -= e0 - e1
        held[key] = how
        position[key] = i + 1
        _push_next(heap, key, ladder, i + 1)
    return Allocation(held, spent, max(total, 0.0))


def _hull(points: list[tuple[int, float, str]]) -> list[tuple[int, float, str]]:
    """The lower convex hull of (bytes, cost) from the cheapest point: each step buys
    less cost per byte than the one before, and no point is dominated."""
    points = sorted(points, key=lambda p: (p[0], p[1]))  # (bytes, cost, way)
    hull: list[tuple[int, float, str]] = []
    for p in points:
        if hull and p[1] >= hull[-1][1]:
            continue  # more bytes for no less cost
        while len(hull) >= 2 and _slope(hull[-2], hull[-1]) <= _slope(hull[-2], p):
            hull.pop()  # hull[-1] saves less per byte than going straight to p
        hull.append(p)
    return hull


def _slope(a, b) -> float:
    """Cost saved per byte going from a to b (b takes more bytes)."""
    return (a[1] - b[1]) / (b[0] - a[0]) if b[0] > a[0] else float("inf")


def _push_next(heap, key: Key, ladder, i: int) -> None:
    if i + 1 < len(ladder):
        heapq.heappush(heap, (-_slope(ladder[i], ladder[i + 1]), next(_ORDER), key, i))


def choose_full(shares: dict[int, list[float]], options: Options, budget: int, slot_bytes: int,
                most: int, fewest: int = 0) -> Allocation | None:
    """The best allocation over every count N of full-precision experts per block
    (`fewest` to `most`; None if not even `fewest` fit): N x blocks pool slots for the N
    most picked experts of each block, copies in the rest of the budget. Under shares that
    are all equal (before any routing is seen) this compares holding experts in full with
    copies at the same bytes."""
    best = None
    blocks = len(shares)
    allow_full = FULL in options.ways()
    for n in range(fewest, (most if allow_full else 0) + 1):
        rest = budget - n * blocks * slot_bytes
        if rest < 0:
            break
        hot = {layer: sorted(range(len(row)), key=lambda e: (-row[e], e))[:n] for layer, row in shares.items()}
        a = allocate(shares, options, rest, hot, at_least_one=True)
        a = Allocation(a.held, a.nbytes + n * blocks * slot_bytes, a.cost, n)
        if best is None or a.cost < best.cost - 1e-12:
            best = a
    return best
