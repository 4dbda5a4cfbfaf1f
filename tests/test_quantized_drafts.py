"""Quantized draft experts: the number formats (round trip, packing) and SpecMoE with
quantized copies of every expert — exact output, nothing moved while drafting, every
byte in the budget."""

import functools
from collections import deque
from types import SimpleNamespace

import pytest
import torch
from factories import (
    BOOKKEEPING_ALLOWANCE,
    _rewrite,
    device_bytes_held,
    make_checkpoint,
    random_prompts,
    resident_reference,
    watch_device_bytes,
    watch_draft_reads,
)

from specmoe import LLM, SamplingParams
from specmoe.base.checkpoint import Checkpoint
from specmoe.base.specs import ExpertSpec
from specmoe.experts import formats, kernels
from specmoe.experts.kernels import Shape
from specmoe.experts.quant import (
    BITS,
    BlockMatrix,
    Int4KernelMatrix,
    Int8KernelMatrix,
    QuantizedExpert,
    QuantizedExperts,
    QuantizedMatrix,
    device_layout,
    draft_copy_bytes,
    group_size,
    pack,
    packed_size,
    quantize_expert,
    quantize_matrix,
    quantized_expert_forward,
    unpack,
)
from specmoe.experts.quant_cache import load_quantized, quantize_all
from specmoe.experts.quant_report import quant_error_report
from specmoe.kernels import blockdot
from specmoe.model.moe import Routing, group_by_expert, run_expert

MODES = ["int8", "int4", "int3"]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)

# The fused-kernel shapes this file's tests meet. The engine self-checks each new shape in
# a child process and keeps the verdict in the cache dir; one child for all of them at the
# start instead of one per test (each starts by importing torch, seconds on 2 cores). The
# tests then read the same verdicts, measured the same way; a shape missing here is
# checked when met, as before.
KERNEL_SHAPES = [Shape("int4", 32, 128, 128), Shape("int8", 48, 128), Shape("int8", 48, 256), Shape("int8", 48, 48),
                 Shape("int8", 128, 128), Shape("int8", 128, 64), Shape("int4", 128, 128, 128), Shape("int4", 128, 64, 64),
                 Shape("int8", 48, 32), Shape("int4", 48, 32, 32)]


@pytest.fixture(scope="module", autouse=True)
def _kernel_verdicts(_private_cache_dir):
    kernels.verdicts(KERNEL_SHAPES)


# --- formats ------------------------------------------------------------------------------


@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("n", [8, 30, 256])
def test_pack_unpack_is_exact(bits, n):
    codes = torch.randint(0, 1 << bits, (3, n), dtype=torch.uint8, generator=torch.Generator().manual_seed(n))
    packed = pack(codes, bits)
    assert packed.dtype == torch.uint8 and packed.shape == (3, packed_size(n, bits))
    assert torch.equal(unpack(packed, bits, n), codes)


def test_int4_packs_two_codes_per_byte():
    assert packed_size(256, 4) == 128 and packed_size(256, 3) == 96


@pytest.mark.parametrize("in_features,group", [(256, 128), (192, 64), (24, 24)])
@pytest.mark.parametrize("bits", [3, 4])
def test_packed_modes_group_128_or_64_else_the_whole_row(in_features, group, bits):
    assert group_size(in_features, bits) == group


def test_int8_has_one_group_per_row():
    assert group_size(256, 8) == 256
    q = quantize_matrix(torch.randn(4, 16, 256), 8)
    assert q.group == 256 and q.scales.shape == (4, 16, 1)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("in_features", [256, 40])
def test_round_trip_error_is_at_most_half_a_step_per_group(mode, in_features):
    bits = BITS[mode]
    w = torch.randn(2, 24, in_features, generator=torch.Generator().manual_seed(bits)) * 0.1
    q = quantize_matrix(w, bits)
    back = q.dequantize(torch.float32)
    assert back.shape == w.shape
    g = q.group
    step = w.view(2, 24, in_features // g, g).abs().amax(-1) / ((1 << (bits - 1)) - 1)  # the scale
    err = (back - w).abs().view(2, 24, in_features // g, g).amax(-1)
    assert torch.all(err <= 0.5 * step * (1 + 2e-3) + 1e-7)
    rel = float((back - w).norm() / w.norm())
    assert rel < {8: 0.01, 4: 0.15, 3: 0.35}[bits]


def test_one_expert_of_a_stack_dequantizes_like_the_stack():
    w = torch.randn(4, 16, 128, generator=torch.Generator().manual_seed(1))
    q = quantize_matrix(w, 4)
    assert torch.equal(q.select(2).dequantize(torch.float32), q.dequantize(torch.float32)[2])


def why_portable(shape: Shape) -> str:
    """Why matrices of this shape take the portable path here (skip_allowlist.txt accepts a failed self-check)."""
    return kernels.choose([shape], torch.device("cpu"))[shape].why


def test_the_fused_int4_layout_computes_what_the_portable_format_does():
    w = torch.randn(3, 32, 128, generator=torch.Generator().manual_seed(4)) * 0.1
    q = quantize_matrix(w, 4)
    k = device_layout(q, torch.device("cpu"))
    if not isinstance(k, Int4KernelMatrix):
        pytest.skip(f"the fused int4 kernel is not used here: {why_portable(Shape('int4', 32, 128, 128))}")
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(5))
    ref = q.select(1).linear(x)
    assert float((k.select(1).linear(x) - ref).norm() / ref.norm()) < 1e-2  # bf16 activations


@pytest.mark.parametrize("in_features", [128, 256, 48])
def test_the_int8_kernel_layout_computes_what_the_portable_format_does(in_features):
    """One kernel call per matrix: the same codes and row scales (the scales and
    activations in bf16), so the same product up to bf16 rounding."""
    w = torch.randn(3, 48, in_features, generator=torch.Generator().manual_seed(6)) * 0.1
    q = quantize_matrix(w, 8)
    k = device_layout(q, torch.device("cpu"))
    if not isinstance(k, Int8KernelMatrix):
        pytest.skip(f"the int8 kernel is not used here: {why_portable(Shape('int8', 48, in_features))}")
    # the same codes; each expert's 48 bf16 scales (96 bytes) padded to 128 to keep the next aligned
    assert k.nbytes == 3 * (48 * in_features + 128) and k.scratch_bytes(torch.float32) == 0
    x = torch.randn(5, in_features, generator=torch.Generator().manual_seed(7))
    for e in range(3):
        ref = q.select(e).linear(x)
        got = k.select(e).linear(x)
        assert got.dtype == x.dtype
        assert float((got - ref).norm() / ref.norm()) < 1e-2  # bf16 activations
    assert k.select(1).linear(x.bfloat16()).dtype == torch.bfloat16  # a bf16 input stays bf16


def test_matrices_the_kernel_cannot_take_keep_the_portable_format():
    q = quantize_matrix(torch.randn(32, 24), 4)  # group 24: not a kernel group size, nor whole blocks of 32
    assert isinstance(device_layout(q, torch.device("cpu")), QuantizedMatrix)
    assert isinstance(device_layout(quantize_matrix(torch.randn(32, 64), 8), torch.device("meta")), QuantizedMatrix)


@pytest.mark.skipif(not blockdot.available(), reason="the block kernels are not built on this machine")
@pytest.mark.parametrize("bits, in_features, block", [(8, 256, "Q8_0"), (8, 96, "Q8_0"), (4, 256, "Q4_0"),
                                                      (4, 64, "Q4_0"), (4, 96, "Q4_0")])
def test_copies_torchs_kernels_do_not_take_are_ggml_blocks_of_the_same_weights(bits, in_features, block, monkeypatch):
    """int8 as Q8_0 (the row's scale in every block), int4 as Q4_0 (its group's scale; int4
    groups are 128, 64 or the row): dequantized, bit for bit the copy's weights; multiplied
    with 8-bit activations, close to the portable product and the same bits for a row alone
    and among others. Their bytes are what the budget counts for them."""
    monkeypatch.setenv("SPECMOE_FUSED_KERNELS", "off")  # as where torch's kernels failed their self-check
    w = torch.randn(3, 48, in_features, generator=torch.Generator().manual_seed(8)) * 0.1
    q = quantize_matrix(w, bits)
    k = device_layout(q, torch.device("cpu"))
    assert isinstance(k, BlockMatrix) and k.type_name == block
    x = torch.randn(9, in_features, generator=torch.Generator().manual_seed(9))
    for e in range(3):
        assert torch.equal(k.select(e).dequantize(), q.select(e).dequantize(torch.float32))
        ref, got = q.select(e).linear(x), k.select(e).linear(x)
        assert float((got - ref).norm() / ref.norm()) < 2e-2  # 8-bit activations
        assert torch.equal(got[4], k.select(e).linear(x[4:5])[0])
    assert k.nbytes == 3 * 48 * (in_features // 32) * (34 if bits == 8 else 18)
    spec = ExpertSpec(in_features, 48)
    qe = quantize_expert(torch.randn(spec.numel, generator=torch.Generator().manual_seed(10)), spec, bits)
    assert qe.to(torch.device("cpu")).nbytes == draft_copy_bytes(spec, f"int{bits}", torch.device("cpu"))[0]


@pytest.mark.parametrize("spec", [ExpertSpec(128, 64), ExpertSpec(128, 64, "clamped_swiglu", bias=True, limit=1.0)],
                         ids=["swiglu", "clamped_swiglu_with_biases"])
@pytest.mark.parametrize("mode", MODES)
def test_quantized_expert_forward_is_close_to_the_full_expert(mode, spec):
    buf = torch.randn(spec.numel, generator=torch.Generator().manual_seed(2)) * 0.05
    x = torch.randn(5, spec.hidden, generator=torch.Generator().manual_seed(3))
    qe = quantize_expert(buf, spec, BITS[mode])
    y, yq = run_expert(buf, x, spec), quantized_expert_forward(x, qe, spec)
    assert qe.nbytes == draft_copy_bytes(spec, mode)[0]
    bound = {"int8": 0.02, "int4": 0.25, "int3": 0.5}[mode]
    assert float((yq - y).norm() / y.norm()) < bound
    on_device = quantized_expert_forward(x, qe.to(torch.device("cpu")), spec)  # fused int4 kernel where it applies
    assert float((on_device - y).norm() / y.norm()) < bound


@pytest.mark.parametrize("scales_input", [False, True], ids=["output-weights", "input-weights"])
@pytest.mark.parametrize("spec", [ExpertSpec(128, 64), ExpertSpec(128, 64, "clamped_swiglu", bias=True, limit=1.0)],
                         ids=["swiglu", "clamped_swiglu_with_biases"])
@pytest.mark.parametrize("mode", MODES)
def test_a_blocks_copies_run_together_as_each_runs_alone(mode, spec, scales_input):
    """The draft's block path (rows gathered once, one activation for all experts) gives
    each expert exactly what its copy gives alone on its own tokens."""
    E, T, K = 6, 9, 2
    gen = torch.Generator().manual_seed(11)
    bufs = torch.randn(E, spec.numel, generator=gen) * 0.05
    experts = [quantize_expert(b, spec, BITS[mode]) for b in bufs]
    stacked = QuantizedExpert(*(_stack([getattr(q, m) for q in experts]) for m in ("gate_up", "down", "b_in", "b_out")))
    copies = QuantizedExperts(mode, {0: stacked}, spec).to(torch.device("cpu"))
    x = torch.randn(T, spec.hidden, generator=gen).to(copies.compute_dtype or torch.float32)
    ids = torch.stack([torch.randperm(E - 1, generator=gen)[:K] for _ in range(T)])  # expert E - 1: never picked
    groups = group_by_expert(Routing(ids, torch.rand(T, K, generator=gen), scales_input), E)
    skip = {groups.experts[1]}
    outputs = copies.block_outputs(0, x, groups, skip=skip)
    assert len(outputs) == len(groups.experts)
    for j, e in enumerate(groups.experts):
        if e in skip:
            assert outputs[j] is None
        else:
            assert torch.equal(outputs[j], quantized_expert_forward(groups.inputs(x, j), copies.expert(0, e), spec))


def _stack(parts):
    if parts[0] is None:
        return None
    if isinstance(parts[0], torch.Tensor):
        return torch.stack(parts)
    return QuantizedMatrix(torch.stack([m.data for m in parts]), torch.stack([m.scales for m in parts]), parts[0].bits,
                           parts[0].in_features)


def test_quantized_copies_are_cached_by_checkpoint_and_mode(tiny_ckpt, tmp_path):
    ckpt = Checkpoint(tiny_ckpt("mixtral"))
    first = load_quantized(ckpt, "int4", tmp_path)
    files = list(tmp_path.glob("quant-*int4*.safetensors"))
    assert len(files) == 1 and ckpt.fingerprint() in files[0].name
    again = load_quantized(ckpt, "int4", tmp_path)
    for layer, q in first.layers.items():
        assert torch.equal(q.gate_up.data, again.layers[layer].gate_up.data)
        assert torch.equal(q.down.scales, again.layers[layer].down.scales)


def test_error_report_has_one_row_per_moe_block(tiny_ckpt):
    ckpt = Checkpoint(tiny_ckpt("mixtral"))
    rows = {m: quant_error_report(ckpt, m, num_tokens=16) for m in ("int8", "int4")}
    assert [r["layer"] for r in rows["int4"]] == list(ckpt.config.moe_layer_ids)
    for r8, r4 in zip(rows["int8"], rows["int4"]):
        assert 0 < r8["mean_rel_l2"] < r4["mean_rel_l2"] < 0.5


# --- SpecMoE with quantized draft experts ---------------------------------------------------------


@pytest.fixture(scope="module")
def reference(tiny_ckpt):
    path = tiny_ckpt("mixtral")
    prompts = random_prompts(6, 128, 3, 10, seed=5)
    sha, budgets, _ = resident_reference(path, prompts, GREEDY, 6, 48, (0.5,))
    return path, prompts, sha, budgets


def quant_llm(path, budget, tmp_path, **kw):
    opts = dict(device="cpu", policy="specmoe", offload="disk", offload_dir=str(tmp_path), device_memory=budget,
                max_batch_size=6, max_model_len=48, gamma=3, draft_quant="none")
    opts.update(kw)
    return LLM(model=str(path), **opts)


@pytest.mark.parametrize("mode", ["none", *MODES])
def test_greedy_output_is_exactly_residents_in_every_draft_mode(reference, tmp_path, mode):
    path, prompts, sha, budgets = reference
    llm = quant_llm(path, budgets[0.5], tmp_path, draft_quant=mode)
    held = watch_device_bytes(llm.engine)  # quantized copies included, measured, not read from the ledger
    llm.generate(prompts, GREEDY)
    stats = llm.last_stats
    assert stats["token_ids_sha256"] == sha
    assert stats["draft_quant"] == mode
    assert held.excess(budgets[0.5]) <= BOOKKEEPING_ALLOWANCE
    llm.close()


@pytest.mark.skipif(not blockdot.available(), reason="the block kernels are not built on this machine")
@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_copies_on_the_block_kernels_give_residents_tokens_within_their_bytes(reference, tmp_path, mode, monkeypatch):
    """Where torch's kernels are refused the copies run as ggml blocks: the tokens are
    resident's, the statistics name the layout, the bytes held are what the budget counts."""
    monkeypatch.setenv("SPECMOE_FUSED_KERNELS", "off")
    path, prompts, sha, budgets = reference
    llm = quant_llm(path, budgets[0.5], tmp_path, draft_quant=mode)
    held = watch_device_bytes(llm.engine)
    llm.generate(prompts, GREEDY)
    stats = llm.last_stats
    assert stats["token_ids_sha256"] == sha and stats["acceptance_rate"] > 0.5
    # the gate and up rows (K = hidden = 32) as blocks; the down matrix (K = 24, not whole blocks) dequantized
    kernels_used = {k.split(" K=")[1].split()[0]: why for k, why in stats["fused_kernels"].items()}
    assert kernels_used["32"].startswith("blockdot") and kernels_used["24"].startswith("portable"), kernels_used
    first = llm.engine.policy.quantized.expert(llm.config.moe_layer_ids[0], 0)
    assert isinstance(first.gate_up, BlockMatrix) and isinstance(first.down, QuantizedMatrix)
    assert held.excess(budgets[0.5]) <= BOOKKEEPING_ALLOWANCE
    llm.close()


@pytest.mark.parametrize("mode", MODES)
def test_the_copies_bytes_are_known_before_they_are_built(reference, tmp_path, mode):
    """What the engine's minimum budget counts for the draft (draft_copy_bytes) is what the
    copies hold on the device, the fused int4 kernel's layout included."""
    ckpt = Checkpoint(reference[0])
    c = ckpt.config
    keys = [(layer, e) for layer in c.moe_layer_ids for e in range(c.num_experts)]
    copies = quantize_all(ckpt, keys, mode, tmp_path, torch.device("cpu"))
    copy, scratch = draft_copy_bytes(c.expert, mode, torch.device("cpu"))
    assert (copies.nbytes, copies.scratch_bytes(torch.float32)) == (copy * len(keys), scratch)


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quantized_copies_are_reserved_before_the_pool(reference, tmp_path, mode):
    path, _, _, budgets = reference
    plain = quant_llm(path, budgets[0.5], tmp_path)
    quant = quant_llm(path, budgets[0.5], tmp_path, draft_quant=mode)
    ledger = quant.engine.budget.by_item
    qbytes = ledger["quantized draft experts"]
    assert qbytes == quant.engine.policy.quantized.nbytes > 0
    scratch = quant.engine.policy.quantized.scratch_bytes(torch.float32)  # 0 where the fused kernels compute
    assert {k: v for k, v in ledger.items() if "scratch" in k} == ({"quantized draft scratch": scratch} if scratch else {})
    expert_bytes = quant.engine.policy.pool.expert_bytes
    before_pool = sum(v for k, v in ledger.items() if k != "expert pool")
    assert quant.engine.policy.pool.num_slots == (budgets[0.5] - before_pool) // expert_bytes
    assert quant.engine.policy.pool.num_slots < plain.engine.policy.pool.num_slots
    plain.close()
    quant.close()


def test_no_full_precision_draft_expert_when_the_budget_has_none_to_spare(reference, tmp_path):
    """Tiny model, half the expert bytes: int8 copies (27 %) + scratch leave only the
    working slots, so the draft runs on quantized copies alone."""
    path, prompts, sha, budgets = reference
    llm = quant_llm(path, budgets[0.5], tmp_path, draft_quant="int8")
    assert llm.engine.policy.draft_experts == 0
    llm.generate(prompts, GREEDY)
    stats = llm.last_stats
    assert stats["token_ids_sha256"] == sha
    assert stats["draft_resident_bytes"] == 0 and stats["draft_quantized_bytes"] > 0
    llm.close()


def test_int4_leaves_room_for_full_precision_draft_experts_too(reference, tmp_path):
    path, prompts, sha, budgets = reference
    llm = quant_llm(path, budgets[0.5], tmp_path, draft_quant="int4")
    assert llm.engine.policy.draft_experts >= 1
    llm.generate(prompts, GREEDY)
    stats = llm.last_stats
    assert stats["token_ids_sha256"] == sha
    assert stats["draft_resident_bytes"] > 0 and stats["draft_quantized_bytes"] > 0
    llm.close()


def test_the_device_check_sees_one_uncharged_int4_expert_held_inside_passes(reference, tmp_path, monkeypatch):
    """A draft that keeps one int4 expert's bytes it did not charge from its first block until
    its pass ends (so never there between passes): the samples at block boundaries see all of
    it, and it is more than the allowance."""
    path, prompts, _, budgets = reference
    llm = quant_llm(path, budgets[0.5], tmp_path, draft_quant="int4")
    policy, c = llm.engine.policy, llm.config
    int4_expert = 3 * c.hidden_size * c.expert_intermediate_size // 2  # 4 bits a weight, scales not counted
    assert BOOKKEEPING_ALLOWANCE < int4_expert
    draft_block, end_pass = policy.drafter.run_moe, policy.end_pass

    def keeping(layer, x, routing):
        policy.kept = torch.empty(int4_expert, dtype=torch.uint8)
        return draft_block(layer, x, routing)

    def dropping(kind):
        policy.__dict__.pop("kept", None)
        end_pass(kind)

    monkeypatch.setattr(policy.drafter, "run_moe", keeping)
    monkeypatch.setattr(policy, "end_pass", dropping)
    held = watch_device_bytes(llm.engine)
    llm.generate(prompts, GREEDY)
    assert int4_expert <= max(held.over_ledger) <= int4_expert + BOOKKEEPING_ALLOWANCE
    assert held.excess(budgets[0.5]) > BOOKKEEPING_ALLOWANCE
    llm.close()


@pytest.mark.parametrize("where", ["closure", "deque", "partial", "module-level lru_cache"])
def test_the_device_walk_finds_an_expert_kept_out_of_attributes_reach(reference, tmp_path, monkeypatch, where):
    """One int4 expert's bytes kept where a walk of attributes, dicts and lists does not
    look: device_bytes_held must grow by exactly those bytes."""
    path, _, _, budgets = reference
    llm = quant_llm(path, budgets[0.5], tmp_path, draft_quant="int4")
    policy, c = llm.engine.policy, llm.config
    kept = torch.empty(3 * c.hidden_size * c.expert_intermediate_size // 2, dtype=torch.uint8)
    before = device_bytes_held(llm.engine)
    if where == "closure":
        policy.later = lambda: kept.sum()
    elif where == "deque":
        policy.recent = deque([kept])
    elif where == "partial":
        policy.later = functools.partial(torch.sum, kept)
    else:  # a module's cache, as formats.py's: only the cache holds what it returned
        n = kept.nbytes
        monkeypatch.setattr(formats, "_fp4_table", functools.lru_cache(maxsize=1)(lambda *_: torch.empty(n)))
        kept = formats._fp4_table(torch.device("cpu"), torch.uint8)  # n float32s: 4 n bytes
    assert device_bytes_held(llm.engine) - before == kept.nbytes
    llm.close()


def test_the_device_walk_counts_formats_fp4_table_cache():
    """formats.py's own lru_cache of the FP4 value table (16 values) is module-level state.
    The table this test adds is dropped again: every later walk in this process would count
    it (128 bytes, 1/8 of BOOKKEEPING_ALLOWANCE) against that test's engine."""
    engine = SimpleNamespace(checkpoint=None, policy=None, tokenizer=None, device=torch.device("cpu"))
    formats._fp4_table.cache_clear()
    try:
        before = device_bytes_held(engine)
        formats._fp4_table(torch.device("cpu"), torch.float64)
        assert device_bytes_held(engine) - before == 16 * 8
    finally:
        formats._fp4_table.cache_clear()


def test_quantized_draft_moves_no_expert_bytes(reference, tmp_path):
    path, prompts, _, budgets = reference
    llm = quant_llm(path, budgets[0.5], tmp_path, draft_quant="int4", gamma=4)
    reads_while_drafting = watch_draft_reads(llm.engine)
    llm.generate(prompts, GREEDY)
    assert llm.last_stats["acceptance_rate"] is not None
    assert reads_while_drafting == []
    llm.close()


@pytest.fixture(scope="module")
def int8_exact(tmp_path_factory):
    """The tiny Mixtral with experts int8 holds exactly: every row is integers of -127..127
    times 2^-9, 127 among them, so its scale is 127 x 2^-9 / 127 = 2^-9 (exact in float16)
    and its codes are those integers."""
    path = make_checkpoint("mixtral", tmp_path_factory.mktemp("int8-exact"))

    def integers(tensors):
        gen = torch.Generator().manual_seed(0)
        for name, t in tensors.items():
            if ".experts." in name:
                c = torch.randint(-126, 127, t.shape, generator=gen).float()
                c[torch.arange(t.shape[0]), torch.randint(0, t.shape[1], (t.shape[0],), generator=gen)] = 127.0
                tensors[name] = c * 2.0 ** -9
    _rewrite(path, integers)
    return path


def test_int8_copies_route_exactly_so_a_lossless_draft_is_always_accepted(reference, int8_exact, tmp_path,
                                                                          monkeypatch):
    """Where int8 holds every expert exactly, the draft (the model's own router over a copy
    of every expert) computes the full model: each drafted token is the verifier's, so all
    are accepted and agree teacher-forced. The paper's draft on the same weights, 2 resident
    experts per block standing in for the other 6, cannot route exactly and does not."""
    monkeypatch.setenv("SPECMOE_FUSED_KERNELS", "off")  # the fused kernels' bfloat16 activations are not exact
    _, prompts, _, budgets = reference  # the same shapes: the same budget
    got = {}
    for mode in ("int8", "none"):
        llm = quant_llm(int8_exact, budgets[0.5], tmp_path / mode, draft_quant=mode)
        llm.generate(prompts, GREEDY)
        c = llm.engine.counters
        got[mode] = (llm.engine.policy.draft_experts, c.drafted, c.accepted, c.agreed)
        llm.close()
    drafted, accepted, agreed = got["int8"][1:]
    assert got["int8"][0] == 0 and drafted > 0 and accepted == agreed == drafted
    experts, drafted, accepted, _ = got["none"]
    assert experts < 8 and drafted > 0 and accepted < drafted


def test_unknown_draft_quant_is_a_clear_error(reference, tmp_path):
    from specmoe import SpecMoEError

    path, _, _, budgets = reference
    with pytest.raises(SpecMoEError, match="draft_quant 'int5'.*int4"):
        quant_llm(path, budgets[0.5], tmp_path, draft_quant="int5")


def test_quantized_drafts_and_host_drafts_are_alternatives(reference, tmp_path):
    from specmoe import SpecMoEError

    path, _, _, budgets = reference
    with pytest.raises(SpecMoEError, match="drop --draft-compute host"):
        quant_llm(path, budgets[0.5], tmp_path, offload="host", draft_compute="host", draft_quant="int4")
