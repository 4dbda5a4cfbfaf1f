"""Checkpoints whose experts are quantized, as people download them: block-scaled FP8
(DeepSeek-V3 style), MXFP4 (GPT-OSS) and compressed-tensors (llm-compressor's W4A16 /
W8A16 / FP8, also written by `specmoe quantize`).

The reference is transformers loading each checkpoint with its own dequantization on the
CPU (compressed-tensors through the compressed-tensors library). specmoe keeps the
experts quantized in the offload tier, in transfers and in the pool, and dequantizes in
the expert kernel: the logits must still be transformers', every policy must give the
resident quantized model's tokens, and what moves must be the quantized bytes."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch

pytest.importorskip("transformers")
from factories import require_compressed_tensors  # noqa: E402

require_compressed_tensors()  # a skip only where the quant extra cannot install it

from factories import (  # noqa: E402
    BOOKKEEPING_ALLOWANCE,
    VOCAB,
    device_bytes_held,
    hf_greedy,
    hf_logits,
    random_prompts,
    read_config,
    to_compressed_tensors,
    to_compressed_tensors_with,
    to_fp8,
    to_mxfp4,
)

from specmoe import LLM, SamplingParams  # noqa: E402
from specmoe.base.checkpoint import Checkpoint  # noqa: E402
from specmoe.costmodel.shapes import shape_of  # noqa: E402
from specmoe.experts.formats import FloatFormat, QuantizedFormat  # noqa: E402
from specmoe.model.moe import run_expert  # noqa: E402
from specmoe.tools.info import model_info  # noqa: E402

ATOL = 1e-3
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
INT4 = dict(num_bits=4, type="int", symmetric=True, strategy="group", group_size=8)


def _mxfp4(tiny_ckpt, out):
    shutil.copytree(tiny_ckpt("gpt_oss", "fused", intermediate_size=32), out)
    return to_mxfp4(out)


# Each format as a factory of (tiny_ckpt, out_dir) -> checkpoint dir, and the scheme specmoe reads.
FORMATS = {
    "mixtral-w4a16": (lambda t, out: to_compressed_tensors(t("mixtral"), out, "w4a16"), "int4"),
    "mixtral-w8a16": (lambda t, out: to_compressed_tensors(t("mixtral"), out, "w8a16"), "int8"),
    "mixtral-fp8-per-row": (lambda t, out: to_compressed_tensors(t("mixtral"), out, "fp8"), "fp8"),
    "qwen3-int8-per-row": (lambda t, out: to_compressed_tensors_with(
        t("qwen3_moe"), out, "pack-quantized", num_bits=8, type="int", symmetric=True, strategy="channel"), "int8"),
    "mixtral-fp8-per-matrix": (lambda t, out: to_compressed_tensors_with(
        t("mixtral"), out, "float-quantized", num_bits=8, type="float", symmetric=True, strategy="tensor"), "fp8"),
    "gpt_oss-mxfp4": (_mxfp4, "mxfp4"),
    "deepseek_v3-fp8": (lambda t, out: to_fp8(t("deepseek_v3"), out, block=4)[0], "fp8"),
}


@pytest.fixture(scope="module")
def quantized(tiny_ckpt, tmp_path_factory):
    """quantized(name) -> the checkpoint of FORMATS[name], built once per module."""
    built = {}

    def get(name):
        if name not in built:
            built[name] = FORMATS[name][0](tiny_ckpt, tmp_path_factory.mktemp(name) / "ckpt")
        return built[name]

    return get


@pytest.mark.parametrize("name", list(FORMATS))
def test_logits_and_greedy_tokens_are_transformers(quantized, name):
    path = quantized(name)
    prompts = random_prompts(3, VOCAB, 3, 24, seed=8)
    want = [torch.log_softmax(w, dim=-1) for w in hf_logits(path, prompts)]
    llm = LLM(model=str(path), device="cpu", dtype="float32", max_model_len=64)
    for got, w in zip(llm.score(prompts), want):
        assert (got - w).abs().max() <= ATOL
    out = llm.generate([prompts[0]], GREEDY)[0]
    assert out.token_ids == hf_greedy(path, prompts[0], GREEDY.max_tokens)
    llm.close()


@pytest.mark.parametrize("name", list(FORMATS))
def test_the_experts_stay_in_the_checkpoints_quantized_form(quantized, name):
    """The tiers hold each expert as its blob: what the checkpoint stores for it (codes and
    scales, read from the safetensors headers), plus section alignment, never the float size."""
    path = quantized(name)
    ckpt = Checkpoint(path)
    quant = ckpt.config.expert_quant
    assert quant is not None and quant.scheme == FORMATS[name][1]
    stored = _stored_expert_bytes(path, ckpt)
    assert stored <= quant.nbytes <= stored + 16 * 6
    assert quant.nbytes < ckpt.config.expert_params * 2  # below the bf16 expert


def _stored_expert_bytes(path, ckpt) -> int:
    """Bytes the files hold for expert 0 of the first MoE layer (GPT-OSS: its share of the
    layer's fused MXFP4 tensors and biases), from the tensors' shapes and dtypes."""
    from safetensors import safe_open

    layer, total = ckpt.config.moe_layer_ids[0], 0
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                if f"layers.{layer}." not in name or ".experts." not in name or name.endswith("weight_shape"):
                    continue
                t = f.get_slice(name)
                size = torch.Size(t.get_shape()).numel() * torch.tensor([], dtype=_DTYPES[t.get_dtype()]).element_size()
                if ".experts.0." in name:
                    total += size
                elif not re.search(r"\.experts\.\d+\.", name):  # fused: one expert's share
                    total += size // ckpt.config.num_experts
    return total


_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "U8": torch.uint8, "I32": torch.int32,
           "I8": torch.int8, "F8_E4M3": torch.float8_e4m3fn, "I64": torch.int64}


@pytest.fixture(scope="module")
def w4a16_reference(quantized):
    path = quantized("mixtral-w4a16")
    prompts = random_prompts(6, VOCAB, 3, 16, seed=3)
    ref = LLM(model=str(path), device="cpu", max_batch_size=6, max_model_len=64)
    ref.generate(prompts, GREEDY)
    sha = ref.last_stats["token_ids_sha256"]
    ref.close()
    return path, prompts, sha


@pytest.mark.parametrize(("policy", "extra"), [
    ("ondemand", {}), ("overlap", {}), ("caching", {}), ("host", {"offload": "host"}),
    ("specmoe", {"draft_quant": "none"}), ("specmoe", {}), ("specmoe", {"offload": "host"}),
], ids=["ondemand", "overlap", "caching", "host", "specmoe-paper-draft", "specmoe-auto-draft", "specmoe-host-tier"])
def test_every_policy_gives_the_resident_quantized_models_tokens(w4a16_reference, tmp_path, policy, extra):
    path, prompts, sha = w4a16_reference
    llm = LLM(model=str(path), device="cpu", policy=policy, device_memory="70%", offload_dir=str(tmp_path),
              max_batch_size=6, max_model_len=64, **{"offload": "disk", **extra})
    llm.generate(prompts, GREEDY)
    stats = llm.last_stats
    assert stats["token_ids_sha256"] == sha
    assert policy == "host" or stats["transfer_bytes"] > 0
    llm.close()


def test_an_int4_draft_copy_of_a_w8a16_model_gives_its_tokens(quantized, tmp_path):
    """SpecMoE's quantized draft on top of quantized experts: the int4 copies draft, the
    int8 experts verify, and the output is the w8a16 model's."""
    path = quantized("mixtral-w8a16")
    prompts = random_prompts(4, VOCAB, 3, 16, seed=4)
    ref = LLM(model=str(path), device="cpu", max_batch_size=4, max_model_len=64)
    ref.generate(prompts, GREEDY)
    llm = LLM(model=str(path), device="cpu", policy="specmoe", draft_quant="int4", device_memory="75%",
              offload_dir=str(tmp_path), max_batch_size=4, max_model_len=64)  # 70 %: a few bytes short of 2 slots
    llm.generate(prompts, GREEDY)
    assert llm.last_stats["draft_quant"] == "int4" and llm.last_stats["acceptance_rate"] > 0
    assert llm.last_stats["token_ids_sha256"] == ref.last_stats["token_ids_sha256"]
    ref.close()
    llm.close()


def test_auto_draft_takes_no_copy_as_wide_as_the_experts(quantized, tmp_path):
    """An int8 copy of int8 experts would cost what the experts cost: auto takes int4
    copies of every expert without a budget, and the draft planned under one holds none."""
    kw = dict(model=str(quantized("mixtral-w8a16")), device="cpu", policy="specmoe", offload_dir=str(tmp_path),
              max_batch_size=2, max_model_len=32)
    llm = LLM(**kw)
    assert llm.engine.policy.draft_quant == "int4"
    llm.close()
    llm = LLM(device_memory="90%", **kw)
    assert llm.engine.policy.memory is not None and "int8" not in llm.engine.policy.memory.options.ways()
    assert "int4" in llm.engine.policy.memory.options.ways()
    llm.close()


def test_a_fetch_moves_one_quantized_blob(w4a16_reference, tmp_path):
    """transfer_bytes per fetched expert is the blob's size, and so is what the reader
    really copies into each pool slot (watched at the store)."""
    path, prompts, _ = w4a16_reference
    llm = LLM(model=str(path), device="cpu", policy="ondemand", device_memory="70%", offload_dir=str(tmp_path),
              max_batch_size=6, max_model_len=64)
    store = llm.engine.policy.store
    copied, original = [], store.read_into
    store.read_into = lambda key, dest: (copied.append(dest.numel() * dest.element_size()), original(key, dest))[1]
    llm.generate(prompts, GREEDY)
    stats = llm.last_stats
    blob = Checkpoint(path).config.expert_quant.nbytes
    assert stats["experts_fetched"] == len(copied) > 0
    assert set(copied) == {blob}
    assert stats["transfer_bytes"] == blob * stats["experts_fetched"]
    llm.close()


def test_the_same_budget_holds_proportionally_more_quantized_experts(tiny_ckpt, quantized, tmp_path):
    """One --device-memory for the float and the int4 checkpoint: the pool takes what is
    left after weights, KV and (for int4) one dequantization scratch, in slots of each
    format's expert size; the engine's device tensors, walked from outside its ledger,
    stay inside the budget (plus the routing bookkeeping the ledger does not charge)."""
    float_path, int4_path = tiny_ckpt("mixtral"), quantized("mixtral-w4a16")
    probe = LLM(model=str(float_path), device="cpu", max_batch_size=2, max_model_len=32)
    e = probe.engine
    float_bytes = e.policy.runtime.expert_bytes
    budget = e.model.weights.nbytes + e.cache.bytes_per_token() * 2 * 32 + 4 * float_bytes
    probe.close()
    slots = {}
    for name, path in (("float", float_path), ("int4", int4_path)):
        llm = LLM(model=str(path), device="cpu", policy="caching", device_memory=budget, offload_dir=str(tmp_path),
                  max_batch_size=2, max_model_len=32)  # caching takes every slot that fits
        runtime = llm.engine.policy.runtime
        scratch = runtime.expert_format.scratch_bytes(runtime.dtype)
        free = budget - llm.engine.model.weights.nbytes - llm.engine.cache.bytes_per_token() * 2 * 32 - scratch
        slots[name] = llm.engine.policy.pool.num_slots
        assert slots[name] == min(len(runtime.expert_keys), free // runtime.expert_bytes)
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, temperature=0.0))
        assert device_bytes_held(llm.engine) <= budget + BOOKKEEPING_ALLOWANCE
        llm.close()
    assert slots["float"] == 4 and slots["int4"] > 3 * slots["float"]


def test_the_expert_file_header_records_the_quantization(w4a16_reference, tmp_path):
    path, _, _ = w4a16_reference
    llm = LLM(model=str(path), device="cpu", policy="ondemand", offload="disk", device_memory="70%",
              offload_dir=str(tmp_path), max_batch_size=1, max_model_len=32)
    store = llm.engine.policy.store
    with open(store.path, "rb") as f:
        f.seek(8)
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    assert header["quantization"]["scheme"] == "int4" and header["expert_bytes"] == store.nbytes
    assert store.nbytes == Checkpoint(path).config.expert_quant.nbytes
    llm.close()


def test_info_and_the_cost_model_count_the_quantized_bytes(quantized):
    path = quantized("mixtral-w4a16")
    ckpt = Checkpoint(path)
    blob = ckpt.config.expert_quant.nbytes
    info = model_info(str(path), device_memory="1MiB", device="cpu")
    assert info["expert_bytes"] == blob and info["expert_bytes_total"] == blob * 16
    assert info["expert_format"].startswith("int4 (compressed-tensors; groups of 8")
    assert shape_of(ckpt.config, "tiny").expert_bytes == blob


# Formats transformers cannot load for MoE experts (it folds FP8 expert scales without
# expanding blocks): checked against the checkpoint's own dequantized experts instead,
# which for compressed-tensors come from the library's decompression.
BLOB_CASES = {
    "deepseek_v3-fp8-block4": lambda t, out: to_fp8(t("deepseek_v3"), out, block=4)[0],
    # blocks of 16 rows straddle gate and up (I = 24): w_in keeps one scale row per row
    "deepseek_v3-fp8-block16": lambda t, out: to_fp8(t("deepseek_v3", moe_intermediate_size=24), out, block=16)[0],
    "mixtral-ct-fp8-blocks": lambda t, out: to_compressed_tensors_with(
        t("mixtral"), out, "float-quantized", num_bits=8, type="float", symmetric=True, strategy="block",
        block_structure=[8, 8]),
}


@pytest.mark.parametrize("case", list(BLOB_CASES))
def test_an_expert_computed_from_its_blob_equals_its_dequantized_weights(tiny_ckpt, tmp_path, case):
    ckpt = Checkpoint(BLOB_CASES[case](tiny_ckpt, tmp_path / "q"))
    fmt = QuantizedFormat(ckpt.config.expert, ckpt.config.expert_quant)
    x = torch.randn(5, ckpt.config.hidden_size)
    layer = ckpt.config.moe_layer_ids[0]
    for e in (0, 4):
        want = run_expert(ckpt.expert_buffer(layer, e, torch.float32), x, ckpt.config.expert)
        assert torch.allclose(fmt.forward(fmt.read(ckpt, layer, e), x), want, atol=1e-6, rtol=1e-6)
    assert FloatFormat(ckpt.config.expert, torch.float32).nbytes > 3 * fmt.nbytes


# --- bad checkpoints -------------------------------------------------------------------------


@pytest.mark.parametrize(("change", "message"), [
    ({"symmetric": False}, "scheme has asymmetric weights (zero points), which specmoe does not read"),
    ({"actorder": "group"}, "scheme has activation-ordered groups"),
    ({"num_bits": 2}, "scheme has 2-bit int weights"),
])
def test_an_unsupported_compressed_tensors_scheme_is_one_clear_error(quantized, tmp_path, change, message):
    path = tmp_path / "bad"
    shutil.copytree(quantized("mixtral-w4a16"), path)
    cfg = read_config(path)
    cfg["quantization_config"]["config_groups"]["group_0"]["weights"].update(change)
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(Exception, match=re.escape(message)) as info:
        Checkpoint(path)
    assert type(info.value).__name__ == "SpecMoEError"


def test_an_unknown_quant_method_names_what_is_read(tiny_ckpt, tmp_path):
    path = tmp_path / "awq"
    shutil.copytree(tiny_ckpt("mixtral"), path)
    (path / "config.json").write_text(json.dumps({**read_config(path), "quantization_config": {"quant_method": "awq"}}))
    with pytest.raises(Exception, match="quant_method 'awq' is not supported; specmoe reads fp8"):
        Checkpoint(path)


def test_experts_a_compressed_tensors_config_targets_but_the_files_hold_in_float_are_float(tiny_ckpt, tmp_path):
    """A config whose scheme targets every Linear while the files hold plain float weights
    (a model saved before compression): nothing is quantized, the experts move as floats."""
    path = tmp_path / "float-files"
    shutil.copytree(tiny_ckpt("mixtral"), path)
    scheme = {"targets": ["Linear"], "weights": {**INT4}, "format": "pack-quantized"}
    cfg = {**read_config(path), "quantization_config": {"quant_method": "compressed-tensors", "format": "pack-quantized",
                                                         "config_groups": {"group_0": scheme}}}
    (path / "config.json").write_text(json.dumps(cfg))
    assert Checkpoint(path).config.expert_quant is None
    prompts = random_prompts(2, VOCAB, 3, 12, seed=1)
    for got, want in zip(LLM(model=str(path), device="cpu").score(prompts),
                         LLM(model=str(tiny_ckpt("mixtral")), device="cpu").score(prompts)):
        assert torch.equal(got, want)


def test_bfloat16_int4_experts_go_through_the_fused_kernel_and_compute_the_dequantized_expert():
    """On the CPU in bfloat16, int4 matrices with bfloat16 scales enter their slot in the
    layout of torch's fused int4 kernel and multiply without a dequantized copy; the result
    is the expert computed in float32 from the dequantized weights, to bfloat16's precision."""
    from specmoe.base.quantization import ExpertQuant, MatrixQuant
    from specmoe.base.quantized_tensors import pack_blob
    from specmoe.base.specs import ExpertSpec
    from specmoe.experts.formats import dequantize
    from specmoe.model.moe import expert_forward

    spec = ExpertSpec(64, 32)
    w_in, w_out = (MatrixQuant(r, c, "int4", 1, 32, "bfloat16") for r, c in ((64, 64), (64, 32)))
    quant = ExpertQuant("int4", "compressed-tensors", w_in, w_out)
    gen = torch.Generator().manual_seed(0)
    parts = [(torch.randint(-8, 8, (m.rows, m.cols), generator=gen, dtype=torch.int8),
              (torch.rand(m.scale_shape, generator=gen) * 0.02).to(torch.bfloat16)) for m in (w_in, w_out)]
    blob = pack_blob(quant, *parts)
    plain, kernel = QuantizedFormat(spec, quant, "cpu", torch.float32), QuantizedFormat(spec, quant, "cpu", torch.bfloat16)
    assert kernel.converts and not plain.converts and kernel.scratch_bytes(torch.bfloat16) == 0
    slot = torch.empty(kernel.slot_numel, dtype=kernel.slot_dtype)
    kernel.prepare(blob, slot)
    x = torch.randn(5, 64, generator=gen)
    dense = [dequantize(plain.section(blob, f"{n}.codes"), plain.section(blob, f"{n}.scales"), m, torch.float32)
             for n, m in (("w_in", w_in), ("w_out", w_out))]
    want = expert_forward(spec, x, lambda t: t @ dense[0].t(), lambda t: t @ dense[1].t())
    assert torch.allclose(plain.forward(blob, x), want, atol=1e-5, rtol=1e-5)
    assert torch.allclose(kernel.forward(slot, x.bfloat16()).float(), want, atol=2e-2 * want.abs().max(), rtol=0)


def test_bfloat16_int4_slots_hold_the_kernel_layout_and_offloading_gives_residents_tokens(tiny_ckpt, tmp_path):
    """A bfloat16 checkpoint quantized to w4a16 (bfloat16 scales), run in bfloat16 on the
    CPU: experts are converted for the fused kernel as they enter their slot (on the
    transfer thread), fetches still move the blob, and offloading gives resident's tokens."""
    from factories import to_bfloat16

    src = to_bfloat16(tiny_ckpt("mixtral", intermediate_size=64), tmp_path / "bf16")
    path = to_compressed_tensors(src, tmp_path / "w4", "w4a16", group_size=32)
    prompts = random_prompts(4, VOCAB, 3, 16, seed=5)
    shape = dict(model=str(path), device="cpu", dtype="bfloat16", max_batch_size=4, max_model_len=48)
    ref = LLM(**shape)
    ref.generate(prompts, GREEDY)
    assert ref.engine.policy.format.converts
    for policy in ("ondemand", "caching"):
        llm = LLM(**shape, policy=policy, device_memory="50%", offload_dir=str(tmp_path))
        llm.generate(prompts, GREEDY)
        stats, pool = llm.last_stats, llm.engine.policy.pool
        assert pool.format.converts and pool.slot_bytes > pool.expert_bytes == Checkpoint(path).config.expert_quant.nbytes
        assert stats["transfer_bytes"] == pool.expert_bytes * stats["experts_fetched"] > 0
        assert stats["token_ids_sha256"] == ref.last_stats["token_ids_sha256"]
        llm.close()
    ref.close()
