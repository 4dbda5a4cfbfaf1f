"""A GGUF model offloaded and speculated like any checkpoint: every policy gives the
resident GGUF model's tokens, the tiers hold and move each expert's bytes as the file
encodes them, and the quantized draft copies work on top."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("gguf")
pytest.importorskip("transformers")

from factories import random_prompts  # noqa: E402
from gguf_factories import make_gguf, reference_logprobs, reference_model  # noqa: E402

from specmoe import LLM, SamplingParams  # noqa: E402
from specmoe.base.gguf_checkpoint import GGUFCheckpoint  # noqa: E402
from specmoe.base.gguf_file import GGUFFile  # noqa: E402
from specmoe.base.gguf_layout import HEADER  # noqa: E402

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
SHAPE = dict(device="cpu", max_batch_size=4, max_model_len=48)
MODELS = [("mixtral", "Q4_0"), ("qwen3_moe", "Q8_0"), ("deepseek_v3", "Q4_0"), ("gpt_oss", "MXFP4"),
          ("glm4_moe", "Q4_0"), ("llama4", "Q8_0"), ("phimoe", "Q4_0"), ("qwen3_moe", "BF16")]
POLICIES = [
    ("ondemand", {}), ("overlap", {}), ("caching", {}), ("host", {"offload": "host"}),
    # int4 copies (of 4-bit experts too, as big as they are here): room for them and every expert
    ("specmoe", {"draft_quant": "none"}), ("specmoe", {"draft_quant": "int4", "device_memory": "4MiB"}),
]


@pytest.fixture(scope="module")
def resident(tmp_path_factory):
    """Per model: (GGUF path, prompts, the resident model's token_ids_sha256)."""
    cache = {}

    def get(family, type_name):
        if (family, type_name) not in cache:
            _, path = make_gguf(tmp_path_factory.mktemp(family), family, type_name)
            prompts = random_prompts(4, min_len=3, max_len=14, seed=5)
            llm = LLM(model=str(path), **SHAPE)
            llm.generate(prompts, GREEDY)
            cache[family, type_name] = path, prompts, llm.last_stats["token_ids_sha256"]
            llm.close()
        return cache[family, type_name]

    return get


@pytest.mark.parametrize(("family", "type_name"), MODELS, ids=[f"{f}-{t}" for f, t in MODELS])
@pytest.mark.parametrize(("policy", "extra"), POLICIES,
                         ids=["ondemand", "overlap", "caching", "host", "specmoe-paper-draft", "specmoe-int4-draft"])
def test_every_policy_gives_the_resident_gguf_models_tokens(resident, tmp_path, family, type_name, policy, extra):
    path, prompts, sha = resident(family, type_name)
    llm = LLM(model=str(path), policy=policy, offload_dir=str(tmp_path),
              **{**SHAPE, "offload": "disk", "device_memory": "60%", **extra})
    llm.generate(prompts, GREEDY)
    stats = llm.last_stats
    assert stats["token_ids_sha256"] == sha
    assert policy == "host" or stats["transfer_bytes"] > 0
    if extra.get("draft_quant") == "int4":
        assert stats["draft_quant"] == "int4" and stats["acceptance_rate"] > 0
    llm.close()


def test_on_a_gguf_file_the_draft_copies_run_on_the_engines_block_kernels(resident, tmp_path):
    """The engine multiplies a GGUF file's weights on the block kernels, torch on one thread:
    the int4 copies go to the block kernels too, as Q4_0 rows, and the tokens stay resident's."""
    from specmoe.experts.quant import BlockMatrix

    path, prompts, sha = resident("mixtral", "Q4_0")
    llm = LLM(model=str(path), policy="specmoe", offload_dir=str(tmp_path), draft_quant="int4",
              **{**SHAPE, "offload": "disk", "device_memory": "4MiB"})
    llm.generate(prompts, GREEDY)
    stats = llm.last_stats
    assert stats["token_ids_sha256"] == sha
    drafts = {k: v for k, v in stats["fused_kernels"].items() if k.startswith("draft")}
    assert drafts and all(v.startswith("blockdot") for v in drafts.values()), drafts
    first = llm.engine.policy.quantized.expert(llm.config.moe_layer_ids[0], 0)
    assert isinstance(first.gate_up, BlockMatrix) and isinstance(first.down, BlockMatrix)
    llm.close()


@pytest.mark.parametrize(("family", "type_name"), [("mixtral", "Q4_0"), ("qwen3_moe", "BF16")])
def test_info_plans_the_budget_the_engine_takes_on_a_gguf_file(resident, tmp_path, family, type_name):
    """`specmoe info --device-memory 60%`: the non-expert bytes (the file's encodings where
    kept) and the budget the engine then takes, byte for byte (info counted float32 once)."""
    from specmoe.tools.info import model_info

    path, _, _ = resident(family, type_name)
    info = model_info(str(path), device_memory="60%", batch_size=SHAPE["max_batch_size"],
                      max_model_len=SHAPE["max_model_len"], device="cpu")
    llm = LLM(model=str(path), policy="ondemand", offload_dir=str(tmp_path), **{**SHAPE, "device_memory": "60%"})
    budget = llm.engine.budget
    assert (info["non_expert_bytes"], info["device_memory"]) == (budget.by_item["non-expert weights"], budget.limit)
    llm.close()


@pytest.mark.parametrize(("family", "type_name"), [("mixtral", "Q4_0"), ("qwen3_moe", "BF16")])
def test_info_plans_the_memory_limit_budget_the_engine_takes_on_a_gguf_file(resident, tmp_path, monkeypatch,
                                                                           family, type_name):
    """`specmoe info --memory-limit 1GiB`: the same split of the limit, and so the same
    budget, as the engine's, byte for byte, given the same measured fixed cost."""
    from specmoe.tools.info import model_info

    monkeypatch.setattr("specmoe.engine.host_memory.resident_bytes", lambda: 200 << 20)
    path, _, _ = resident(family, type_name)
    info = model_info(str(path), memory_limit="1GiB", batch_size=SHAPE["max_batch_size"],
                      max_model_len=SHAPE["max_model_len"], device="cpu", policy="ondemand")
    llm = LLM(model=str(path), policy="ondemand", offload_dir=str(tmp_path), memory_limit="1GiB", **SHAPE)
    assert info["memory_limit_plan"] == llm.engine.memory_plan.as_dict()
    assert info["device_memory"] == llm.engine.budget.limit
    llm.close()


def _expert_bytes_in_file(path, layer: int = 0) -> int:
    """One expert's slices of the block's three stacked tensors, as the file stores them."""
    f = GGUFFile(path)
    return sum(f.info(f"blk.{layer}.{p}.weight").nbytes // f.info(f"blk.{layer}.{p}.weight").shape[0]
               for p in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"))


def test_a_fetch_moves_the_experts_bytes_as_the_file_stores_them(resident, tmp_path):
    """A slot and a fetch are the expert's stored bytes (and a 16-byte header, section
    alignment): what the reader copies into each slot, and what transfer_bytes counts."""
    path, prompts, _ = resident("mixtral", "Q4_0")
    llm = LLM(model=str(path), policy="ondemand", device_memory="60%", offload_dir=str(tmp_path), **SHAPE)
    store = llm.engine.policy.store
    copied, original = [], store.read_into
    store.read_into = lambda key, dest: (copied.append(dest.numel() * dest.element_size()), original(key, dest))[1]
    llm.generate(prompts, GREEDY)
    stats = llm.last_stats
    stored = _expert_bytes_in_file(path)
    blob = llm.engine.config.expert_quant.nbytes
    assert stored <= blob <= stored + HEADER + 3 * 16  # the header and the sections' alignment, nothing else
    assert blob < 0.2 * 4 * 3 * 32 * 64  # Q4_0: about an eighth of the float32 expert
    assert stats["experts_fetched"] == len(copied) > 0 and set(copied) == {blob}
    assert stats["transfer_bytes"] == blob * stats["experts_fetched"]
    assert llm.engine.policy.pool.slot_bytes == blob
    llm.close()


def test_blocks_in_different_encodings_read_and_offload_exactly(tmp_path):
    """Q4_K_M keeps some blocks' down projections wider: a file whose blocks differ gives
    every policy the resident model's tokens, each blob read by the encodings its header names."""
    hf, path = make_gguf(tmp_path, "mixtral", "Q4_0", down_types={0: "Q8_0", 1: "Q5_1"})
    prompts = random_prompts(3, min_len=3, max_len=12, seed=6)
    exact = LLM(model=str(path), dtype="float32", **SHAPE)  # the reference encoding
    quant = exact.engine.config.expert_quant
    assert quant.uniform is None and quant.scheme == "Q4_0/Q8_0/Q5_1"
    want = reference_logprobs(reference_model("mixtral", str(hf), str(path)), prompts)
    for got, w in zip(exact.score(prompts), want):
        assert (torch.as_tensor(got) - w).abs().max() <= 1e-4
    exact.close()
    ref = LLM(model=str(path), **SHAPE)  # the default: the blocks multiplied as stored
    ref.generate(prompts, GREEDY)
    for policy in ("ondemand", "specmoe"):
        llm = LLM(model=str(path), policy=policy, device_memory="60%", offload_dir=str(tmp_path), **SHAPE)
        llm.generate(prompts, GREEDY)
        assert llm.last_stats["token_ids_sha256"] == ref.last_stats["token_ids_sha256"]
        llm.close()
    ref.close()


IN_PLACE = [("gpt_oss", "MXFP4", {}), ("qwen3_moe", "BF16", {}), ("mixtral", "Q4_0", {"down_types": {0: "Q8_0"}}),
            ("mixtral", "Q8_0", {"split_max_tensors": 10})]


@pytest.mark.parametrize(("family", "type_name", "kw"), IN_PLACE, ids=["biases", "bf16", "mixed", "shards"])
def test_the_disk_tier_reads_each_expert_from_the_gguf_file_itself(tmp_path, family, type_name, kw):
    """No copy of the experts is written: every read, from the file (or its shards) with the
    page cache bypassed, gives the blob the checkpoint's own reader assembles, biases, a
    block in another encoding and a tensor split over two files included."""
    _, path = make_gguf(tmp_path, family, type_name, **kw)
    path = min(tmp_path.glob(f"{path.stem}*.gguf"))  # a split file: its first shard
    offload = tmp_path / "offload"
    llm = LLM(model=str(path), policy="ondemand", offload="disk", device_memory="60%", offload_dir=str(offload),
              **SHAPE)
    store, ckpt = llm.engine.policy.store, GGUFCheckpoint(path)  # its own reader: buffered, whole slices
    assert store.tier == "disk" and set(store.files) <= set(GGUFFile(path).paths)
    assert (len(store.files) > 1) == ("split_max_tensors" in kw)
    dest = torch.empty(store.numel, dtype=torch.uint8)
    for key in store.keys:
        store.read_into(key, dest.fill_(0xAB))
        want = ckpt.expert_blob(*key)
        assert torch.equal(dest[:want.numel()], want) and not dest[want.numel():].any(), key
    llm.generate(random_prompts(2, max_len=8), GREEDY)
    assert llm.last_stats["transfer_bytes"] > 0
    assert not list(offload.glob("experts-*")) if offload.exists() else True
    llm.close()


def test_auto_drafts_with_copies_narrower_than_the_experts_as_stored(resident, tmp_path):
    """--draft-quant auto compares with the bits per weight the file stores, scales
    included: int4 copies under Q4_0's 4.5 bits, int8 under Q8_0's 8.5 (both then run
    through torch's fused kernels instead of dequantizing every draft step)."""
    for family, type_name, want in (("mixtral", "Q4_0", "int4"), ("qwen3_moe", "Q8_0", "int8")):
        path, _, _ = resident(family, type_name)
        llm = LLM(model=str(path), policy="specmoe", offload_dir=str(tmp_path), **SHAPE)  # no budget: every expert
        assert llm.engine.policy.draft_quant == want
        llm.close()
        # under a budget the planned draft may hold copies as wide as that, never wider
        llm = LLM(model=str(path), policy="specmoe", device_memory="4MiB", offload_dir=str(tmp_path), **SHAPE)
        ways = llm.engine.policy.memory.options.ways()
        wider = {"int4": {"int8"}, "int8": set()}[want]
        assert want in ways and not wider & set(ways)
        llm.close()


def test_under_a_memory_limit_auto_drafts_without_copies_that_save_no_bytes(resident, tmp_path):
    """An int4 copy of Q4_0 experts holds as many bytes, and its first build is not bounded by
    --memory-limit: under a limit the paper's draft; a Q8_0 file's int4 copies save half."""
    for family, type_name, want in (("mixtral", "Q4_0", "none"), ("qwen3_moe", "Q8_0", "auto")):
        path, _, _ = resident(family, type_name)
        llm = LLM(model=str(path), policy="specmoe", memory_limit="2GiB", offload_dir=str(tmp_path), **SHAPE)
        assert llm.engine.options.draft_quant == want
        llm.close()
