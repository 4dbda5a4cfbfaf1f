"""Step-time model per policy: bytes moved, floating-point work and each policy's overlap
rules. One engine step = what produces the next token(s) for all B sequences.

Building blocks (M = MoE layers, U = distinct experts one layer needs in a pass):

- compute of a pass: every operator is timed by its roofline, max(FLOPs / matmul rate,
  bytes read from device memory / device bandwidth), plus a fixed cost per operator the
  engine dispatches (``kernel_launch_s``; the counts below are the engine's own), plus
  the engine's host work per sequence (sampling, scheduling). Summing per
  operator (not over the whole pass) is what makes small batches memory bound and large
  ones compute bound; the fixed costs are what dominate a small model on a CPU.
- fetching n experts: n * (expert bytes / fetch bandwidth + per-transfer latency).
- routing: U from :class:`~specmoe.costmodel.routing.RoutingModel` (skew, locality).

``tokens_per_step`` is per sequence (1 without speculation), as in the engine's stats;
``decode_tokens_per_s = batch * tokens_per_step / step_s``.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import numpy as np

from .hardware import HardwareProfile
from .routing import RoutingModel, acceptance_at, tokens_per_step
from .shapes import ModelShape

# Operators the engine dispatches, counted on its decode passes (tests/test_perf_ops.py
# keeps these in step with the code).
PASS_OPS = 26  # embedding, the pass's rotation, final norm, LM head
ATTENTION_OPS = 37  # per layer: both norms, one q/k/v matmul, o, rotary, KV cache write and read, attention, residuals
ONE_TOKEN_ATTENTION_OPS = 29  # the same for a pass of one token: its K/V written and read through strided views
DENSE_FFN_OPS = 8  # per dense layer: SwiGLU
ROUTER_OPS = 16  # per MoE layer: router, softmax, top-k, grouping positions by expert
LAUNCHES_PER_EXPERT = 14  # per expert run: gather its positions, gate/up, SiLU, product, down, weighted scatter-add
GROUPED_BLOCK_OPS = 24  # per MoE layer run as one grouped computation (resident): router, sort, two grouped matmuls
DEQUANT_OPS = 10  # per quantized (draft) expert run: dequantize both matrices (int8; 17 operators against 7)
DEFAULT_CONTEXT = 512
DEFAULT_SOURCE = 64  # translation: a sentence or two
DEFAULT_OUTPUT = 64
DEFAULT_CACHE_FRACTION = 0.1  # the paper's caching baseline: 10 % of each block's experts
DEFAULT_PREDICTION_ACCURACY = 0.8  # overlap: fraction of a token's next-layer picks predicted right


@dataclass(frozen=True)
class Scenario:
    """Everything fixed across batch sizes and policies."""

    shape: ModelShape
    hardware: HardwareProfile
    routing: RoutingModel = field(default_factory=RoutingModel)
    context_len: int = DEFAULT_CONTEXT  # mean cached positions per sequence during decode
    device_memory: int | None = None  # byte budget on the device; None: the whole device
    prediction_accuracy: float = DEFAULT_PREDICTION_ACCURACY
    source_len: int = DEFAULT_SOURCE  # an encoder-decoder model: source tokens per request (the encoder's work)
    output_len: int = DEFAULT_OUTPUT  # ... and tokens decoded per request (the steps its encoder pass is spread over)

    def __post_init__(self) -> None:
        if self.context_len < 0:
            raise ValueError("context_len must be >= 0")
        if not 0.0 <= self.prediction_accuracy <= 1.0:
            raise ValueError("prediction_accuracy must be in [0, 1]")
        if self.source_len < 1 or self.output_len < 1:
            raise ValueError("source_len and output_len must be >= 1")

    @property
    def memory(self) -> int:
        return self.device_memory or self.hardware.device_memory_bytes

    def distinct(self, batch: int, per_sequence: int = 1, exclude_hottest: int = 0) -> float:
        s = self.shape
        return self.routing.expected_distinct(s.num_experts, s.top_k, batch, per_sequence, exclude_hottest)

    def fetch_s(self, n_experts: float) -> float:
        hw = self.hardware
        return n_experts * (self.shape.expert_bytes / hw.fetch_bw + hw.transfer_latency_s)


@dataclass(frozen=True)
class StepEstimate:
    policy: str
    batch_size: int
    step_s: float
    tokens_per_step: float  # per sequence
    decode_tokens_per_s: float
    transfer_bytes: float  # per step, into the device pool
    transfer_bytes_per_token: float
    compute_s: float
    transfer_s: float  # time spent on transfers (hidden or not)
    roofline_s: float  # best possible step time for these bytes and this work
    device_bytes: float  # device memory needed
    fits: bool
    gamma: int | None = None
    draft_experts: int | None = None
    acceptance: float | None = None
    cache_fraction: float | None = None
    draft_quant: str | None = None
    note: str = ""

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class PassWork:
    """Compute of one pass: time (sum of per-operator rooflines + launches) and totals."""

    time_s: float = 0.0
    flops: float = 0.0
    bytes: float = 0.0
    launches: float = 0.0
    host_s: float = 0.0

    def add(self, hw: HardwareProfile, flops: float, nbytes: float, launches: float) -> None:
        self.time_s += max(flops / hw.device_matmul_flops, nbytes / hw.device_mem_bw) + launches * hw.kernel_launch_s
        self.flops += flops
        self.bytes += nbytes
        self.launches += launches

    def add_host(self, seconds: float) -> None:
        """Engine work on the host that is neither FLOPs nor bytes (no roofline share)."""
        self.time_s += seconds
        self.host_s += seconds

    def bound_s(self, hw: HardwareProfile) -> float:
        """Roofline of the whole pass: perfect fusion, no launch overhead."""
        return max(self.flops / hw.device_matmul_flops, self.bytes / hw.device_mem_bw)


def pass_work(sc: Scenario, batch: int, per_sequence: float, experts_touched: float, routed: bool = True,
              quant_bits: int | None = None, grouped: bool = False) -> PassWork:
    """Device compute of one forward pass over batch x per_sequence positions.

    experts_touched: distinct routed experts per MoE layer whose weights the pass reads
    from device memory; routed=False leaves routed experts out (host policy). quant_bits:
    the experts are quantized copies, dequantized per run: memory traffic is the codes
    (the dequantized matrix is used while it is still in cache), plus DEQUANT_OPS.
    grouped: each block's experts run as one grouped computation (every expert resident),
    a fixed number of operators whatever the experts touched."""
    s, hw = sc.shape, sc.hardware
    P = batch * per_sequence
    bpp = s.bytes_per_param
    kv_layer = s.kv_bytes_per_token / s.step_layers
    w = PassWork()
    attention_ops = ONE_TOKEN_ATTENTION_OPS if P == 1 else ATTENTION_OPS
    for _ in range(s.step_layers):
        # attention: projections + scores over the cache; each sequence reads its K/V once
        # per pass (its positions share it) and writes K/V for its new positions.
        flops = 2 * P * s.attention_params + 4 * P * s.num_heads * s.head_dim * (sc.context_len + per_sequence)
        nbytes = s.attention_params * bpp + batch * sc.context_len * kv_layer + P * kv_layer
        w.add(hw, flops, nbytes, attention_ops)
        if s.encoder_layers:  # cross-attention: q and o projections, scores over the source's cached K/V
            proj = 2 * s.hidden * s.num_heads * s.head_dim
            w.add(hw, 2 * P * proj + 4 * P * s.num_heads * s.head_dim * sc.source_len,
                  proj * bpp + batch * sc.source_len * kv_layer, ATTENTION_OPS)
    for _ in range(s.step_dense_layers):
        w.add(hw, 2 * P * s.dense_ffn_params, s.dense_ffn_params * bpp, DENSE_FFN_OPS)
    expert_bytes, expert_ops = s.expert_slot_bytes, LAUNCHES_PER_EXPERT
    if s.expert_bytes_per_param:  # the model's own experts are quantized: dequantized per run too
        expert_ops += DEQUANT_OPS
    if quant_bits:
        expert_bytes = s.expert_params * quant_bits / 8
        expert_ops = LAUNCHES_PER_EXPERT + DEQUANT_OPS
    for _ in range(s.step_moe_layers):
        small = s.router_params + s.shared_expert_params  # router + shared expert: every position
        w.add(hw, 2 * P * small, small * bpp, GROUPED_BLOCK_OPS if grouped else ROUTER_OPS)
        if routed:
            w.add(hw, 2 * P * s.top_k * s.expert_params, experts_touched * expert_bytes,
                  0 if grouped else expert_ops * experts_touched)
    w.add(hw, 2 * P * s.hidden * s.vocab, s.hidden * s.vocab * bpp, PASS_OPS)  # LM head on every position
    w.add_host(batch * hw.sequence_overhead_s)
    return w


STREAMING_SLOTS = 2  # slots a policy that streams a block's experts through needs at least


def _device_bytes(sc: Scenario, batch: int, positions_per_seq: int, resident_experts: float,
                  staging_experts: float = STREAMING_SLOTS) -> float:
    """Non-expert weights + KV cache + resident experts + slots for fetched experts: the
    least the policy runs in (the engine streams a block's experts through its free
    slots, computing each as it lands; more slots only help the timing)."""
    s = sc.shape
    kv = batch * (sc.context_len + positions_per_seq) * s.kv_bytes_per_token
    return s.non_expert_bytes + kv + (resident_experts + staging_experts) * s.expert_slot_bytes


def encoder_pass(sc: Scenario, batch: int, cached_per_block: int | None) -> tuple[float, float]:
    """(seconds, bytes moved) of an encoder-decoder model's encoder over a batch of B
    admitted sources of `source_len` tokens: every encoder layer once for all B x S
    tokens, each encoder block fetching the union of their experts once (none with
    `cached_per_block` None: resident; else all but the block's hottest that many), then
    every decoder layer's cross-attention K and V of the sources."""
    s, hw, S = sc.shape, sc.hardware, sc.source_len
    P, bpp = batch * S, s.bytes_per_param
    w = PassWork()
    for _ in range(s.encoder_layers):
        w.add(hw, 2 * P * s.attention_params + 4 * P * s.num_heads * s.head_dim * S, s.attention_params * bpp,
              ATTENTION_OPS)
    for _ in range(s.encoder_layers - s.encoder_moe_layers):
        w.add(hw, 2 * P * s.dense_ffn_params, s.dense_ffn_params * bpp, DENSE_FFN_OPS)
    u = sc.distinct(batch, S)
    for _ in range(s.encoder_moe_layers):
        w.add(hw, 2 * P * (s.router_params + s.top_k * s.expert_params), u * s.expert_slot_bytes, LAUNCHES_PER_EXPERT * u)
    cross = 2 * s.hidden * s.num_heads * s.head_dim  # k and v projections per decoder layer
    w.add(hw, 2 * P * cross * s.step_layers, cross * s.step_layers * bpp, 2 * s.step_layers)
    fetched = 0.0 if cached_per_block is None else sc.distinct(batch, S, exclude_hottest=cached_per_block)
    return w.time_s + s.encoder_moe_layers * sc.fetch_s(fetched), s.encoder_moe_layers * fetched * s.expert_bytes


def _estimate(sc: Scenario, policy: str, batch: int, step_s: float, tokens: float, transfer_bytes: float,
              compute_s: float, transfer_s: float, roofline_s: float, device_bytes: float, **extra) -> StepEstimate:
    if sc.shape.encoder_layers:  # one encoder pass per admitted batch, spread over its requests' decode steps
        cached = None if policy == "resident" else cached_per_layer(sc.shape.num_experts, extra.get("cache_fraction") or 0)
        seconds, nbytes = encoder_pass(sc, batch, cached)
        share = tokens / sc.output_len  # decode steps per request: output_len / tokens
        step_s, transfer_bytes = step_s + share * seconds, transfer_bytes + share * nbytes
        device_bytes += batch * sc.source_len * sc.shape.kv_bytes_per_token
    generated = batch * tokens
    return StepEstimate(policy=policy, batch_size=batch, step_s=step_s, tokens_per_step=tokens,
                        decode_tokens_per_s=generated / step_s, transfer_bytes=transfer_bytes,
                        transfer_bytes_per_token=transfer_bytes / generated, compute_s=compute_s,
                        transfer_s=transfer_s, roofline_s=roofline_s, device_bytes=device_bytes,
                        fits=device_bytes <= sc.memory, **extra)


def _roofline(sc: Scenario, transfer_bytes: float, *works: PassWork) -> float:
    """Best possible time: transfers fully hidden behind compute or vice versa."""
    return max(transfer_bytes / sc.hardware.fetch_bw, sum(w.bound_s(sc.hardware) for w in works))


# ---- policies ---------------------------------------------------------------------------------

def resident(sc: Scenario, batch: int) -> StepEstimate:
    """Every expert on the device: compute only (fits only when the model does)."""
    s = sc.shape
    u = sc.distinct(batch)
    w = pass_work(sc, batch, 1, u, grouped=True)
    return _estimate(sc, "resident", batch, w.time_s, 1.0, 0.0, w.time_s, 0.0, w.bound_s(sc.hardware),
                     _device_bytes(sc, batch, 1, s.num_experts * s.num_moe_layers, 0))


def ondemand(sc: Scenario, batch: int) -> StepEstimate:
    """Fetch the union U of the layer's experts when the layer runs, then compute:
    step = compute + M * fetch(U), nothing overlapped, nothing kept."""
    s = sc.shape
    u = sc.distinct(batch)
    w = pass_work(sc, batch, 1, u)
    xfer = s.step_moe_layers * sc.fetch_s(u)
    nbytes = s.step_moe_layers * u * s.expert_bytes
    return _estimate(sc, "ondemand", batch, w.time_s + xfer, 1.0, nbytes, w.time_s, xfer,
                     _roofline(sc, nbytes, w), _device_bytes(sc, batch, 1, 0))


def overlap(sc: Scenario, batch: int, accuracy: float | None = None, policy: str = "overlap") -> StepEstimate:
    """Prefetch the next MoE layer's predicted experts once the current layer is done.

    The prediction needs the layer's output, so a prefetch overlaps the next layer's
    non-expert compute A (attention, router), during which the link runs at
    ``transfer_overlap`` of its rate (h); the experts' own compute X follows.
    Per MoE layer: A + max(0, fetch(U) - h A) + X + fetch(missed)  (h = 1: max(A, fetch(U)) + ...).
    Prediction: each pick is right with probability r (``accuracy``); an expert needed by
    m picks is missed only if all m are mispredicted, so recall = 1 - (1 - r)^(B k / U).
    The predicted set has about U experts, (1 - recall) U of them wrong: those bytes are
    wasted, and the missed experts are fetched on demand after the prefetch."""
    s = sc.shape
    r = sc.prediction_accuracy if accuracy is None else accuracy
    u = sc.distinct(batch)
    w = pass_work(sc, batch, 1, u)
    recall = 1.0 - (1.0 - r) ** (batch * s.top_k / max(u, 1e-9))
    missed = (1.0 - recall) * u
    window = pass_work(sc, batch, 1, 0, routed=False).time_s
    experts = w.time_s - window
    a = window / s.step_moe_layers
    per_layer = a + max(0.0, sc.fetch_s(u) - sc.hardware.transfer_overlap * a) + sc.fetch_s(missed)
    step = s.step_moe_layers * per_layer + experts
    nbytes = s.step_moe_layers * (u + missed) * s.expert_bytes
    return _estimate(sc, policy, batch, step, 1.0, nbytes, w.time_s, s.step_moe_layers * sc.fetch_s(u + missed),
                     _roofline(sc, nbytes, w), _device_bytes(sc, batch, 1, 0),
                     note=f"recall {recall:.2f}")


def oracle_overlap(sc: Scenario, batch: int) -> StepEstimate:
    """The paper's oracle Overlap: perfect prediction, per MoE layer max(G, fetch(U))."""
    return overlap(sc, batch, accuracy=1.0, policy="oracle-overlap")


def cached_per_layer(num_experts: int, fraction: float) -> int:
    """Experts kept resident per block for a cache fraction (at least one when > 0;
    rounded up, as the engine's caching policy does)."""
    if fraction <= 0:
        return 0
    return min(num_experts, max(1, math.ceil(fraction * num_experts - 1e-9)))


def caching(sc: Scenario, batch: int, fraction: float = DEFAULT_CACHE_FRACTION,
            lru_slots: int = 0) -> StepEstimate:
    """The hottest `fraction` of each block's experts stay resident; misses are fetched on
    demand as in ondemand: step = compute + M * fetch(misses).

    `lru_slots`: the rest of the pool as an LRU over all blocks (the engine's caching).
    A step visits the blocks in order, so the LRU keeps the previous step's experts only
    when all of them fit; then a miss is an expert the previous step did not use
    (temporal reuse from the routing model: distinct over 2 positions minus over 1);
    otherwise the scan evicts each expert before its next use and the LRU adds nothing."""
    s = sc.shape
    c = cached_per_layer(s.num_experts, fraction)
    u = sc.distinct(batch)
    miss = sc.distinct(batch, 1, exclude_hottest=c)
    if lru_slots and lru_slots >= s.step_moe_layers * miss:
        miss = max(0.0, sc.distinct(batch, 2, exclude_hottest=c) - miss)
    w = pass_work(sc, batch, 1, u)
    xfer = s.step_moe_layers * sc.fetch_s(miss)
    nbytes = s.step_moe_layers * miss * s.expert_bytes
    hit = 1.0 - miss / u if u else 1.0
    lru = f" + {lru_slots} LRU slots" if lru_slots else ""
    return _estimate(sc, "caching", batch, w.time_s + xfer, 1.0, nbytes, w.time_s, xfer, _roofline(sc, nbytes, w),
                     _device_bytes(sc, batch, 1, c * s.num_moe_layers + lru_slots, 0 if lru_slots else 1),
                     cache_fraction=fraction, note=f"{c}/{s.num_experts} cached{lru}, hit {hit:.2f}")


def host(sc: Scenario, batch: int) -> StepEstimate:
    """Routed experts stay on the host; each is computed there or fetched, whichever is
    cheaper for its token count (Fiddler's rule):

      host(t)   = max(2 t params / host FLOP/s, expert bytes / host read bandwidth)
      device(t) = fetch(1) + max(2 t params / device FLOP/s, expert bytes / device bandwidth)

    t = expected positions routed to the expert given that it is needed. Activations go
    to the host and back per MoE layer (tiny, but two latencies). Serial with the device's
    non-expert compute."""
    s, hw = sc.shape, sc.hardware
    q = sc.routing.hotness(s.num_experts)
    p_touch = sc.routing.touched(s.num_experts, s.top_k, batch, 1)
    p_pos = 1.0 - (1.0 - q) ** s.top_k  # a position picks the expert (at least once)
    t = batch * p_pos / np.maximum(p_touch, 1e-12)
    flops = 2 * t * s.expert_params
    on_host = np.maximum(flops / hw.host_matmul_flops, s.expert_bytes / hw.host_expert_read_bw) \
        + LAUNCHES_PER_EXPERT * hw.kernel_launch_s
    on_dev = sc.fetch_s(1) + np.maximum(flops / hw.device_matmul_flops, s.expert_slot_bytes / hw.device_mem_bw) \
        + LAUNCHES_PER_EXPERT * hw.kernel_launch_s
    use_dev = on_dev < on_host
    expert_s = float((p_touch * np.minimum(on_host, on_dev)).sum())
    fetched = float((p_touch * use_dev).sum())
    act_bytes = 2 * batch * s.hidden * s.bytes_per_param  # hidden states out, results back
    act_s = 2 * hw.transfer_latency_s + act_bytes / hw.h2d_bw
    w = pass_work(sc, batch, 1, 0, routed=False)
    step = w.time_s + s.step_moe_layers * (expert_s + act_s)
    nbytes = s.step_moe_layers * fetched * s.expert_bytes
    host_bound = s.step_moe_layers * float((p_touch * np.maximum(
        flops / hw.host_matmul_flops, s.expert_bytes / hw.host_expert_read_bw) * ~use_dev).sum())
    roof = max(_roofline(sc, nbytes, w), host_bound)
    return _estimate(sc, "host", batch, step, 1.0, nbytes, w.time_s, s.step_moe_layers * sc.fetch_s(fetched), roof,
                     _device_bytes(sc, batch, 1, 0, fetched / max(s.step_moe_layers, 1) + 1),
                     note=f"{float((p_touch * ~use_dev).sum()):.1f}/layer on host, {fetched:.1f} fetched")


QUANT_BITS = {"int8": 8, "int4": 4, "int3": 3}


def specmoe(sc: Scenario, batch: int, gamma: int, draft_experts: int, acceptance: float,
            acceptance_draft_experts: int | None = None, draft_quant: str = "none") -> StepEstimate:
    """Self-assisted speculative decoding, one cycle (draft, verify, refresh):

    - draft: gamma passes over B positions with no transfers. The paper's draft
      (``draft_quant="none"``) uses only the N resident draft experts per block, reading
      at most min(N, B k) experts per layer; a quantized draft (int8/int4/int3 copies of
      every expert on the device, the engine's default) routes exactly and dequantizes
      each expert it runs;
    - verify: one pass over B (gamma + 1) positions (gamma + 1 consecutive per sequence,
      so temporal locality applies), fetching the union minus the draft set (the N
      hottest, resident) once for the pass. The draft's own picks predicted those
      experts, so their fetches are queued, in draft order, when verification starts and
      stream while it computes: verify = V + max(0, X - h V) for compute V, transfer X
      and the link's share h left during compute (``transfer_overlap``);
    - refresh: the new draft set was just fetched: free.

    Tokens per step (per sequence) = (1 - a^(γ+1)) / (1 - a). `acceptance` is per token at
    `acceptance_draft_experts` (default: N) draft experts; for the paper's draft other N
    are scaled by :func:`~specmoe.costmodel.routing.acceptance_at` (a quantized draft does not
    depend on N)."""
    s = sc.shape
    if gamma < 1:
        raise ValueError(f"gamma must be >= 1, got {gamma}")
    if draft_quant != "none" and draft_quant not in QUANT_BITS:
        raise ValueError(f"draft_quant must be none or one of {', '.join(QUANT_BITS)}, got {draft_quant!r}")
    bits = QUANT_BITS.get(draft_quant)
    lowest = 0 if bits else 1
    if not lowest <= draft_experts < s.num_experts:
        raise ValueError(f"draft experts must be in {lowest}..{s.num_experts - 1} for {s.name}, got {draft_experts}")
    n_ref = acceptance_draft_experts or draft_experts
    a = acceptance if bits else acceptance_at(acceptance, n_ref, draft_experts, s.num_experts, sc.routing)
    tokens = tokens_per_step(a, gamma)
    if bits:
        draft = pass_work(sc, batch, 1, sc.distinct(batch), quant_bits=bits)
        copies = s.step_moe_layers * s.num_experts * s.expert_params * bits / 8 * 1.03  # + group scales
    else:
        draft = pass_work(sc, batch, 1, min(draft_experts, batch * s.top_k))
        copies = 0.0
    L = gamma + 1
    u = sc.distinct(batch, L)
    fetch = sc.distinct(batch, L, exclude_hottest=draft_experts)
    verify = pass_work(sc, batch, L, u)
    xfer = s.step_moe_layers * sc.fetch_s(fetch)
    compute = gamma * draft.time_s + verify.time_s
    exposed = max(0.0, xfer - sc.hardware.transfer_overlap * verify.time_s)  # transfer not hidden by verify
    nbytes = s.step_moe_layers * fetch * s.expert_bytes
    roof = max(nbytes / sc.hardware.fetch_bw, gamma * draft.bound_s(sc.hardware) + verify.bound_s(sc.hardware))
    label = f"γ={gamma} N={draft_experts}" + (f" {draft_quant} draft" if bits else "")
    return _estimate(sc, "specmoe", batch, compute + exposed, tokens, nbytes, compute, xfer, roof,
                     _device_bytes(sc, batch, L, draft_experts * s.step_moe_layers) + copies,
                     gamma=gamma, draft_experts=draft_experts, acceptance=a, draft_quant=draft_quant,
                     note=f"{label} a={a:.2f}; draft {gamma * draft.time_s * 1e3:.3g} ms, "
                          f"verify {verify.time_s * 1e3:.3g} ms + {exposed * 1e3:.3g} ms of {xfer * 1e3:.3g} ms "
                          f"transfer not hidden")


POLICIES = {
    "resident": resident,
    "ondemand": ondemand,
    "overlap": overlap,
    "oracle-overlap": oracle_overlap,
    "caching": caching,
    "host": host,
    "specmoe": specmoe,
}


def estimate(policy: str, sc: Scenario, batch: int, **params) -> StepEstimate:
    """Dispatch by policy name; params go to the policy function (gamma, draft_experts,
    acceptance for specmoe; fraction for caching)."""
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}: use one of {', '.join(POLICIES)}")
    if batch < 1:
        raise ValueError(f"batch size must be >= 1, got {batch}")
    return POLICIES[policy](sc, batch, **params)


def roofline(policy: str, sc: Scenario, batch: int, **params) -> float:
    """Best possible step time of `policy` at `batch`: max(transfer time of its bytes,
    compute bound of its work), i.e. perfect overlap and no overheads."""
    return estimate(policy, sc, batch, **params).roofline_s
