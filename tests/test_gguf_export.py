"""The GGUF copy the llama.cpp anchor runs: every tensor of the checkpoint where llama.cpp
looks for it, RoPE rows permuted so that llama.cpp's rotation gives the same q.k, and,
where llama-cpp-python is installed, llama.cpp's greedy tokens against resident's."""

from __future__ import annotations

import shutil

import pytest
import torch

gguf = pytest.importorskip("gguf")

from factories import make_checkpoint  # noqa: E402

from specmoe.base.checkpoint import Checkpoint  # noqa: E402
from specmoe.base.errors import SpecMoEError  # noqa: E402
from specmoe.base.paths import default_model_dir  # noqa: E402
from specmoe.model.moe import expert_views  # noqa: E402
from specmoe.model.rope import Rotation  # noqa: E402
from specmoe.tools.gguf_export import cached_gguf, rope_to_interleaved, write_gguf  # noqa: E402


@pytest.fixture(scope="module")
def tiny_mixtral(tmp_path_factory):
    path = make_checkpoint("mixtral", tmp_path_factory.mktemp("mixtral"), layout="fused")
    shutil.copy(default_model_dir() / "tokenizer.json", path / "tokenizer.json")  # ids past the vocabulary are dropped
    return Checkpoint(path)


def test_the_gguf_copy_holds_every_tensor_where_llama_cpp_reads_it(tiny_mixtral, tmp_path):
    ckpt, c = tiny_mixtral, tiny_mixtral.config
    write_gguf(ckpt, tmp_path / "m.gguf")
    reader = gguf.GGUFReader(str(tmp_path / "m.gguf"))
    tensors = {t.name: torch.from_numpy(t.data.copy()) for t in reader.tensors}
    per_block = {"attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm", "ffn_gate_inp",
                 "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"}
    assert set(tensors) == {"token_embd.weight", "output_norm.weight", "output.weight"} | {
        f"blk.{i}.{n}.weight" for i in range(c.num_layers) for n in per_block}
    I = c.expert.inter
    views = [expert_views(ckpt.expert_buffer(1, e, torch.float32), c.expert) for e in range(c.num_experts)]
    assert torch.equal(tensors["blk.1.ffn_up_exps.weight"], torch.stack([v.w_in[I:] for v in views]))
    assert torch.equal(tensors["blk.1.ffn_down_exps.weight"], torch.stack([v.w_out for v in views]))
    assert torch.equal(tensors["blk.1.ffn_gate_inp.weight"], ckpt.get("router", (c.num_experts, c.hidden_size), 1))
    fields = {f.name: f for f in reader.fields.values()}
    assert int(fields["llama.expert_used_count"].parts[-1][0]) == c.router.top_k
    assert len(fields["tokenizer.ggml.tokens"].data) == c.vocab_size


def test_the_bf16_copy_holds_the_same_weights_in_half_the_bytes(tiny_mixtral, tmp_path):
    """Matrices in bfloat16 (the float32 copy's rounded: a bfloat16 checkpoint's exactly), norms
    in float32, as llama.cpp's converter writes a BF16 file."""
    f32, bf16 = (write_gguf(tiny_mixtral, tmp_path / f"{e}.gguf", e) or gguf.GGUFReader(str(tmp_path / f"{e}.gguf"))
                 for e in ("f32", "bf16"))
    wide = {t.name: t for t in f32.tensors}
    types = set()
    for t in bf16.tensors:
        types.add((len(t.shape) >= 2 and t.shape[1] > 1, t.tensor_type.name))
        want = torch.from_numpy(wide[t.name].data.copy())
        if t.tensor_type == gguf.GGMLQuantizationType.BF16:
            got = torch.from_numpy(t.data.copy()).view(torch.bfloat16).float().reshape(want.shape)
            want = want.to(torch.bfloat16).float()
        else:
            got = torch.from_numpy(t.data.copy())
        assert torch.equal(got, want), t.name
    assert {name for _, name in types} == {"BF16", "F32"}


def test_an_unknown_export_encoding_is_a_clear_error(tiny_mixtral, tmp_path):
    with pytest.raises(SpecMoEError, match="encoding 'q4' is not one of: f32, bf16"):
        write_gguf(tiny_mixtral, tmp_path / "m.gguf", "q4")


@pytest.mark.parametrize("heads", [1, 3])
def test_permuted_rope_rows_keep_every_q_dot_k(heads):
    """llama.cpp rotates pairs (2i, 2i + 1); the checkpoint's rows are laid out for pairs
    (i, i + d/2). With the rows permuted, q.k at every pair of positions is unchanged."""
    d, D, T = 8, 12, 5
    gen = torch.Generator().manual_seed(heads)
    wq, wk, x = torch.randn(heads * d, D, generator=gen), torch.randn(heads * d, D, generator=gen), torch.randn(T, D, generator=gen)
    angles = torch.arange(T, dtype=torch.float32)[:, None] * torch.rand(d // 2, generator=gen)

    def dots(q_rows, k_rows, style):
        rot = Rotation.of(angles.cos(), angles.sin(), style)
        q, k = (rot.apply((x @ w.T).view(T, heads, d)) for w in (q_rows, k_rows))
        return torch.einsum("thd,shd->hts", q, k)

    want = dots(wq, wk, "half")
    got = dots(rope_to_interleaved(wq, heads), rope_to_interleaved(wk, heads), "interleaved")
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(dots(wq, wk, "interleaved"), want, atol=1e-3)  # without the permutation, it differs


def test_a_family_llama_cpp_cannot_run_as_converted_is_a_clear_error(tmp_path):
    ckpt = Checkpoint(make_checkpoint("qwen2_moe", tmp_path / "q"))
    with pytest.raises(SpecMoEError, match="Qwen2MoeForCausalLM to GGUF is not supported"):
        cached_gguf(ckpt, tmp_path / "cache")
    assert not (tmp_path / "cache").exists()  # nothing half-written is left to be taken for a copy


def test_llama_cpp_on_the_copy_decodes_the_demo_model_as_resident_does(tmp_path):
    """Where llama-cpp-python is built (make anchors): its greedy tokens on the GGUF copy
    are resident's, up to a near tie its kernels break the other way."""
    pytest.importorskip("llama_cpp")
    from specmoe import LLM, SamplingParams
    from specmoe.bench.anchors import LlamaCppRunner

    prompts = [[345, 88, 1020, 77, 9], [12, 600, 31]]
    record, theirs = LlamaCppRunner(default_model_dir(), prompts, 1, 16, 1, tmp_path).run()
    ours = [o.token_ids for o in LLM().generate(prompts, SamplingParams(max_tokens=16, temperature=0.0,
                                                                       ignore_eos=True))]
    agree = sum(a == b for t, o in zip(theirs, ours) for a, b in zip(t, o)) / sum(map(len, ours))
    assert [t[0] for t in theirs] == [o[0] for o in ours] and agree >= 0.9, (theirs, ours)
    assert record["decode_tokens_per_s"] > 0


def test_llama_cpp_batched_decodes_each_sequence_as_it_does_alone(tmp_path):
    """Its batch API at B = 3 (three sequences of different lengths in one KV cache) gives
    each sequence the tokens it gets decoded alone: no sequence reads another's cache."""
    pytest.importorskip("llama_cpp")
    from specmoe.bench.anchors import LlamaCppRunner

    prompts = [[345, 88, 1020, 77, 9], [12, 600, 31], [7, 7, 900, 41, 2000, 15, 3]]
    alone = LlamaCppRunner(default_model_dir(), prompts, 1, 12, 1, tmp_path).run()[1]
    record, together = LlamaCppRunner(default_model_dir(), prompts, 3, 12, 1, tmp_path).run()
    agree = sum(a == b for t, o in zip(together, alone) for a, b in zip(t, o)) / sum(map(len, alone))
    assert len(together) == 3 and all(len(t) == 12 for t in together)
    assert agree >= 0.9 and [t[0] for t in together] == [o[0] for o in alone], (together, alone)
    assert record["batch_size"] == 3
