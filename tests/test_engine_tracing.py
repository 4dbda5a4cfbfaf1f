"""--trace: the engine writes one record per forward pass that the performance model reads."""

from factories import random_prompts

from specmoe import LLM, SamplingParams
from specmoe.base.trace import read_trace


def test_trace_records_every_pass_with_routing_and_acceptance(tiny_ckpt, tmp_path):
    path = tmp_path / "run.trace.jsonl"
    llm = LLM(model=str(tiny_ckpt("mixtral")), device="cpu", policy="specmoe", offload="host", gamma=3,
              max_batch_size=4, max_model_len=64, trace=str(path))
    llm.generate(random_prompts(4, 128, 3, 8, seed=5), SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True))
    llm.close()
    header, records = read_trace(path)
    assert header["config"]["policy"] == "specmoe" and header["model"]["num_experts"] == 8
    kinds = [r.kind for r in records]
    assert kinds[0] == "prefill" and "draft" in kinds and "verify" in kinds
    verify = [r for r in records if r.kind == "verify"]
    assert all(len(r.accepted_lengths) == r.batch_size for r in verify)
    assert sum(r.transfer_bytes for r in records) == llm.last_stats["transfer_bytes"]
    first = verify[0]
    assert {lr.layer for lr in first.layers} == {0, 1}
    assert sum(sum(lr.expert_tokens.values()) for lr in first.layers) == 2 * 2 * first.positions  # top-2, 2 blocks
    assert all(r.draft_set for r in verify)
