"""A compressed-tensors checkpoint's int8 / int4 experts, and GPT-OSS's MXFP4 ones, multiplied
as stored on the CPU (`--dtype auto`): each expert's matrices become Q8_0 / Q4_0 / MXFP4
rows in its pool slot where
that holds the checkpoint's numbers exactly, and the block kernels multiply them with
8-bit activations, as they do a GGUF file's; where it would not (float32 scales, groups
not whole blocks of 32, FP8, a scale float16 does not hold, an exponent that is not a
number), the experts are dequantized per call as before, and the format says why.

The reference is transformers' float32 model with the experts' exact float32 weights
(codes unpacked by the compressed-tensors library, times their scales in float32):
transformers' own decompression rounds a bfloat16-scaled weight to bfloat16, which moved
its log-probabilities by 0.005 (median) from `--dtype float32`'s exact ones here."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
from factories import require_compressed_tensors  # noqa: E402

require_compressed_tensors()

from factories import (  # noqa: E402
    _load,
    random_prompts,
    to_bfloat16,
    to_compressed_tensors,
    to_compressed_tensors_with,
)
from safetensors import safe_open  # noqa: E402

from specmoe import LLM, SamplingParams  # noqa: E402
from specmoe.base.checkpoint import Checkpoint  # noqa: E402
from specmoe.base.quantization import ExpertQuant, MatrixQuant  # noqa: E402
from specmoe.base.quantized_tensors import pack_blob  # noqa: E402
from specmoe.base.specs import ExpertSpec  # noqa: E402
from specmoe.base.units import format_bytes  # noqa: E402
from specmoe.experts.formats import QuantizedFormat, expert_format  # noqa: E402
from specmoe.experts.quantized_blocks import QuantizedBlocksFormat  # noqa: E402
from specmoe.kernels import blockdot  # noqa: E402
from specmoe.kernels.packed import PackedMatrix  # noqa: E402
from specmoe.tools.info import model_info  # noqa: E402

pytestmark = pytest.mark.skipif(not blockdot.available(), reason=f"block kernels unavailable: {blockdot.library().why}")

VOCAB = 128
INTER = 64  # the experts' `in` for down: a multiple of 32, as hidden (32) is
# The 8-bit rounding of activations (each block of 32 to amax / 127 steps, as llama.cpp
# rounds them) moves a product by a fraction of a percent: the log-probabilities here by
# 0.009 to 0.011 (median over positions) and at most 0.021 from the exact reference, except
# at a position behind a routing choice it flipped (w4a16: one of 59 positions, 0.27, where
# the reference's second and third router logits were 0.0012 apart). `--dtype float32`
# is 2e-6 from it. GGUF files, rounded the same way, are held to llama.cpp's
# log-probabilities by a median of 0.15.
MEDIAN_TOL, POSITION_TOL, FLIPPED_SHARE = 0.03, 0.06, 0.05
TIE_TOL = 0.1  # a greedy token may differ only where the reference's two best logits are this close
FLOAT32_TOL = 1e-4  # --dtype float32 computes the same weights in float32: rounding only
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)

# name -> (how the checkpoint is made from the bfloat16 tiny Mixtral, the block type expected)
CHECKPOINTS = {
    "w4a16": (lambda src, out: to_compressed_tensors(src, out, "w4a16", group_size=32), "Q4_0"),
    "w8a16": (lambda src, out: to_compressed_tensors(src, out, "w8a16", group_size=32), "Q8_0"),
    "int8-per-channel": (lambda src, out: to_compressed_tensors_with(
        src, out, "pack-quantized", num_bits=8, type="int", symmetric=True, strategy="channel"), "Q8_0"),
}


@pytest.fixture(scope="module")
def bf16_mixtral(tiny_ckpt, tmp_path_factory):
    return to_bfloat16(tiny_ckpt("mixtral", intermediate_size=INTER), tmp_path_factory.mktemp("bf16") / "ckpt")


@pytest.fixture(scope="module")
def quantized(bf16_mixtral, tmp_path_factory):
    """quantized(name) -> the checkpoint of CHECKPOINTS[name], built once per module."""
    built = {}

    def get(name):
        if name not in built:
            built[name] = CHECKPOINTS[name][0](bf16_mixtral, tmp_path_factory.mktemp(name) / "ckpt")
        return built[name]

    return get


def exact_expert_weights(path, layer: int, expert: int) -> dict[str, torch.Tensor]:
    """gate, up and down [out, in] as the checkpoint quantized them, in float32 exactly: the
    codes unpacked by the compressed-tensors library, times their group's scale."""
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

    out = {}
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        for part in ("w1", "w3", "w2"):
            name = f"model.layers.{layer}.block_sparse_moe.experts.{expert}.{part}"
            shape = torch.Size(f.get_tensor(f"{name}.weight_shape").tolist())
            bits = 32 * f.get_tensor(f"{name}.weight_packed").shape[1] // shape[1]  # codes packed in int32 words
            codes = unpack_from_int32(f.get_tensor(f"{name}.weight_packed"), bits, shape)
            scales = f.get_tensor(f"{name}.weight_scale").float()
            out[part] = codes.float() * scales.repeat_interleave(shape[1] // scales.shape[1], dim=1)
    return {"gate": out["w1"], "up": out["w3"], "down": out["w2"]}


def exact_reference(path):
    """transformers' float32 model of `path` with the experts' exact float32 weights."""
    model = _load(path)
    config = Checkpoint(path).config
    for layer in range(config.num_layers):
        experts = model.model.layers[layer].mlp.experts
        weights = [exact_expert_weights(path, layer, e) for e in range(config.num_experts)]
        experts.gate_up_proj = torch.nn.Parameter(torch.stack([torch.cat([w["gate"], w["up"]]) for w in weights]))
        experts.down_proj = torch.nn.Parameter(torch.stack([w["down"] for w in weights]))
    return model


@torch.no_grad()
def reference_logprobs(model, prompt: list[int]) -> torch.Tensor:
    return torch.log_softmax(model(input_ids=torch.tensor([prompt])).logits[0].float(), dim=-1)


def llm(path, **options) -> LLM:
    return LLM(model=str(path), device="cpu", **{"max_batch_size": 16, "max_model_len": 48, **options})


# --- the re-encoding ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_a_slots_blocks_are_the_checkpoints_weights_bit_for_bit(quantized, name):
    path = quantized(name)
    ckpt = Checkpoint(path)
    spec, layer = ckpt.config.expert, ckpt.config.moe_layer_ids[-1]
    fmt = expert_format(ckpt.config, torch.float32, "cpu", as_stored=True)
    assert isinstance(fmt, QuantizedBlocksFormat) and set(fmt.types.values()) == {CHECKPOINTS[name][1]}
    assert fmt.nbytes == ckpt.config.expert_quant.nbytes  # what is stored and moved: the blob
    slot = torch.empty(fmt.slot_numel, dtype=fmt.slot_dtype)
    for e in (0, 5):
        fmt.prepare(fmt.read(ckpt, layer, e), slot)
        assert fmt.holds_blocks(slot)
        w_in = PackedMatrix.of(fmt.section(slot, "w_in"), fmt.types["w_in"], spec.in_rows, spec.hidden).dequantize()
        down = PackedMatrix.of(fmt.section(slot, "w_out"), fmt.types["w_out"], spec.hidden, spec.inter).dequantize()
        want = exact_expert_weights(path, layer, e)
        assert torch.equal(w_in[:spec.inter], want["gate"]) and torch.equal(w_in[spec.inter:], want["up"])
        assert torch.equal(down, want["down"])


def test_an_expert_with_a_scale_float16_does_not_hold_keeps_its_blob():
    """A bfloat16 scale below float16's normal range loses bits there: that expert's slot
    keeps its blob and computes as the dequantizing format does; the others' hold blocks."""
    spec = ExpertSpec(32, 64)
    w_in, w_out = MatrixQuant(128, 32, "int4", 1, 32, "bfloat16"), MatrixQuant(32, 64, "int4", 1, 32, "bfloat16")
    quant = ExpertQuant("int4", "compressed-tensors", w_in, w_out)
    gen = torch.Generator().manual_seed(0)
    parts = [(torch.randint(-8, 8, (m.rows, m.cols), generator=gen, dtype=torch.int8),
              (torch.rand(m.scale_shape, generator=gen) * 0.02 + 0.01).to(torch.bfloat16)) for m in (w_in, w_out)]
    plain = QuantizedFormat(spec, quant)
    fmt = QuantizedBlocksFormat(spec, quant, plain)
    x = torch.randn(3, 32, generator=gen)
    slot = torch.empty(fmt.slot_numel, dtype=torch.uint8)
    fmt.prepare(pack_blob(quant, *parts), slot)
    assert fmt.holds_blocks(slot)
    tiny = torch.tensor(2.0 ** -20 * (1 + 2 ** -7), dtype=torch.bfloat16)  # float16 keeps 4 of its bits
    assert tiny.to(torch.float16).to(torch.bfloat16) != tiny
    parts[1][1][7, 0] = tiny
    blob = pack_blob(quant, *parts)
    fmt.prepare(blob, slot)
    assert not fmt.holds_blocks(slot)
    assert torch.equal(fmt.forward(slot, x), plain.forward(blob, x))
    assert fmt.forward_token([slot], [1.0], x[:1]) is None  # one at a time, through the blob


def test_an_expert_with_biases_multiplies_its_blocks_one_matrix_at_a_time():
    """Not a gated SiLU expert without biases (here fc1 / relu / fc2 with biases): no single
    kernel call, each matrix's blocks multiplied in turn, the biases added as stored. The
    result is the dequantized expert's up to the activations' 8-bit rounding."""
    from specmoe.experts.formats import dequantize
    from specmoe.model.moe import expert_forward

    spec = ExpertSpec(32, 64, activation="relu", bias=True)
    w_in, w_out = MatrixQuant(64, 32, "int8", 1, 32, "bfloat16"), MatrixQuant(32, 64, "int8", 1, 32, "bfloat16")
    quant = ExpertQuant("int8", "compressed-tensors", w_in, w_out, bias=True)
    gen = torch.Generator().manual_seed(1)
    parts = [(torch.randint(-127, 128, (m.rows, m.cols), generator=gen, dtype=torch.int8),
              (torch.rand(m.scale_shape, generator=gen) * 0.01 + 0.005).to(torch.bfloat16)) for m in (w_in, w_out)]
    biases = torch.randn(64, generator=gen), torch.randn(32, generator=gen)
    blob = pack_blob(quant, *parts, *biases)
    plain = QuantizedFormat(spec, quant)
    fmt = QuantizedBlocksFormat(spec, quant, plain)
    slot = torch.empty(fmt.slot_numel, dtype=torch.uint8)
    fmt.prepare(blob, slot)
    assert fmt.holds_blocks(slot) and not fmt.one_call
    x = torch.randn(4, 32, generator=gen)
    dense = [dequantize(plain.section(blob, f"{n}.codes"), plain.section(blob, f"{n}.scales"), m, torch.float32)
             for n, m in (("w_in", w_in), ("w_out", w_out))]
    want = expert_forward(spec, x, lambda t: t @ dense[0].t(), lambda t: t @ dense[1].t(), *biases)
    got = fmt.forward(slot, x)
    assert not torch.equal(got, want) and torch.allclose(got, want, atol=2e-2 * want.abs().max(), rtol=0)
    assert fmt.forward_token([slot], [1.0], x[:1]) is None


@pytest.mark.parametrize(("make", "why"), [
    (lambda src, f32, out: to_compressed_tensors(f32, out, "w4a16", group_size=32),
     "float32 scales: a block's float16 scale would round them"),
    (lambda src, f32, out: to_compressed_tensors(src, out, "w4a16", group_size=8),
     "w_in's groups of 8 of 32 columns are not whole blocks of 32"),
    (lambda src, f32, out: to_compressed_tensors(src, out, "fp8"),
     "fp8 codes: no ggml block holds e4m3 values exactly"),
], ids=["float32-scales", "groups-of-8", "fp8"])
def test_experts_the_blocks_cannot_hold_exactly_are_dequantized_and_say_why(tiny_ckpt, bf16_mixtral, tmp_path, make,
                                                                            why):
    path = make(bf16_mixtral, tiny_ckpt("mixtral", intermediate_size=INTER), tmp_path / "q")
    engine = llm(path, max_batch_size=2)
    fmt = engine.engine.policy.format
    assert type(fmt) is QuantizedFormat and not fmt.converts
    scheme = Checkpoint(path).config.expert_quant.scheme
    assert fmt.kernels[f"{scheme} experts"] == f"dequantized per call, not as stored: {why}"
    engine.generate([[5, 6, 7]], SamplingParams(max_tokens=2, temperature=0.0))
    assert engine.last_stats["fused_kernels"][f"experts {scheme} experts"].endswith(why)
    engine.close()


# --- the model ---------------------------------------------------------------------------------


@pytest.fixture
def kernel_calls(monkeypatch):
    """The block types of every one-call expert product the block kernels compute (a list per call)."""
    calls = []
    for name in ("swiglu", "experts"):
        original = getattr(blockdot, name)

        def spy(x, *args, _original=original, _name=name, **kw):
            matrices = args[:3] if _name == "swiglu" else [m for expert in args[0] for m in expert]
            calls.append({t for _, t in matrices})
            return _original(x, *args, **kw)

        monkeypatch.setattr(blockdot, name, spy)
    return calls


@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_log_probabilities_and_greedy_tokens_are_transformers_float32_ones(quantized, kernel_calls, name):
    path = quantized(name)
    reference = exact_reference(path)
    prompts = random_prompts(6, VOCAB, 3, 24, seed=8)
    want = [reference_logprobs(reference, p) for p in prompts]
    exact = llm(path, dtype="float32")
    for got, w in zip(exact.score(prompts), want):
        assert (torch.as_tensor(got) - w).abs().max() <= FLOAT32_TOL
    exact.close()
    assert not kernel_calls
    stored = llm(path)
    diffs = torch.cat([(torch.as_tensor(g) - w).abs().amax(-1) for g, w in zip(stored.score(prompts), want)])
    assert diffs.median() <= MEDIAN_TOL, diffs
    assert (diffs > POSITION_TOL).float().mean() <= FLIPPED_SHARE, diffs
    for prompt in prompts[:3]:
        tokens = stored.generate([prompt], GREEDY)[0].token_ids
        seq = list(prompt)
        for token in tokens:  # the reference's greedy choice at each position of specmoe's sequence
            logits = reference(input_ids=torch.tensor([seq])).logits[0, -1].detach()
            assert logits.max() - logits[token] <= TIE_TOL, (seq, token, int(logits.argmax()))
            seq.append(token)
    assert kernel_calls and all(types == {CHECKPOINTS[name][1]} for types in kernel_calls)
    stored.close()


@pytest.fixture(scope="module")
def resident_tokens(quantized):
    """resident_tokens(name, batch) -> (prompts, the resident model's token_ids_sha256 at that batch size)."""
    cache = {}

    def get(name, batch):
        if (name, batch) not in cache:
            prompts = random_prompts(16, VOCAB, 3, 18, seed=5)
            engine = llm(quantized(name), max_batch_size=batch)
            engine.generate(prompts, GREEDY)
            assert type(engine.engine.policy.format) is QuantizedBlocksFormat
            cache[name, batch] = prompts, engine.last_stats["token_ids_sha256"]
            engine.close()
        return cache[name, batch]

    return get


@pytest.mark.parametrize("batch", [1, 16])
@pytest.mark.parametrize("name", ["w4a16", "w8a16"])
@pytest.mark.parametrize("policy", ["ondemand", "caching", "specmoe", "host"])
def test_every_policy_gives_residents_tokens(quantized, resident_tokens, tmp_path, policy, name, batch):
    """The same tokens from experts fetched into slots (re-encoded there on the reader
    thread) and, under `host`, from experts the host tier computes from their blobs."""
    prompts, sha = resident_tokens(name, batch)
    engine = llm(quantized(name), policy=policy, offload="host" if policy == "host" else "disk", device_memory="60%",
                 offload_dir=str(tmp_path), max_batch_size=batch)
    engine.generate(prompts, GREEDY)
    stats, pool = engine.last_stats, engine.engine.policy.pool
    assert stats["token_ids_sha256"] == sha
    assert pool.expert_bytes == Checkpoint(quantized(name)).config.expert_quant.nbytes
    if policy == "host":
        assert stats["host_expert_tokens"] > 0
    else:  # the tiers move the checkpoint's blob; the slot holds the blocks
        assert stats["transfer_bytes"] == pool.expert_bytes * stats["experts_fetched"] > 0
    assert all(pool.format.holds_blocks(pool.buffers[slot]) for slot in pool.table.slot_of.values())
    engine.close()


def test_info_names_the_block_encoding_and_the_bytes_held(quantized):
    """`specmoe info`: how the experts are computed, and their bytes in the pool and as moved."""
    path = quantized("w4a16")
    config = Checkpoint(path).config
    fmt = expert_format(config, torch.float32, "cpu", as_stored=True)
    n = len(config.moe_layer_ids) * config.num_experts
    info = model_info(str(path), device="cpu")
    experts = info["weights_compute"]["experts"]
    assert experts.startswith("int4: as stored, re-encoded exactly as Q4_0 blocks in their slots"), experts
    assert experts.endswith(f"; {format_bytes(fmt.slot_bytes * n)} held in their slots, "
                            f"{format_bytes(fmt.nbytes * n)} stored and moved"), experts
    assert info["fused_kernels"]["experts int4 experts"].startswith("as stored")
    reference = model_info(str(path), device="cpu", dtype="float32")["weights_compute"]["experts"]
    assert reference.startswith("int4: dequantized per call;"), reference


# --- GPT-OSS's MXFP4 experts ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def gpt_oss_mxfp4(tiny_ckpt, tmp_path_factory):
    """A tiny GPT-OSS checkpoint with its experts in MXFP4, as the released ones hold them."""
    import shutil

    from factories import to_mxfp4

    out = tmp_path_factory.mktemp("mxfp4") / "ckpt"
    shutil.copytree(tiny_ckpt("gpt_oss", "fused", intermediate_size=INTER), out)
    return to_mxfp4(out)


def test_mxfp4_experts_are_mxfp4_blocks_holding_the_checkpoints_values_bit_for_bit(gpt_oss_mxfp4):
    """Each block: the exponent byte as stored, the e2m1 codes in ggml's nibble order; the
    blocks' values are the blob's dequantized ones (the reference mode's, which is
    transformers' own dequantization: tests/test_quantized_checkpoints.py)."""
    from specmoe.experts.formats import dequantize

    ckpt = Checkpoint(gpt_oss_mxfp4)
    q, layer = ckpt.config.expert_quant, ckpt.config.moe_layer_ids[-1]
    fmt = expert_format(ckpt.config, torch.float32, "cpu", as_stored=True)
    assert isinstance(fmt, QuantizedBlocksFormat) and set(fmt.types.values()) == {"MXFP4"}
    assert fmt.nbytes == q.nbytes and not fmt.one_call  # biases, GPT-OSS's clamped activation
    assert "MXFP4 blocks in their slots (an expert with an exponent that is not a number" in fmt.kernels["mxfp4 experts"]
    slot, plain = torch.empty(fmt.slot_numel, dtype=fmt.slot_dtype), fmt.dequantizing
    for e in (0, ckpt.config.num_experts - 1):
        stored = fmt.read(ckpt, layer, e)
        fmt.prepare(stored, slot)
        assert fmt.holds_blocks(slot)
        for name, m in (("w_in", q.w_in), ("w_out", q.w_out)):
            want = dequantize(plain.section(stored, f"{name}.codes"), plain.section(stored, f"{name}.scales"), m,
                              torch.float32)
            got = PackedMatrix.of(fmt.section(slot, name), "MXFP4", m.rows, m.cols).dequantize()
            assert torch.equal(got, want), name


def test_an_mxfp4_exponent_that_is_not_a_number_keeps_the_experts_blob():
    spec = ExpertSpec(32, 32)
    w_in, w_out = MatrixQuant(64, 32, "fp4", 1, 32, "e8m0"), MatrixQuant(32, 32, "fp4", 1, 32, "e8m0")
    quant = ExpertQuant("mxfp4", "mxfp4", w_in, w_out)
    gen = torch.Generator().manual_seed(2)
    parts = [(torch.randint(0, 16, (m.rows, m.cols), generator=gen, dtype=torch.uint8),
              torch.randint(120, 127, m.scale_shape, generator=gen, dtype=torch.uint8)) for m in (w_in, w_out)]
    plain = QuantizedFormat(spec, quant)
    fmt = QuantizedBlocksFormat(spec, quant, plain)
    slot = torch.empty(fmt.slot_numel, dtype=torch.uint8)
    fmt.prepare(pack_blob(quant, *parts), slot)
    assert fmt.holds_blocks(slot)
    parts[1][1][3, 0] = 255
    blob = pack_blob(quant, *parts)
    fmt.prepare(blob, slot)
    assert not fmt.holds_blocks(slot)
    x = torch.randn(2, 32, generator=gen)
    got, want = fmt.forward(slot, x), plain.forward(blob, x)
    assert want.isnan().any() and torch.allclose(got, want, rtol=0, atol=0, equal_nan=True)  # as the reference


def test_mxfp4_log_probabilities_are_the_reference_modes_within_the_activations_rounding(gpt_oss_mxfp4):
    prompts = random_prompts(6, VOCAB, 3, 24, seed=8)
    exact = llm(gpt_oss_mxfp4, dtype="float32")
    want = [torch.as_tensor(w) for w in exact.score(prompts)]
    assert type(exact.engine.policy.format) is QuantizedFormat
    exact.close()
    stored = llm(gpt_oss_mxfp4)
    assert type(stored.engine.policy.format) is QuantizedBlocksFormat
    diffs = torch.cat([(torch.as_tensor(g) - w).abs().amax(-1) for g, w in zip(stored.score(prompts), want)])
    assert diffs.median() <= MEDIAN_TOL, diffs
    assert (diffs > POSITION_TOL).float().mean() <= FLIPPED_SHARE, diffs
    assert diffs.max() > 0  # the blocks, with 8-bit activations, not the reference mode again
    stored.close()


@pytest.mark.parametrize("batch", [1, 16])
@pytest.mark.parametrize("policy", ["ondemand", "specmoe", "host"])
def test_every_policy_gives_residents_tokens_on_mxfp4_experts(gpt_oss_mxfp4, tmp_path, policy, batch):
    prompts = random_prompts(16, VOCAB, 3, 18, seed=5)
    resident = llm(gpt_oss_mxfp4, max_batch_size=batch)
    resident.generate(prompts, GREEDY)
    sha = resident.last_stats["token_ids_sha256"]
    resident.close()
    engine = llm(gpt_oss_mxfp4, policy=policy, offload="host" if policy == "host" else "disk", device_memory="60%",
                 offload_dir=str(tmp_path), max_batch_size=batch)
    engine.generate(prompts, GREEDY)
    assert engine.last_stats["token_ids_sha256"] == sha
    pool = engine.engine.policy.pool
    assert all(pool.format.holds_blocks(pool.buffers[slot]) for slot in pool.table.slot_of.values())
    engine.close()


# --- the same tokens at every batch shape -------------------------------------------------------

SHORT = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def sixty_four(quantized, gpt_oss_mxfp4):
    """sixty_four(name) -> (checkpoint, 64 prompts, resident's token_ids_sha256 decoding them 64 at a time)."""
    cache = {}

    def get(name):
        if name not in cache:
            path = gpt_oss_mxfp4 if name == "mxfp4" else quantized(name)
            prompts = random_prompts(64, VOCAB, 3, 66, seed=12)
            engine = llm(path, max_batch_size=64, max_model_len=96)
            engine.generate(prompts, SHORT)
            assert type(engine.engine.policy.format) is QuantizedBlocksFormat
            cache[name] = path, prompts, engine.last_stats["token_ids_sha256"]
            engine.close()
        return cache[name]

    return get


@pytest.mark.parametrize("batch", [1, 16, 64])
@pytest.mark.parametrize("name", ["w4a16", "w8a16", "mxfp4"])
@pytest.mark.parametrize("policy", ["ondemand", "specmoe"])
def test_every_batch_size_gives_the_tokens_resident_gives_sixty_four_at_a_time(sixty_four, tmp_path, policy, name,
                                                                                batch):
    """Speculation's promise in the blocks' encoding: a sequence's tokens do not depend on
    how many sequences (B) or verified rows (B x (gamma + 1)) share its calls."""
    path, prompts, sha = sixty_four(name)
    engine = llm(path, policy=policy, offload="disk", device_memory="60%", offload_dir=str(tmp_path),
                 max_batch_size=batch, max_model_len=96)
    engine.generate(prompts, SHORT)
    stats = engine.last_stats
    assert stats["token_ids_sha256"] == sha
    if policy == "specmoe":
        assert stats["draft_s"] > 0  # it drafted, so some verify passes computed more rows than B
    engine.close()
