"""How far quantized draft copies are from the experts they copy: per MoE block, the
relative L2 error of the experts' outputs (what `specmoe info --draft-quant` reports)."""

from __future__ import annotations

from pathlib import Path

import torch

from ..base.checkpoint import Checkpoint
from ..model.moe import run_expert
from .quant import BITS, check_mode, draft_copy_bytes, group_size, quantized_expert_forward
from .quant_cache import load_quantized


@torch.no_grad()
def quant_error_report(ckpt: Checkpoint, mode: str, inputs: dict[int, torch.Tensor] | None = None,
                       num_tokens: int = 256, seed: int = 0, cache_dir: Path | None = None) -> list[dict]:
    """Per MoE block: relative L2 error ||y_q - y|| / ||y|| of the experts' outputs.

    `inputs`: layer -> x [T, D], the block's inputs (e.g. held-out tokens' post-norm
    hidden states); by default `num_tokens` standard-normal rows (RMS-normed hidden states
    have unit scale before the norm weight). Every expert runs on every row, in float32.
    """
    check_mode(mode)
    c = ckpt.config
    spec = c.expert
    hidden, inter = spec.hidden, spec.inter
    q = load_quantized(ckpt, mode, cache_dir) if mode != "none" else None
    gen = torch.Generator().manual_seed(seed)
    full_bytes = c.expert_params * 2  # bf16, the usual checkpoint precision, for the ratio
    rows = []
    for layer in c.moe_layer_ids:
        if inputs is not None and layer in inputs:
            x = inputs[layer].float().reshape(-1, hidden)
            source = "given"
        else:
            x = torch.randn(num_tokens, hidden, generator=gen)
            source = "random"
        errors, weight_errors = [], []
        for e in range(c.num_experts):
            buf = ckpt.expert_buffer(layer, e, torch.float32)
            y = run_expert(buf, x, spec)
            if q is None:
                errors.append(0.0)
                weight_errors.append(0.0)
                continue
            qe = q.expert(layer, e)
            yq = quantized_expert_forward(x, qe, spec)
            errors.append(float((yq - y).norm() / y.norm().clamp_min(1e-30)))
            dq = torch.cat([m.reshape(-1) for m in qe.dequantize(torch.float32)])
            w = buf[: dq.numel()]  # the matrices; biases are kept exactly
            weight_errors.append(float((dq - w).norm() / w.norm().clamp_min(1e-30)))
        qbytes = draft_copy_bytes(spec, mode)[0]
        rows.append({
            "layer": layer,
            "mode": mode,
            "bits": BITS.get(mode, 16),
            "group_size_gate_up": group_size(hidden, BITS.get(mode, 16)),
            "group_size_down": group_size(inter, BITS.get(mode, 16)),
            "inputs": source,
            "tokens": int(x.shape[0]),
            "mean_rel_l2": sum(errors) / len(errors),
            "max_rel_l2": max(errors),
            "worst_expert": max(range(len(errors)), key=errors.__getitem__),
            "weight_rel_l2": sum(weight_errors) / len(weight_errors),
            "bytes_per_expert": qbytes if mode != "none" else full_bytes,
            "fraction_of_bf16": (qbytes / full_bytes) if mode != "none" else 1.0,
        })
    return rows
