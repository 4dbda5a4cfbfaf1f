"""A bfloat16 checkpoint (safetensors, or a GGUF file of BF16 tensors) multiplied as
stored (the CPU's default, `--dtype auto`): its matrices and experts stay bfloat16 in
memory, half of what widening them to float32 held, and the block kernels multiply them
widened in registers: the float32 reference's products, so the log-probabilities are the
float32 reference's up to the order of additions, and a row's are the same bits alone or
in a batch. (Every policy on the BF16 GGUF file: test_gguf_policies.py.)"""

import pytest
import torch
from factories import build_model, hf_logits, random_prompts

from specmoe import LLM, SamplingParams
from specmoe.kernels import blockdot
from specmoe.kernels.packed import PackedMatrix

pytestmark = pytest.mark.skipif(not blockdot.available(), reason=f"block kernels unavailable: {blockdot.library().why}")

VOCAB = 128  # factories' tiny models
PROMPTS = random_prompts(4, VOCAB, min_len=3, max_len=24, seed=21)


@pytest.fixture(scope="module")
def bf16_ckpt(tmp_path_factory):
    """A tiny Mixtral and a Qwen3-MoE (per-head q/k norms), in bfloat16, written by transformers."""
    made = {}

    def get(family: str):
        if family not in made:
            out = tmp_path_factory.mktemp(f"bf16-{family}")
            build_model(family, seed=3, intermediate_size=64).to(torch.bfloat16).save_pretrained(out)
            made[family] = out
        return made[family]
    return get


def llm(path, **options) -> LLM:
    return LLM(model=str(path), device="cpu", max_batch_size=4, max_model_len=64, **options)


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_log_probabilities_are_transformers_float32_ones(bf16_ckpt, family):
    path = bf16_ckpt(family)
    engine = llm(path)
    assert engine.engine.as_stored and isinstance(engine.engine.model.weights.layers[0].qkv, PackedMatrix)
    got = engine.score(PROMPTS)
    for g, w in zip(got, hf_logits(path, PROMPTS)):
        assert (torch.as_tensor(g) - torch.log_softmax(w, dim=-1)).abs().max() < 1e-4
    engine.close()


def test_it_holds_half_the_bytes_of_the_float32_reference(bf16_ckpt):
    path = bf16_ckpt("mixtral")
    stored, reference = llm(path), llm(path, dtype="float32")
    held = {name: e.engine.budget.by_item for name, e in (("stored", stored), ("reference", reference))}
    assert held["stored"]["experts"] * 2 == held["reference"]["experts"]
    assert stored.engine.policy.experts[0].dtype == torch.bfloat16
    # the matrices at 2 bytes a weight; norms and routers stay float32 in both
    weights = stored.engine.model.weights
    packed = sum(t.numel() for t in weights.tensors() if t.dtype == torch.uint8)
    assert packed > 0.8 * weights.nbytes
    assert held["stored"]["non-expert weights"] + packed == held["reference"]["non-expert weights"]
    stored.close(), reference.close()


def test_a_share_of_the_experts_is_the_same_number_of_experts_as_in_float32(bf16_ckpt, tmp_path):
    """--device-memory 50 %: half the experts in the pool whether they are held as stored
    (bfloat16 slots) or widened to float32 (it once took the float32 bytes as the experts'
    and gave a bfloat16 pool every expert)."""
    path = bf16_ckpt("mixtral")
    options = dict(policy="ondemand", device_memory="50%", offload_dir=str(tmp_path))
    stored, reference = llm(path, **options), llm(path, dtype="float32", **options)
    total = len(stored.config.moe_layer_ids) * stored.config.num_experts
    for e in (stored, reference):
        budget, slot = e.engine.budget, e.engine.policy.pool.slot_bytes
        room = budget.limit - budget.by_item["non-expert weights"] - budget.by_item["KV cache"]
        assert room // slot == total // 2, (room / slot, total)  # experts' room: half of them
    assert stored.engine.policy.pool.slot_bytes * 2 == reference.engine.policy.pool.slot_bytes
    stored.close(), reference.close()


@pytest.mark.parametrize("policy", ["resident", "specmoe"])
def test_a_sequence_gets_the_same_bits_alone_and_in_a_batch(bf16_ckpt, tmp_path, policy):
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=3)
    options = dict(policy=policy, offload_dir=str(tmp_path)) | (dict(device_memory="60%") if policy != "resident" else {})
    engine = llm(bf16_ckpt("qwen3_moe"), **options)
    together = engine.generate(PROMPTS, params)
    for prompt, out in zip(PROMPTS, together):
        alone = engine.generate([prompt], params)[0]
        assert alone.token_ids == out.token_ids and alone.logprobs == out.logprobs  # floats compared exactly
    engine.close()


def test_a_bf16_gguf_file_is_multiplied_as_stored(tmp_path):
    pytest.importorskip("gguf")
    from gguf_factories import make_gguf

    _, path = make_gguf(tmp_path, "mixtral", "BF16")
    stored, reference = llm(path), llm(path, dtype="float32")
    assert stored.engine.model.weights.layers[0].qkv.encoding == "BF16"
    assert all(how.startswith("as stored") for how in stored.engine.policy.format.kernels.values())
    for g, w in zip(stored.score(PROMPTS), reference.score(PROMPTS)):
        assert (torch.as_tensor(g) - torch.as_tensor(w)).abs().max() < 1e-4
    stored.close(), reference.close()


@pytest.mark.parametrize("encoding", ["stored", "float32"])
def test_info_plans_the_budget_the_engine_takes(bf16_ckpt, tmp_path, encoding):
    """`specmoe info --device-memory 50%` on a bfloat16 checkpoint: the budget, the non-expert
    bytes and the expert bytes the engine then takes (info counted them at float32 once, 2x)."""
    from specmoe.tools.info import model_info

    path = bf16_ckpt("mixtral")
    dtype = "auto" if encoding == "stored" else "float32"
    info = model_info(str(path), device_memory="50%", dtype=dtype, batch_size=4, max_model_len=64, device="cpu")
    engine = llm(path, policy="ondemand", device_memory="50%", dtype=dtype, offload_dir=str(tmp_path))
    budget = engine.engine.budget
    assert info["non_expert_bytes"] == budget.by_item["non-expert weights"]
    assert info["device_memory"] == budget.limit
    assert info["expert_bytes"] == engine.engine.policy.pool.expert_bytes
    engine.close()


@pytest.mark.parametrize("encoding", ["stored", "float32"])
def test_info_plans_the_memory_limit_budget_the_engine_takes(bf16_ckpt, tmp_path, monkeypatch, encoding):
    """`specmoe info --memory-limit 1GiB`: the same split of the limit (a step's activations
    in the compute dtype, the tier's buffer for the expert as stored) and budget as the engine's."""
    from specmoe.tools.info import model_info

    monkeypatch.setattr("specmoe.engine.host_memory.resident_bytes", lambda: 200 << 20)
    path = bf16_ckpt("mixtral")
    dtype = "auto" if encoding == "stored" else "float32"
    info = model_info(str(path), memory_limit="1GiB", dtype=dtype, batch_size=4, max_model_len=64, device="cpu",
                      policy="ondemand")
    engine = llm(path, policy="ondemand", memory_limit="1GiB", dtype=dtype, offload_dir=str(tmp_path))
    assert info["memory_limit_plan"] == engine.engine.memory_plan.as_dict()
    assert info["device_memory"] == engine.engine.budget.limit
    engine.close()
