"""GLM-4.5, Llama 4 and Phi-3.5-MoE in gguf_convert: the metadata and extra tensors
llama.cpp's converter writes for `glm4moe`, `llama4` and `phimoe` (Glm4MoeModel,
Llama4Model, PhiMoeModel in convert_hf_to_gguf.py), and a clear error for a checkpoint
whose model such a file cannot say: what llama.cpp fixes in code (Llama 4's chunk size,
NoPE layers and attention temperature; GLM-4.5's ungrouped router) must be what the
checkpoint has, or the file would hold a different model.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch

from ..base.errors import SpecMoEError
from ..base.gguf_arch_families import LLAMA4_CHUNK, LLAMA4_NOPE_STEP, LLAMA4_TEMPERATURE
from ..model.rope import frequencies


def check(c, arch: str) -> None:
    if arch == "glm4moe" and c.router.num_groups > 1:
        raise SpecMoEError(f"glm4moe GGUF has no expert groups (llama.cpp routes GLM-4.5 over all experts); "
                           f"this checkpoint has n_group={c.router.num_groups}")
    if arch == "llama4":
        _check_llama4(c)


def _check_llama4(c) -> None:
    layers = range(c.num_layers)
    rope = tuple((i + 1) % LLAMA4_NOPE_STEP != 0 for i in layers)
    windows = tuple((LLAMA4_CHUNK if r else None) for r in rope)
    step = c.moe_layer_ids[0] + 1
    have = {"NoPE layers": c.rope_layers, "chunked attention": tuple(w.size if w else None for w in c.windows),
            "attention temperature": c.attention.temperature,
            "q/k L2 norm": c.attention.qk_norm, "MoE layers": c.moe_layers}
    want = {"NoPE layers": rope, "chunked attention": windows, "attention temperature": LLAMA4_TEMPERATURE,
            "q/k L2 norm": "none" if c.num_experts == 128 else "l2",
            "MoE layers": tuple((i + 1) % step == 0 for i in layers)}
    for what in have:
        if _plain(have[what]) != _plain(want[what]):
            raise SpecMoEError(f"llama4 GGUF: llama.cpp fixes the {what} ({want[what]}); this checkpoint has "
                               f"{have[what]}, which the file cannot say")


def _plain(v):
    return tuple(v) if isinstance(v, (tuple, list)) else v


def metadata(writer, c, arch: str) -> None:
    import gguf

    if arch == "glm4moe":
        writer.add_expert_shared_count(c.shared_expert_intermediate_size // c.expert.inter)
        writer.add_leading_dense_block_count(c.moe_layer_ids[0])
        writer.add_expert_weights_scale(c.router.scaling)
        writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    elif arch == "llama4":
        writer.add_interleave_moe_layer_step(c.moe_layer_ids[0] + 1)
    elif arch == "phimoe":
        window = next((w.size for w in c.windows if w is not None), 0)
        writer.add_sliding_window(window)  # 0: none
        if c.rope.kind == "longrope":
            original = c.rope.original_max_positions
            writer.add_rope_scaling_orig_ctx_len(original)
            scale = c.max_position_embeddings / original
            # llama.cpp's own cos/sin scale from the context lengths (not the config's mscales)
            writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original))
                                                 if scale > 1 else 1.0)


def extra_tensors(c, arch: str):
    """(GGUF name, float tensor) of what llama.cpp adds outside the layers: RoPE factors."""
    if arch == "llama4" and c.rope.kind == "llama3":  # each frequency's divisor
        base, _ = frequencies(replace(c.rope, kind="default"), "cpu")
        scaled, _ = frequencies(c.rope, "cpu")
        yield "rope_freqs.weight", (base / scaled).float()
    elif arch == "llama4" and c.rope.kind != "default":
        raise SpecMoEError(f"llama4 GGUF keeps llama3 RoPE scaling (rope_freqs); this checkpoint has {c.rope.kind!r}")
    if arch == "phimoe" and c.rope.kind == "longrope":
        yield "rope_factors_long.weight", torch.tensor(c.rope.long_factor, dtype=torch.float32)
        yield "rope_factors_short.weight", torch.tensor(c.rope.short_factor, dtype=torch.float32)
