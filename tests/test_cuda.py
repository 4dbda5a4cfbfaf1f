"""The CUDA path: pinned host experts, copies on the transfer engine's side stream, every
policy's greedy output equal to resident's on the GPU, a draft that moves nothing, and the
replay at a (scaled) Mixtral shape. Skipped without CUDA; run by scripts/gpu_check.sh."""

import gc
import json
from types import SimpleNamespace

import pytest
import torch
from factories import (
    BOOKKEEPING_ALLOWANCE,
    CUDA_PEAK,
    assert_policy_run_is_exact,
    cuda_activation_allowance,
    cuda_requested_bytes,
    expert_share_budget,
    pass_tokens,
    random_prompts,
    watch_device_bytes,
    watch_draft_reads,
)

from specmoe import LLM, SamplingParams
from specmoe.base.checkpoint import Checkpoint
from specmoe.base.specs import ExpertSpec
from specmoe.base.trace import read_trace
from specmoe.experts.budget import DeviceBudget
from specmoe.experts.formats import FloatFormat
from specmoe.experts.pool import DevicePool
from specmoe.experts.store import HostStore
from specmoe.experts.tiers import open_store
from specmoe.experts.transfer import TransferEngine

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

CUDA = torch.device("cuda")
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
POLICIES = ["ondemand", "overlap", "caching", "host", "specmoe"]


@pytest.fixture(autouse=True)
def _caches(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECMOE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("SPECMOE_CACHE_DIR", str(tmp_path / "cache"))


def expert_keys(ckpt):
    return [(layer, e) for layer in ckpt.config.moe_layer_ids for e in range(ckpt.config.num_experts)]


def test_host_store_is_pinned_on_cuda(tiny_ckpt):
    ckpt = Checkpoint(tiny_ckpt("mixtral"))
    keys = expert_keys(ckpt)
    store = open_store(ckpt, keys, FloatFormat(ckpt.config.expert, torch.float32), CUDA, "host")
    assert store.pinned and store.buffers.is_pinned()
    assert torch.equal(store.host_tensor(keys[3]), ckpt.expert_buffer(*keys[3], torch.float32))


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_side_stream_copies_bring_the_right_bytes(tiny_ckpt, tmp_path, tier):
    ckpt = Checkpoint(tiny_ckpt("mixtral"))
    keys = expert_keys(ckpt)
    fmt = FloatFormat(ckpt.config.expert, torch.float32)
    store = open_store(ckpt, keys, fmt, CUDA, tier, str(tmp_path))
    pool = DevicePool(4, fmt, CUDA, DeviceBudget(None), "test", 1)
    engine = TransferEngine(store, pool, CUDA)
    assert engine.stream is not None and engine.stream != torch.cuda.current_stream(CUDA)
    for key in keys[:7]:  # more experts than slots: later ones land in evicted slots
        engine.ensure(key)
        assert torch.equal(pool.slot_tensor(key).cpu(), ckpt.expert_buffer(*key, torch.float32)), key
    assert engine.transfer_bytes == 7 * store.nbytes
    engine.close()
    store.close()


class _ConstantExperts:
    """A checkpoint stand-in whose expert e is filled with the value e + 1."""

    def __init__(self, numel):
        self.config = SimpleNamespace(expert_params=numel)

    def expert_buffer(self, layer, expert, dtype):
        return torch.full((self.config.expert_params,), float(expert + 1), dtype=dtype)


def test_a_refetch_into_a_slot_waits_for_the_compute_still_reading_it():
    # The engine unpins an expert as soon as its kernels are *launched*; the slot may then
    # be refilled by the side stream while those kernels are still queued on the compute
    # stream. The copy must be ordered after them, or the compute reads the next expert.
    fmt = FloatFormat(ExpertSpec(1024, 512, activation="relu"), torch.float32)  # 1 << 20 elements
    numel = fmt.numel
    store = HostStore(_ConstantExperts(numel), [(0, 0), (0, 1)], fmt, pin=True)
    pool = DevicePool(1, fmt, CUDA, DeviceBudget(None), "test", 1)
    engine = TransferEngine(store, pool, CUDA)
    engine.ensure((0, 0))
    slot = pool.get((0, 0))
    torch.cuda._sleep(100_000_000)  # keep the compute stream busy (~50 ms) before the read below
    total = slot.sum()  # queued: reads expert 0 (all ones) once the sleep ends
    engine.ensure((0, 1))  # the single slot is reused for expert 1 (all twos)
    assert total.item() == float(numel), "the side-stream copy overwrote a slot that queued compute still reads"
    engine.close()


@pytest.fixture(scope="module")
def cuda_reference(tiny_ckpt):
    path = tiny_ckpt("mixtral")
    prompts = random_prompts(8, 128, 3, 10, seed=7)
    ref = LLM(model=str(path), device="cuda", max_batch_size=8, max_model_len=64)
    ref.generate(prompts, GREEDY)
    budget = expert_share_budget(ref, 0.5, 8, 64)
    sha = ref.last_stats["token_ids_sha256"]
    ref.close()
    return path, prompts, sha, budget


@pytest.mark.parametrize("policy", POLICIES)
def test_greedy_output_on_cuda_equals_resident(cuda_reference, tmp_path, policy):
    path, prompts, sha, budget = cuda_reference
    llm = LLM(model=str(path), device="cuda", policy=policy, offload="host", offload_dir=str(tmp_path),
              device_memory=budget, max_batch_size=8, max_model_len=64)
    held = watch_device_bytes(llm.engine)
    llm.generate(prompts, GREEDY)
    assert_policy_run_is_exact(llm.last_stats, sha, policy)
    assert held.excess(budget) <= BOOKKEEPING_ALLOWANCE
    llm.close()


@pytest.mark.parametrize("policy", ["resident", *POLICIES])
def test_cuda_allocations_stay_within_the_budget_plus_a_pass_of_activations(tiny_ckpt, tmp_path, policy):
    """The allocator's own peak of requested bytes over the run, not the ledger. Experts
    here are 1.5 MiB (intermediate 4096) and one pass's activations (the allowance, 0.73 MB
    for at most 10 tokens a pass) less than one of them, so one expert held beyond
    the budget shows (test_allowances.py checks that on any machine)."""
    s = CUDA_PEAK
    path = tiny_ckpt("mixtral", intermediate_size=s["intermediate_size"])
    prompts = random_prompts(s["prompts"], 128, s["min_len"], s["max_len"], seed=7)
    kw = dict(model=str(path), device="cuda", max_batch_size=s["batch"], max_model_len=s["max_model_len"])
    probe = LLM(**kw)
    e = probe.engine
    expert = e.policy.runtime.expert_bytes
    budget = int(e.budget.used - 0.5 * expert * len(e.policy.runtime.expert_keys))
    probe.close()
    del probe, e
    gc.collect()
    torch.ones(8, 8, device=CUDA) @ torch.ones(8, 8, device=CUDA)  # cuBLAS workspace exists before the baseline
    torch.cuda.synchronize()
    baseline = cuda_requested_bytes()
    torch.cuda.reset_peak_memory_stats()
    opts = {} if policy == "resident" else dict(policy=policy, offload="host", device_memory=budget)
    llm = LLM(**kw, **opts, **(dict(gamma=s["gamma"]) if policy == "specmoe" else {}))
    llm.generate(prompts, GREEDY)
    torch.cuda.synchronize()
    peak = cuda_requested_bytes("peak") - baseline
    limit = llm.engine.budget.limit or llm.engine.budget.used
    allowance = cuda_activation_allowance(llm.config, pass_tokens(prompts, s["batch"], s["gamma"]), s["max_model_len"],
                                          grouped=policy == "resident")
    assert allowance < expert == 3 * llm.config.hidden_size * s["intermediate_size"] * 4
    assert peak <= limit + allowance, (peak, limit, allowance)
    llm.close()


def test_specmoe_draft_moves_no_bytes_on_cuda(cuda_reference, tmp_path):
    path, prompts, _, budget = cuda_reference
    trace = tmp_path / "spec.jsonl"
    llm = LLM(model=str(path), device="cuda", policy="specmoe", offload="host", offload_dir=str(tmp_path),
              device_memory=budget, max_batch_size=8, max_model_len=64, trace=str(trace))
    reads = watch_draft_reads(llm.engine)
    llm.generate(prompts, GREEDY)
    assert reads == []
    llm.close()
    _, records = read_trace(trace)
    assert any(r.kind == "draft" for r in records)
    assert sum(r.transfer_bytes for r in records if r.kind == "verify") > 0


def test_replay_runs_on_cuda_with_pinned_experts(cuda_reference, tmp_path, capsys):
    from specmoe.cli import main

    path, prompts, _, _ = cuda_reference
    trace = tmp_path / "spec.jsonl"
    llm = LLM(model=str(path), device="cuda", policy="specmoe", offload="host", offload_dir=str(tmp_path),
              max_batch_size=4, max_model_len=64, trace=str(trace))
    llm.generate(prompts[:4], GREEDY)
    llm.close()
    rc = main(["replay", "--trace", str(trace), "--model-shape", "mixtral-8x7b", "--scale", "0.125", "--layers", "1",
               "--max-steps", "2", "--device", "cuda", "--json"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    doc = json.loads(out)
    assert doc["config"]["device"].startswith("cuda") and doc["config"]["pinned"]
    assert {r["policy"] for r in doc["records"]} == {"ondemand", "overlap", "caching", "specmoe"}
    assert all("error" not in r and r["layer_s"] > 0 for r in doc["records"])
    assert next(r for r in doc["records"] if r["policy"] == "specmoe")["draft_transfer_bytes"] == 0


def test_logprobs_on_cuda_equal_the_cpu_ones(cuda_reference, tmp_path):
    """Scoring and generation log-probabilities computed on the GPU (SpecMoE's verification
    rows, offloaded experts) equal the CPU's resident ones."""
    path, prompts, _, budget = cuda_reference
    params = SamplingParams(max_tokens=8, ignore_eos=True, logprobs=3, prompt_logprobs=3)
    values = {}
    for device, extra in (("cpu", {}), ("cuda", dict(policy="specmoe", offload="host", device_memory=budget))):
        llm = LLM(model=str(path), device=device, dtype="float32", max_batch_size=8, max_model_len=64, **extra)
        outs = llm.generate(prompts, params)
        values[device] = [p.logprob for o in outs for p in o.prompt_logprobs[1:] + o.logprobs]
        llm.close()
    assert values["cuda"] == pytest.approx(values["cpu"], abs=1e-3)  # GPU and CPU kernels round differently


@pytest.mark.parametrize("family", ["deepseek_v3", "glm4_moe", "gpt_oss", "llama4", "phimoe"])
def test_large_families_on_cuda_give_residents_tokens_under_every_policy(tiny_ckpt, tmp_path, family):
    """MLA's latent cache, windowed rings, sinks, input-scaled routing, LayerNorm: the same
    code on the GPU, every offloading policy against resident there."""
    path = str(tiny_ckpt(family))
    prompts = random_prompts(4, 128, 3, 20, seed=7)
    shape = dict(device="cuda", max_batch_size=4, max_model_len=64)
    ref = LLM(model=path, **shape)
    ref.generate(prompts, GREEDY)
    sha, budget = ref.last_stats["token_ids_sha256"], expert_share_budget(ref, 0.5, 4, 64)
    ref.close()
    for policy in POLICIES:
        llm = LLM(model=path, policy=policy, offload="host", offload_dir=str(tmp_path), device_memory=budget, **shape)
        llm.generate(prompts, GREEDY)
        assert_policy_run_is_exact(llm.last_stats, sha, policy)
        llm.close()


@pytest.fixture(scope="module")
def cuda_w4a16(tiny_ckpt, tmp_path_factory):
    """The tiny Mixtral quantized by `specmoe quantize` (int4 experts, groups of 8)."""
    pytest.importorskip("compressed_tensors")
    from factories import to_compressed_tensors

    return to_compressed_tensors(tiny_ckpt("mixtral", intermediate_size=256), tmp_path_factory.mktemp("w4") / "q",
                                 "w4a16", group_size=8)


def test_quantized_experts_on_cuda_give_the_resident_quantized_models_tokens(cuda_w4a16, tmp_path):
    """The blob moves to the GPU's pool and is dequantized there: every policy's tokens
    are the resident (quantized) model's on the GPU, and what moves is the blob."""
    prompts = random_prompts(4, 128, 3, 12, seed=7)
    shape = dict(model=str(cuda_w4a16), device="cuda", max_batch_size=4, max_model_len=32)
    ref = LLM(**shape)
    ref.generate(prompts, GREEDY)
    sha, budget = ref.last_stats["token_ids_sha256"], expert_share_budget(ref, 0.5, 4, 32)
    blob = ref.engine.policy.runtime.expert_bytes
    ref.close()
    assert blob == Checkpoint(cuda_w4a16).config.expert_quant.nbytes
    for policy in POLICIES:
        llm = LLM(**shape, policy=policy, offload="host", offload_dir=str(tmp_path), device_memory=budget)
        llm.generate(prompts, GREEDY)
        stats = llm.last_stats
        assert_policy_run_is_exact(stats, sha, policy)
        assert stats["transfer_bytes"] == blob * stats["experts_fetched"]
        llm.close()


def test_a_quantized_expert_computes_on_cuda_what_it_computes_on_the_cpu(cuda_w4a16):
    from specmoe.experts.formats import QuantizedFormat

    ckpt = Checkpoint(cuda_w4a16)
    fmt = QuantizedFormat(ckpt.config.expert, ckpt.config.expert_quant)
    blob, x = fmt.read(ckpt, 0, 3), torch.randn(6, ckpt.config.hidden_size)
    for dtype in (torch.float32, torch.bfloat16):
        cpu = fmt.forward(blob, x.to(dtype)).float()
        gpu = fmt.forward(blob.to(CUDA), x.to(dtype).to(CUDA)).float().cpu()
        assert torch.allclose(gpu, cpu, rtol=2e-2 if dtype == torch.bfloat16 else 1e-5, atol=1e-3), dtype


def test_quantized_experts_stay_within_the_cuda_budget_with_their_scratch(tiny_ckpt, tmp_path):
    """The dequantized matrix of the running expert is reserved in the ledger: the
    allocator's peak of requested bytes stays within the budget plus one pass of
    activations, which is less than that scratch (its gate/up matrix in float32, 1 MiB),
    so a scratch the ledger left out shows."""
    pytest.importorskip("compressed_tensors")
    from factories import to_compressed_tensors

    s = CUDA_PEAK
    path = to_compressed_tensors(tiny_ckpt("mixtral", intermediate_size=s["intermediate_size"]), tmp_path / "q",
                                 "w4a16", group_size=8)
    prompts = random_prompts(s["prompts"], 128, s["min_len"], s["max_len"], seed=7)
    kw = dict(model=str(path), device="cuda", max_batch_size=s["batch"], max_model_len=s["max_model_len"])
    probe = LLM(**kw)
    budget = expert_share_budget(probe, 0.5, s["batch"], s["max_model_len"])
    probe.close()
    gc.collect()
    torch.cuda.synchronize()
    baseline = cuda_requested_bytes()
    torch.cuda.reset_peak_memory_stats()
    llm = LLM(**kw, policy="ondemand", offload="host", offload_dir=str(tmp_path), device_memory=budget)
    llm.generate(prompts, GREEDY)
    torch.cuda.synchronize()
    peak = cuda_requested_bytes("peak") - baseline
    allowance = cuda_activation_allowance(llm.config, pass_tokens(prompts, s["batch"], 0), s["max_model_len"])
    assert allowance < 2 * s["intermediate_size"] * llm.config.hidden_size * 4  # the scratch
    assert peak <= budget + allowance, (peak, budget, allowance)
    llm.close()


@pytest.mark.parametrize("way,share", [("auto", 0.2), ("int2", 0.1)])
def test_a_draft_memory_on_cuda_gives_residents_tokens_within_its_budget_as_copies_are_chosen_again(
        tiny_ckpt, tmp_path, way, share):
    """--draft-memory on the GPU (fused int8/int4 copies where the device has the kernels,
    int2 through its dequantization scratch): requests prefilled in turns, so the copies
    are chosen again after later prefills; resident's tokens, and the allocator's peak of
    requested bytes within the budget (draft memory included) plus one pass of activations."""
    s = CUDA_PEAK
    path = tiny_ckpt("mixtral", intermediate_size=s["intermediate_size"])
    prompts = random_prompts(6, 128, 3, 8, seed=11)
    kw = dict(model=str(path), device="cuda", max_batch_size=s["batch"], max_model_len=s["max_model_len"])
    ref = LLM(**kw)
    ref.generate(prompts, GREEDY)
    sha = ref.last_stats["token_ids_sha256"]
    budget = expert_share_budget(ref, 0.3, s["batch"], s["max_model_len"])
    draft = int(share * ref.engine.policy.runtime.expert_bytes * len(ref.engine.policy.runtime.expert_keys))
    ref.close()
    del ref
    gc.collect()
    torch.cuda.synchronize()
    baseline = cuda_requested_bytes()
    torch.cuda.reset_peak_memory_stats()
    llm = LLM(**kw, policy="specmoe", offload="host", offload_dir=str(tmp_path), device_memory=budget + draft,
              draft_memory=draft, draft_quant=way, gamma=s["gamma"])
    llm.generate(prompts, GREEDY)
    torch.cuda.synchronize()
    peak = cuda_requested_bytes("peak") - baseline
    stats = llm.last_stats
    assert stats["token_ids_sha256"] == sha
    assert stats["draft_reload_bytes"] > stats["draft_copies_bytes"]  # copies were read again after a later prefill
    allowance = cuda_activation_allowance(llm.config, pass_tokens(prompts, s["batch"], s["gamma"]), s["max_model_len"])
    assert peak <= budget + draft + allowance, (peak, budget + draft, allowance)
    llm.close()
