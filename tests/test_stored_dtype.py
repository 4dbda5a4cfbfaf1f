"""Float experts of a bfloat16 checkpoint computed in float32 (the CPU's compute dtype)
stay bfloat16 in the offload tiers: half the bytes on disk, read and moved, and in the pool
slots too, where the block kernels multiply them as stored (each weight widened exactly in
registers; --dtype float32 widens them when they enter a slot instead). Either way every
policy computes the float32 products of the same values: the same tokens as a float32
checkpoint holding them."""

import resource

import pytest
import torch
from factories import build_model, random_prompts

from specmoe import LLM, SamplingParams
from specmoe.experts.formats import stored_dtype

PARAMS = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
PROMPTS = random_prompts(2, min_len=4, max_len=10, seed=5)
# 32 x 64 experts: 24 KiB in float32, 12 KiB in bfloat16, both whole 4 KiB blocks, so the
# file's and the reads' sizes halve exactly
SHAPE = dict(intermediate_size=64)
EXPERT_PARAMS = 3 * 32 * 64  # gate, up and down of hidden 32 (factories) x 64
ALLOWANCE = 64 << 10
# What one major page fault may have read beside the page (the kernel's default readahead,
# read_ahead_kb): a code page of a shared library touched for the first time, or evicted
# and faulted in again, is storage read by this process that no expert fetch asked for.
FAULT_READ = 128 << 10


@pytest.fixture(scope="module")
def twins(tmp_path_factory):
    """(layout) -> (bfloat16 checkpoint, float32 checkpoint of the same bfloat16-exact values),
    both written by transformers."""
    made = {}

    def get(layout: str):
        if layout not in made:
            out = tmp_path_factory.mktemp(f"twins-{layout}")
            model = build_model("mixtral", seed=2, **SHAPE).to(torch.bfloat16)
            kwargs = dict(safe_serialization=True, save_original_format=(layout == "per_expert"))
            model.save_pretrained(out / "bf16", **kwargs)
            model.to(torch.float32).save_pretrained(out / "f32", **kwargs)
            made[layout] = (out / "bf16", out / "f32")
        return made[layout]
    return get


def read_bytes() -> int:
    """Bytes this process has had read from storage (the kernel's count, /proc/self/io)."""
    for line in open("/proc/self/io"):
        if line.startswith("read_bytes:"):
            return int(line.split()[1])
    raise AssertionError("no read_bytes in /proc/self/io")


def major_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_majflt


def run(path, directory, **options):
    """(tokens, (bytes read from storage while generating, what its major page faults may
    have read of them), stats, policy), of a second generate call: the first one imports
    modules lazily and loads the kernel library, which with a cold page cache (a fresh CI
    machine) reads megabytes that no expert fetch asked for."""
    llm = LLM(model=str(path), device="cpu", offload_dir=str(directory), max_batch_size=2, max_model_len=32, **options)
    try:
        first = [out.token_ids for out in llm.generate(PROMPTS, PARAMS)]
        before, faults = read_bytes(), major_faults()
        tokens = [out.token_ids for out in llm.generate(PROMPTS, PARAMS)]
        read = read_bytes() - before, (major_faults() - faults) * FAULT_READ
        assert tokens == first
        return tokens, read, llm.last_stats, llm.engine.policy
    finally:
        llm.close()


@pytest.mark.parametrize("layout", ["per_expert", "fused"])
def test_the_disk_tier_holds_and_reads_bfloat16_experts_and_gives_the_float32_twins_tokens(twins, direct_io_dir,
                                                                                           layout):
    bf16, f32 = twins(layout)
    got = {}
    for name, path in (("bf16", bf16), ("f32", f32)):
        got[name] = run(path, direct_io_dir / name, policy="ondemand", offload="disk", device_memory="30%")
        assert got[name][2]["offload_direct"], got[name][2]["offload_direct_reason"]  # conftest checked the dir
    (tokens, disk_read, stats, policy), (tokens32, disk_read32, stats32, policy32) = got["bf16"], got["f32"]
    assert tokens == tokens32
    assert stats["experts_fetched"] == stats32["experts_fetched"] > 0
    # each fetch is one direct read of its blob, as the kernel counts it: an expert is
    # 3 x 32 x 64 parameters, 2 or 4 bytes each, whole 4 KiB blocks; nothing else is
    # read from the disk while generating (ALLOWANCE: a module imported lazily, at most;
    # beside what major page faults may have read)
    fetched = stats["experts_fetched"]
    for (read, faulted), nbytes in ((disk_read, 2), (disk_read32, 4)):
        assert fetched * EXPERT_PARAMS * nbytes <= read <= fetched * EXPERT_PARAMS * nbytes + ALLOWANCE + faulted
    sizes = {name: sum(f.stat().st_size for f in (direct_io_dir / name).glob("experts-*.bin")) for name in got}
    assert sizes["bf16"] == pytest.approx(sizes["f32"] / 2, rel=0.05)
    assert policy.store.dtype == torch.bfloat16 and policy32.store.dtype == torch.float32
    assert policy.pool.buffers.dtype == torch.bfloat16  # multiplied as stored: half a float32 slot
    reference = run(bf16, direct_io_dir / "bf16-reference", policy="ondemand", offload="disk", device_memory="30%",
                    dtype="float32")
    assert reference[0] == tokens and reference[3].pool.buffers.dtype == torch.float32  # widened in its slot


@pytest.mark.parametrize("options", [
    dict(policy="resident"),
    dict(policy="ondemand", offload="host"),
    dict(policy="caching", device_memory="30%"),
    dict(policy="specmoe", device_memory="60%", draft_quant="none"),
    dict(policy="specmoe", device_memory="60%", offload="host", draft_compute="host", draft_quant="none"),
], ids=["resident", "ondemand-host", "caching-disk", "specmoe", "specmoe-host-draft"])
def test_every_policy_on_a_bfloat16_checkpoint_gives_the_float32_twins_tokens(twins, tmp_path, options):
    bf16, f32 = twins("per_expert")
    want, *_ = run(f32, tmp_path / "f32", policy="resident")
    tokens, _, _, policy = run(bf16, tmp_path / "bf16", **options)
    assert tokens == want
    assert policy.runtime.expert_format.storage_dtype == torch.bfloat16


def test_the_tiers_keep_a_narrower_float_only_where_widening_it_is_exact():
    bf16, f16, f32 = torch.bfloat16, torch.float16, torch.float32
    assert stored_dtype(bf16, f32) == bf16 and stored_dtype(f16, f32) == f16
    assert stored_dtype(f32, f32) == f32 and stored_dtype(None, f32) == f32  # None: the experts' tensors differ
    assert stored_dtype(bf16, bf16) == bf16 and stored_dtype(f32, bf16) == bf16  # computed in bfloat16: stored so
    assert stored_dtype(bf16, f16) == f16  # bfloat16 -> float16 loses range: the compute dtype
