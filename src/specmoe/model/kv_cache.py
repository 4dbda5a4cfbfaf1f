"""A slot-based KV cache that takes any number of new tokens per sequence per step.

Each running sequence owns a slot. A step appends n_i >= 1 tokens to each of its
sequences at positions length_i .. length_i + n_i - 1 (prefill: the prompt; decode: 1;
verification: 1 + gamma). Rolling back rejected drafts is `truncate`: the entries beyond
the new length are simply overwritten later. Lengths are plain Python bookkeeping.

What a layer stores per token is its own (`LayerCacheSpec`): K and V of its kv heads, or
for multi-head latent attention one compressed latent that serves as both. A layer with
an attention window keeps only a ring of `window + rollback` positions per sequence:
its step reads the window's older keys from the ring, appends the new ones, then writes
them over positions no query can see any more. The `rollback` spare positions are what
keeps rejected drafts (written, then truncated) from overwriting keys still in a window.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from functools import cached_property

import torch

from ..base.errors import SpecMoEError
from ..base.specs import AttentionWindow, cache_positions


@dataclass(frozen=True)
class StepBatch:
    """Where the T new tokens of one forward pass go. Built once per step, passed explicitly.

    B sequences; sequence b has `counts[b]` new tokens starting at position `starts[b]`
    in KV slot `slots[b]`. Tokens are laid out sequence after sequence. Every layer needs
    `positions` and `token_slots`; the other tensors only some batches need (uneven ones,
    windowed layers) are made on first use, once per step.
    """

    slots: tuple[int, ...]
    starts: tuple[int, ...]
    counts: tuple[int, ...]
    positions: torch.Tensor  # [T] position of each new token
    token_slots: torch.Tensor  # [T] KV slot of each new token
    kv_len: int
    max_new: int
    uniform: bool = False  # every sequence has max_new new tokens: tokens are already the padded layout
    attends_all: bool = False  # one new token each at the same position: every query sees every key
    draft: bool = False  # a draft pass: dense weights kept in bfloat16 may be multiplied in it (layers.linear)
    # attention with one order of additions per query row (kernels/blockdot.attend): the model's
    # weights are multiplied as stored, whose 8-bit rounding of activations would turn the float
    # noise of a batch-dependent attention into different tokens across policies
    invariant: bool = False
    _window_masks: dict = field(default_factory=dict, compare=False, repr=False)
    _key_runs: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def num_tokens(self) -> int:
        return int(self.positions.shape[0])

    @property
    def device(self) -> torch.device:
        return self.positions.device

    def last_token_rows(self) -> list[int]:
        """Row of each sequence's last new token (whose logits predict the next token)."""
        rows, total = [], 0
        for n in self.counts:
            total += n
            rows.append(total - 1)
        return rows

    @classmethod
    def build(cls, slots, starts, counts, device, draft: bool = False, invariant: bool = False) -> StepBatch:
        slots, starts, counts = tuple(slots), tuple(starts), tuple(counts)
        if not counts or min(counts) < 1:
            raise ValueError("every sequence in a step needs at least one new token")
        max_new = max(counts)
        positions, token_slots = [], []
        for slot, start, n in zip(slots, starts, counts):
            positions.extend(range(start, start + n))
            token_slots.extend([slot] * n)
        as_long = dict(dtype=torch.long, device=device)
        return cls(
            slots, starts, counts,
            positions=torch.tensor(positions, **as_long),
            token_slots=torch.tensor(token_slots, **as_long),
            kv_len=max(s + n for s, n in zip(starts, counts)),
            max_new=max_new,
            uniform=min(counts) == max_new,
            attends_all=max_new == 1 and min(starts) == max(starts),
            draft=draft,
            invariant=invariant,
        )

    def _long(self, values) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)

    @cached_property
    def mask(self) -> torch.Tensor:
        """[B, 1, max_new, kv_len] True where a query may attend a key: causal, which also
        hides stale entries past a sequence's end."""
        query_pos = self._long(self.starts)[:, None] + torch.arange(self.max_new, device=self.device)[None, :]
        key_pos = torch.arange(self.kv_len, device=self.device)
        return (key_pos[None, None, :] <= query_pos[:, :, None])[:, None, :, :]

    @cached_property
    def padded_index(self) -> torch.Tensor:
        """[T] each token's row in the padded [B * max_new] layout attention uses."""
        n = self.max_new
        return self._long([b * n + i for b, count in enumerate(self.counts) for i in range(count)])

    @cached_property
    def ends(self) -> torch.Tensor:
        """[T] end (start + count) of each token's sequence."""
        return self._long([s + n for s, n in zip(self.starts, self.counts) for _ in range(n)])

    @cached_property
    def slot_index(self) -> torch.Tensor:
        """[B] the slots as a tensor."""
        return self._long(self.slots)

    def key_runs(self, rows_per_token: int) -> list[tuple[int, int, int, int]]:
        """The sequences split into runs (first, end, keys, tokens) that attend in one call
        each: their first `keys` positions, their first `tokens` new tokens (split_by_length)."""
        if rows_per_token not in self._key_runs:
            if self.device.type != "cpu" or self.attends_all:  # (on CUDA, padding is cheaper than calls)
                runs = [(0, len(self.slots), self.kv_len, self.max_new)]
            else:
                runs = split_by_length([s + n for s, n in zip(self.starts, self.counts)], list(self.counts),
                                       rows_per_token)
            self._key_runs[rows_per_token] = runs
        return self._key_runs[rows_per_token]

    def window_mask(self, window: AttentionWindow) -> torch.Tensor:
        """[B, 1, max_new, W - 1 + max_new] for a windowed layer's keys: the W - 1 positions
        before each sequence's first new token, then its new tokens."""
        if window not in self._window_masks:
            device, w = self.device, window.size
            starts = self._long(self.starts)[:, None, None]
            counts = self._long(self.counts)[:, None, None]
            i = torch.arange(self.max_new, device=device)[None, :, None]
            j = torch.arange(w - 1 + self.max_new, device=device)[None, None, :]
            q, k = starts + i, starts - (w - 1) + j
            exists = (k >= 0) & ((j < w - 1) | (j - (w - 1) < counts))
            seen = (k > q - w) if window.kind == "sliding" else (torch.div(k, w, rounding_mode="floor") == q // w)
            padding = i >= counts  # query rows past a sequence's tokens: any key, never an empty softmax
            self._window_masks[window] = (exists & ((k <= q) & seen | padding))[:, None]
        return self._window_masks[window]


# Cost of one CPU attention call in microseconds, as measured with torch's kernel on an
# AMD EPYC core: a fixed part, then per key (read once per sequence) and per query row
# and key. Only their proportions matter: they decide where a batch is split.
CALL_US, KEY_US, ROW_KEY_US = 35.0, 0.092, 0.009
MAX_UNITS = 16  # a larger batch is split at multiples of B / 16 sequences: the search stays cheap


def split_by_length(lengths: list[int], counts: list[int], rows_per_token: int) -> list[tuple[int, int, int, int]]:
    """Split consecutive sequences into runs (first, end, keys, tokens) that attend in one
    call each over their longest length and most new tokens. One call over the whole
    padded batch computes every sequence as if it were the longest with the most new
    tokens, so a short sequence beside a long one costs as much as the long one.
    Minimises the modelled time of all calls (dynamic programming over the split points)."""
    def cost(size, keys, tokens):
        return CALL_US + size * keys * (KEY_US + ROW_KEY_US * tokens * rows_per_token)

    B = len(lengths)
    one_call = [(0, B, max(lengths), max(counts))]
    if cost(*one_call[0][1:]) - sum(cost(1, n, c) - CALL_US for n, c in zip(lengths, counts)) <= CALL_US:
        return one_call  # no split can save more than the call it adds
    step = -(-B // MAX_UNITS)
    cuts = list(range(0, B, step)) + [B]
    unit_keys = [max(lengths[a:b]) for a, b in zip(cuts, cuts[1:])]
    unit_tokens = [max(counts[a:b]) for a, b in zip(cuts, cuts[1:])]
    best = [0.0] + [float("inf")] * (len(cuts) - 1)  # best[j]: time of sequences [0, cuts[j])
    first = [0] * len(cuts)
    for j in range(1, len(cuts)):
        keys = tokens = 0
        for i in range(j - 1, -1, -1):
            keys, tokens = max(keys, unit_keys[i]), max(tokens, unit_tokens[i])
            total = best[i] + cost(cuts[j] - cuts[i], keys, tokens)
            if total < best[j]:
                best[j], first[j] = total, i
    runs, j = [], len(cuts) - 1
    while j:
        i = first[j]
        a, b = cuts[i], cuts[j]
        runs.append((a, b, max(lengths[a:b]), max(counts[a:b])))
        j = i
    return runs[::-1]


def _write_one(store: torch.Tensor, new: torch.Tensor, slot: int, position: int, length: int) -> torch.Tensor:
    """Write one token's new [1, heads, dim] at `position` of `slot` in store [slots, heads,
    positions, dim]; return the slot's first `length` positions [1, heads, length, dim].
    Each is one strided view (indexing would take a select or slice per dimension: at
    batch 1 every operator is a noticeable part of a decode step)."""
    s_slot, s_head, s_pos, s_dim = store.stride()
    base = store.storage_offset() + slot * s_slot
    store.as_strided(new.shape, (s_slot, s_head, s_dim), base + position * s_pos).copy_(new)
    return store.as_strided((1, store.shape[1], length, store.shape[3]), store.stride(), base)


@dataclass(frozen=True)
class LayerCacheSpec:
    """What one layer caches per token: `heads` x `k_dim` keys and `heads` x `v_dim`
    values (v_dim 0: the keys serve as values too, as MLA's latent does)."""

    heads: int
    k_dim: int
    v_dim: int
    window: AttentionWindow | None = None

    @property
    def elements_per_token(self) -> int:
        return self.heads * (self.k_dim + self.v_dim)


class KVCache:
    """Keys (and values) of every layer: [slots, heads, positions, dim], allocated once at
    full size: `max_len` positions for a full layer, its ring for a windowed one. The
    engine charges the device budget for exactly that, so the cache never holds more than
    the budget says."""

    def __init__(self, layers: list[LayerCacheSpec], num_slots: int, max_len: int, dtype, device,
                 rollback: int = 16):
        self.layers, self.num_slots = list(layers), num_slots
        self.max_len, self.dtype, self.device, self.rollback = max_len, dtype, device, rollback
        self.ring = [None if s.window is None else cache_positions(s.window, max_len, rollback) for s in self.layers]
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor | None] = []
        for spec, ring in zip(self.layers, self.ring):
            k, v = self._alloc(spec, max_len if ring is None else ring)
            self.k.append(k)
            self.v.append(v)
        self.lengths = [0] * num_slots
        self._free = list(range(num_slots))  # a min-heap: the lowest free slot first

    # --- slots: plain bookkeeping -------------------------------------------------------

    def allocate(self) -> int:
        if not self._free:
            raise RuntimeError("no free KV slot: the scheduler admitted more sequences than slots")
        slot = heapq.heappop(self._free)
        self.lengths[slot] = 0
        return slot

    def free(self, slot: int) -> None:
        self.lengths[slot] = 0
        heapq.heappush(self._free, slot)

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def truncate(self, slot: int, length: int) -> None:
        if not 0 <= length <= self.lengths[slot]:
            raise ValueError(f"cannot truncate slot {slot} of length {self.lengths[slot]} to {length}")
        if any(r is not None for r in self.ring) and self.lengths[slot] - length > self.rollback:
            raise RuntimeError(f"rolling back {self.lengths[slot] - length} positions, but windowed layers keep "
                               f"only {self.rollback} spare positions: build the cache with a larger rollback")
        self.lengths[slot] = length

    def commit(self, batch: StepBatch) -> None:
        """Record that the step's tokens are now cached."""
        for slot, start, n in zip(batch.slots, batch.starts, batch.counts):
            self.lengths[slot] = start + n

    def is_windowed(self, layer: int) -> bool:
        """A windowed layer's keys come back in window order, not by position."""
        return self.ring[layer] is not None

    # --- tensors ----------------------------------------------------------------------

    def _elem(self) -> int:
        return torch.tensor([], dtype=self.dtype).element_size()

    def bytes_per_token(self) -> int:
        """Bytes one cached position costs in every layer."""
        return sum(s.elements_per_token for s in self.layers) * self._elem()

    def bytes_per_sequence(self, length: int) -> int:
        """Bytes one sequence of `length` positions needs (windowed layers: their ring)."""
        return sum(s.elements_per_token * (length if r is None else min(r, length))
                   for s, r in zip(self.layers, self.ring)) * self._elem()

    @property
    def nbytes(self) -> int:
        return sum(t.numel() for t in self.k + self.v if t is not None) * self._elem()

    def reserve(self, length: int) -> None:
        if length > self.max_len:
            raise SpecMoEError(
                f"a sequence needs {length} positions but the context holds {self.max_len}: "
                "shorten the prompt, lower --max-tokens or raise --max-model-len"
            )

    def _alloc(self, spec: LayerCacheSpec, positions: int):
        def make(dim):
            # zeros, not empty: padded rows of a batch read positions no token wrote, and
            # garbage there could be NaN, which a zero attention weight does not cancel
            return torch.zeros(self.num_slots, spec.heads, positions, dim, dtype=self.dtype, device=self.device)

        return make(spec.k_dim), (make(spec.v_dim) if spec.v_dim else None)

    def write_and_read(self, layer: int, batch: StepBatch, k: torch.Tensor, v: torch.Tensor | None):
        """Store the new tokens' k [T, heads, k_dim] (and v); return the keys and values
        [B, heads, L, dim] the batch attends (values None where keys serve as values) and
        the mask [B, 1, max_new, L] over them (None when every query sees every key)."""
        if self.ring[layer] is not None:
            return self._ring_write_and_read(layer, batch, k, v)
        keys, values = self.k[layer], self.v[layer]
        if len(batch.counts) == 1 == batch.max_new:  # batch-1 decoding: two operators a tensor
            slot, position, length = batch.slots[0], batch.starts[0], batch.kv_len
            return (_write_one(keys, k, slot, position, length),
                    None if values is None else _write_one(values, v, slot, position, length), None)
        keys[batch.token_slots, :, batch.positions] = k
        if values is not None:
            values[batch.token_slots, :, batch.positions] = v
        slots = batch.slots
        if slots == tuple(range(slots[0], slots[0] + len(slots))):  # contiguous: a view, no copy
            index = slice(slots[0], slots[0] + len(slots))
        else:
            index = batch.slot_index
        read = [None if t is None else t[index, :, : batch.kv_len] for t in (keys, values)]
        return read[0], read[1], None if batch.attends_all else batch.mask

    def _ring_write_and_read(self, layer: int, batch: StepBatch, k: torch.Tensor, v: torch.Tensor | None):
        window, size = self.layers[layer].window, self.ring[layer]
        w = window.size
        starts = torch.tensor(batch.starts, device=k.device)
        old = (starts[:, None] - (w - 1) + torch.arange(w - 1, device=k.device)).clamp(min=0) % size  # [B, W-1]
        out = []
        for store, new in ((self.k[layer], k), (self.v[layer], v)):
            if store is None:
                out.append(None)
                continue
            before = store[batch.slot_index[:, None], :, old].permute(0, 2, 1, 3)  # [B, heads, W-1, dim]
            padded = new.new_zeros(len(batch.slots) * batch.max_new, *new.shape[1:])
            padded[batch.padded_index] = new
            padded = padded.view(len(batch.slots), batch.max_new, *new.shape[1:]).permute(0, 2, 1, 3)
            out.append(torch.cat([before, padded], dim=2))
        # then the new tokens into the ring (of a long prompt, only the last `size` land)
        keep = batch.positions >= batch.ends - size
        for store, new in ((self.k[layer], k), (self.v[layer], v)):
            if store is not None:
                store[batch.token_slots[keep], :, batch.positions[keep] % size] = new[keep]
        return out[0], out[1], batch.window_mask(window)
