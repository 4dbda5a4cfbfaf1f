"""One policy's pool and rules executing a schedule's steps, timed.

Each policy gets its own device pool and transfer engine over the shared store
(weights.SharedLayerStore) and runs every MoE block through the engine's block executor
(:class:`specmoe.experts.executor.BlockExecutor`): experts on the device are computed
while the missing ones stream in. What differs per policy is what stays in the pool and
what is fetched ahead:

- ondemand: every block's experts leave the pool after it (pool ids are running ids,
  pass x trace layers + rank, so nothing is reused across passes);
- overlap: as ondemand, plus the next block's recorded experts are prefetched (oracle);
- caching: a static hot set per block, pinned; misses are an LRU;
- specmoe: the draft set per block, pinned (refresh); draft passes compute with it
  straight from its pool slots (no fetch); the verify pass prefetches what the drafts'
  own picks predict (as SpecMoEPolicy does)."""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass
from types import SimpleNamespace

import torch

from ...base.specs import ExpertSpec
from ...costmodel.shapes import ModelShape
from ...experts.budget import DeviceBudget
from ...experts.executor import BlockExecutor
from ...experts.formats import FloatFormat
from ...experts.pool import DevicePool, Key
from ...experts.store import ExpertStore
from ...experts.transfer import TransferEngine
from ...model.moe import Routing, combine, group_by_expert, run_expert
from ...policies.caching import CachingPolicy
from .schedule import LayerMap, Schedule, StepPlan, hot_sets


@dataclass
class PreparedPass:
    """A pass with its routings built on the device ahead of timing."""

    kind: str
    batch: int
    positions: int
    layers: list[tuple[int, int, Routing]]  # (rank, tokens, Routing)


@dataclass
class StepMeasure:
    seconds: float
    transfer_bytes: int
    fetched: dict[int, int]  # rank -> experts fetched in this step
    refresh_fetches: int
    draft_transfer_bytes: int  # bytes the transfer engine moved during the step's draft passes
    hits: int  # experts a block needed that were on the device or on their way when it ran
    uses: int


def routing_for(counts: dict[int, int], positions: int, device: torch.device) -> Routing | None:
    """A router choice with these per-expert token counts over `positions` positions."""
    flat = [e for e, n in counts.items() for _ in range(n)]
    if not flat:
        return None
    k = len(flat) // positions if positions and len(flat) % positions == 0 else 1
    ids = torch.tensor(flat, dtype=torch.long, device=device).view(-1, k)
    weights = torch.full(ids.shape, 1.0 / k, dtype=torch.float32, device=device)
    return Routing(ids, weights)


def substituted(counts: dict[int, int], draft: list[int]) -> dict[int, int]:
    """Draft routing: a pick outside the draft set goes to draft[e mod N] (round-robin;
    the engine's affinity substitution needs real weights)."""
    out: dict[int, int] = {}
    for e, n in counts.items():
        d = e if e in draft else draft[e % len(draft)]
        out[d] = out.get(d, 0) + n
    return out


def prepare(step: StepPlan, device: torch.device) -> list[PreparedPass]:
    out = []
    for p in step.passes:
        layers = []
        for rank, counts in p.layers:
            if p.kind == "draft":
                draft = step.draft_set.get(rank)
                if not draft:
                    continue
                counts = substituted(counts, draft)
            r = routing_for(counts, p.positions, device)
            if r is not None:
                layers.append((rank, r.ids.shape[0], r))
        out.append(PreparedPass(p.kind, p.batch, p.positions, layers))
    return out


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_steps(steps: list[StepPlan], max_steps: int) -> list[StepPlan]:
    """The steps that are timed: after the first (a warm-up), at most max_steps."""
    return steps[1:1 + max_steps] if len(steps) > 1 else steps[:1]


def pool_slots(schedule: Schedule, lmap: LayerMap, num_experts: int, cache_fraction: float) -> int:
    """Device pool size of a policy: what it keeps resident over all trace layers, plus
    room for one block's experts (two for overlap: the next block's prefetches)."""
    E, L = num_experts, lmap.num_trace_layers
    if schedule.policy == "ondemand":
        return E
    if schedule.policy == "overlap":
        return 2 * E
    if schedule.policy == "caching":
        return hot_per_block(num_experts, cache_fraction) * L + E
    return max((len(v) for st in schedule.steps for v in st.draft_set.values()), default=0) * L + E


def hot_per_block(num_experts: int, cache_fraction: float) -> int:
    return CachingPolicy.hot_per_block(SimpleNamespace(num_experts=num_experts), cache_fraction)


class PolicyReplay:
    """Runs one schedule's steps with one policy's pool and rules."""

    def __init__(self, schedule: Schedule, store: ExpertStore, lmap: LayerMap, shape: ModelShape,
                 device: torch.device, dtype: torch.dtype, cache_fraction: float):
        self.s, self.store, self.lmap, self.shape, self.device, self.dtype = schedule, store, lmap, shape, device, dtype
        self.policy = schedule.policy
        self.expert_spec = ExpertSpec(shape.hidden, shape.expert_intermediate)  # the replay's SwiGLU experts
        self.persistent = self.policy in ("caching", "specmoe")  # the pool is kept across blocks and steps
        self.slots = pool_slots(schedule, lmap, shape.num_experts, cache_fraction)
        self.hot: dict[int, list[int]] = {}
        self.hot_source: str | None = None
        if self.policy == "caching":
            self.hot, self.hot_source = hot_sets(schedule.trace, lmap, hot_per_block(shape.num_experts, cache_fraction))
        self.pass_counter = 0
        self.draft: dict[int, list[int]] = {}  # rank -> the draft set pinned now (specmoe)
        self.prepared: list[list[PreparedPass]] = []
        self.flat: list[tuple[int, int, int]] = []

    def run(self, max_steps: int) -> list[StepMeasure]:
        """One untimed warm-up step (allocator, kernels, cuBLAS), then the timed ones."""
        steps = self.s.steps
        timed = timed_steps(steps, max_steps)
        plan = [steps[0]] + timed
        # overlap prefetches the next block, across step boundaries too: the step after
        # the last timed one is prepared (not run) so that the last step prefetches as well
        tail = steps[1 + len(timed):2 + len(timed)] if self.policy == "overlap" else []
        self.prepared = [prepare(st, self.device) for st in plan + tail]
        # (pass index, pass, rank) of every block in order: each block's successor
        self.flat = [(i, j, rank) for i, p in enumerate(self.prepared) for j, ps in enumerate(p)
                     for rank, _, _ in ps.layers]
        most = max((t for p in self.prepared[:len(plan)] for ps in p for _, t, _ in ps.layers), default=1)
        gen = torch.Generator(device=self.device).manual_seed(0)
        self.x = torch.randn(most, self.shape.hidden, generator=gen, device=self.device).to(self.dtype)
        self._open()
        try:
            if self.policy == "caching":
                self.blocks.load_resident([(rank, e) for rank, es in self.hot.items() for e in es])
            measures = [self._measure(i, st) for i, st in enumerate(plan)]
            self.transfer.drain()
            return measures[1:]
        finally:
            self._close()

    def _open(self) -> None:
        fmt = FloatFormat(self.expert_spec, self.dtype)
        pool = DevicePool(self.slots, fmt, self.device, DeviceBudget(None), self.policy, 1)
        self.transfer = TransferEngine(self.store, pool, self.device)
        self.blocks = BlockExecutor(self.store, pool, self.transfer, fmt)

    def _close(self) -> None:
        self.transfer.close()  # the store is shared by every policy's run: it stays open
        del self.blocks, self.transfer, self.x
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _measure(self, i: int, st: StepPlan) -> StepMeasure:
        sync(self.device)
        self.transfer.reset_counters()
        self.blocks.reset()
        t0 = time.perf_counter()
        refresh, draft_bytes = self._step(i, st, self.prepared[i])
        sync(self.device)
        seconds = time.perf_counter() - t0
        fetched = Counter(k[0] % self.lmap.num_trace_layers for k in self.transfer.fetched)
        c = self.blocks.counters
        return StepMeasure(seconds, self.transfer.transfer_bytes, dict(fetched), refresh, draft_bytes, c.hits, c.uses)

    # -- one step --------------------------------------------------------------------------------

    def _step(self, i: int, st: StepPlan, prep: list[PreparedPass]) -> tuple[int, int]:
        """Run the step's passes; returns (experts fetched for draft sets, bytes moved
        during draft passes)."""
        refresh = draft_bytes = 0
        if self.policy == "specmoe":
            refresh = self._refresh(st.draft_set)
        for j, ps in enumerate(prep):
            if ps.kind == "draft":
                before = self.transfer.transfer_bytes
                for rank, t, routing in ps.layers:
                    self._draft_block(rank, self.x[:t], routing)
                draft_bytes += self.transfer.transfer_bytes - before
                continue
            if ps.kind == "verify":
                self._verify_prefetch(st)
            for rank, t, routing in ps.layers:
                layer_id = rank if self.persistent else self.pass_counter * self.lmap.num_trace_layers + rank
                if self.policy == "overlap":
                    self.blocks.prefetch_queue = self._next_block(i, j, rank)
                self._block(layer_id, self.x[:t], routing)
                if ps.kind == "verify" and rank in st.next_draft_set:
                    # the block's next draft set is its hottest experts of this pass: pinned now,
                    # while they are still in the pool (the refresh the paper calls free)
                    refresh += self._refresh_block(rank, st.next_draft_set[rank])
            self.pass_counter += 1
        return refresh, draft_bytes

    def _block(self, layer_id: int, x: torch.Tensor, routing: Routing) -> None:
        """A full-model block (decode or verify), as OffloadPolicy.run_moe."""
        groups = group_by_expert(routing, self.shape.num_experts)
        self.blocks.run_block(layer_id, x, groups)
        self.blocks.finish_block(layer_id, keep=self.persistent)

    def _next_block(self, i: int, j: int, rank: int) -> list[Key]:
        """Oracle prediction: the recorded routing of the block that runs next."""
        pos = self.flat.index((i, j, rank))
        if pos + 1 >= len(self.flat):
            return []
        ni, nj, nrank = self.flat[pos + 1]
        ps = self.prepared[ni][nj]
        routing = next(r for rk, _, r in ps.layers if rk == nrank)
        experts = Counter(routing.ids.reshape(-1).tolist()).most_common()
        next_id = (self.pass_counter + ((ni, nj) != (i, j))) * self.lmap.num_trace_layers + nrank
        return [(next_id, e) for e, _ in experts]

    def _refresh(self, draft_set: dict[int, list[int]]) -> int:
        """Make the cycle's recorded draft set resident and pinned (as SpecMoEPolicy.refresh);
        normally done block by block during the previous verify pass already."""
        return sum(self._refresh_block(rank, experts) for rank, experts in draft_set.items())

    def _refresh_block(self, rank: int, experts: list[int]) -> int:
        """Draft set of one block: unpin the old one, fetch (if needed) and pin the new one.
        Returns the experts that had to be fetched."""
        table, transfer = self.blocks.pool.table, self.transfer
        if self.draft.get(rank) == experts:
            return 0
        for e in self.draft.get(rank, ()):
            table.unpin((rank, e))
        moved = 0
        for e in experts:
            if not transfer.has((rank, e)):
                moved += 1
            transfer.ensure((rank, e))
            table.pin((rank, e))
        self.draft[rank] = list(experts)
        return moved

    def _draft_block(self, rank: int, x: torch.Tensor, routing: Routing) -> None:
        """As the engine's Drafter: draft experts straight from their (pinned) pool slots."""
        pool, shape = self.blocks.pool, self.shape
        groups = group_by_expert(routing, shape.num_experts)
        outputs = [run_expert(pool.slot_tensor((rank, e)), groups.inputs(x, j), self.expert_spec)
                   for j, e in enumerate(groups.experts)]
        combine(x, groups, outputs)

    def _verify_prefetch(self, st: StepPlan) -> None:
        """As SpecMoEPolicy.begin_pass('verify'): prefetch what the drafts' own picks
        predict, block by block, most demanded first."""
        queue = []
        for rank in sorted(st.predicted):
            queue += [(rank, e) for e, _ in st.predicted[rank].most_common() if not self.transfer.has((rank, e))]
        self.blocks.prefetch(queue)
