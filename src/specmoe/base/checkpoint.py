"""Reading Hugging Face safetensors checkpoints, lazily, without pickle.

The index (or the single file's header) is read once; a tensor is read when asked for.
Tensor names differ between families and between transformers versions; the tables
below map each internal role to the names it may have. One routed expert is handed out
as one contiguous buffer (`ExpertSpec`: `[gate | up | down]`, plus biases where the family
has them): it is the unit that moves between tiers.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import replace
from functools import cached_property
from pathlib import Path

import torch
from safetensors import safe_open

from .config import ModelConfig
from .errors import SpecMoEError
from .model_config import read_json
from .quantization import ExpertQuant
from .quantized_tensors import (
    FP8_DTYPES,
    CompressedTensors,
    dequantize_fp8,
    dequantize_mxfp4,
    pack_blob,
    stack_rows,
    unpack_nibbles,
)
from .safetensors_stream import SafetensorsReader

# Per-layer tensors, as templates under "{prefix}layers.{i}.". The first name present wins.
# Mixtral and Phi-3.5-MoE write their MoE block as `block_sparse_moe`, Llama 4 as
# `feed_forward`, the others (and transformers 5 for all) as `mlp`.
LAYER_TENSORS: dict[str, tuple[str, ...]] = {
    "attn_norm": ("input_layernorm.weight", "self_attn_layer_norm.weight"),
    "attn_norm_bias": ("input_layernorm.bias", "self_attn_layer_norm.bias"),
    "mlp_norm": ("post_attention_layernorm.weight", "ff_layer_norm.weight"),
    "mlp_norm_bias": ("post_attention_layernorm.bias", "ff_layer_norm.bias"),
    "q": ("self_attn.q_proj.weight",),
    "k": ("self_attn.k_proj.weight",),
    "v": ("self_attn.v_proj.weight",),
    "o": ("self_attn.o_proj.weight", "self_attn.out_proj.weight"),
    "q_bias": ("self_attn.q_proj.bias",),
    "k_bias": ("self_attn.k_proj.bias",),
    "v_bias": ("self_attn.v_proj.bias",),
    "o_bias": ("self_attn.o_proj.bias", "self_attn.out_proj.bias"),
    # an encoder-decoder model's decoder layers attend to the source (NLLB-MoE)
    "cross_norm": ("cross_attention_layer_norm.weight",),
    "cross_norm_bias": ("cross_attention_layer_norm.bias",),
    "cross_q": ("cross_attention.q_proj.weight",),
    "cross_k": ("cross_attention.k_proj.weight",),
    "cross_v": ("cross_attention.v_proj.weight",),
    "cross_o": ("cross_attention.out_proj.weight",),
    "cross_q_bias": ("cross_attention.q_proj.bias",),
    "cross_k_bias": ("cross_attention.k_proj.bias",),
    "cross_v_bias": ("cross_attention.v_proj.bias",),
    "cross_o_bias": ("cross_attention.out_proj.bias",),
    "q_norm": ("self_attn.q_norm.weight",),
    "k_norm": ("self_attn.k_norm.weight",),
    "sinks": ("self_attn.sinks",),
    # multi-head latent attention (DeepSeek)
    "q_a": ("self_attn.q_a_proj.weight",),
    "q_a_bias": ("self_attn.q_a_proj.bias",),
    "q_a_norm": ("self_attn.q_a_layernorm.weight",),
    "q_b": ("self_attn.q_b_proj.weight",),
    "kv_a": ("self_attn.kv_a_proj_with_mqa.weight",),
    "kv_a_bias": ("self_attn.kv_a_proj_with_mqa.bias",),
    "kv_a_norm": ("self_attn.kv_a_layernorm.weight",),
    "kv_b": ("self_attn.kv_b_proj.weight",),
    # the MoE block's router
    "router": ("block_sparse_moe.gate.weight", "mlp.gate.weight", "mlp.router.weight", "feed_forward.router.weight",
               "ffn.router.classifier.weight"),
    "router_bias": ("mlp.router.bias", "ffn.router.classifier.bias"),
    "correction_bias": ("mlp.gate.e_score_correction_bias",),
    # shared experts (on the device with the other non-expert weights)
    "shared_gate_proj": ("mlp.shared_expert.gate_proj.weight", "mlp.shared_experts.gate_proj.weight",
                         "feed_forward.shared_expert.gate_proj.weight"),
    "shared_up_proj": ("mlp.shared_expert.up_proj.weight", "mlp.shared_experts.up_proj.weight",
                       "feed_forward.shared_expert.up_proj.weight"),
    "shared_down_proj": ("mlp.shared_expert.down_proj.weight", "mlp.shared_experts.down_proj.weight",
                         "feed_forward.shared_expert.down_proj.weight"),
    "shared_expert_gate": ("mlp.shared_expert_gate.weight",),
    # dense MLP layers
    "dense_gate_proj": ("mlp.gate_proj.weight", "feed_forward.gate_proj.weight"),
    "dense_up_proj": ("mlp.up_proj.weight", "feed_forward.up_proj.weight"),
    "dense_down_proj": ("mlp.down_proj.weight", "feed_forward.down_proj.weight"),
    # dense fc1 / fc2 layers with biases (NLLB-MoE: ReLU, not gated)
    "dense_fc1": ("ffn.fc1.weight",),
    "dense_fc1_bias": ("ffn.fc1.bias",),
    "dense_fc2": ("ffn.fc2.weight",),
    "dense_fc2_bias": ("ffn.fc2.bias",),
}

# One routed expert in the per-expert layout ({e}: expert index).
EXPERT_TENSORS: dict[str, tuple[str, ...]] = {
    "gate": ("block_sparse_moe.experts.{e}.w1.weight", "mlp.experts.{e}.gate_proj.weight"),
    "up": ("block_sparse_moe.experts.{e}.w3.weight", "mlp.experts.{e}.up_proj.weight",
           "ffn.experts.expert_{e}.fc1.weight"),
    "down": ("block_sparse_moe.experts.{e}.w2.weight", "mlp.experts.{e}.down_proj.weight",
             "ffn.experts.expert_{e}.fc2.weight"),
    "up_bias": ("ffn.experts.expert_{e}.fc1.bias",),
    "down_bias": ("ffn.experts.expert_{e}.fc2.bias",),
}

# All routed experts of a layer in one tensor per part (transformers >= 5 with
# save_original_format=False; GPT-OSS and Llama 4 always): gate_up [E, 2I, D] with gate
# rows first and down [E, D, I], or, for families stored for `x @ W`, [E, D, 2I] and [E, I, D].
FUSED_EXPERT_TENSORS: dict[str, tuple[str, ...]] = {
    "gate_up": ("block_sparse_moe.experts.gate_up_proj", "mlp.experts.gate_up_proj",
                "feed_forward.experts.gate_up_proj"),
    "down": ("block_sparse_moe.experts.down_proj", "mlp.experts.down_proj", "feed_forward.experts.down_proj"),
    "gate_up_bias": ("mlp.experts.gate_up_proj_bias",),
    "down_bias": ("mlp.experts.down_proj_bias",),
    # MXFP4 (the released GPT-OSS checkpoints): [E, out, in / 32, 16] packed codes and
    # [E, out, in / 32] power-of-two scales, [out, in] as nn.Linear stores it
    "gate_up_blocks": ("mlp.experts.gate_up_proj_blocks",),
    "gate_up_scales": ("mlp.experts.gate_up_proj_scales",),
    "down_blocks": ("mlp.experts.down_proj_blocks",),
    "down_scales": ("mlp.experts.down_proj_scales",),
}

# Outside the layers; names relative to the text model's prefix ("{prefix}" is e.g. "model.").
GLOBAL_TENSORS: dict[str, tuple[str, ...]] = {
    "embed": ("{prefix}embed_tokens.weight", "{prefix}decoder.embed_tokens.weight", "{prefix}shared.weight"),
    "encoder_embed": ("{prefix}encoder.embed_tokens.weight", "{prefix}shared.weight"),
    "final_norm": ("{prefix}norm.weight", "{prefix}decoder.layer_norm.weight"),
    "final_norm_bias": ("{prefix}norm.bias", "{prefix}decoder.layer_norm.bias"),
    "encoder_norm": ("{prefix}encoder.layer_norm.weight",),
    "encoder_norm_bias": ("{prefix}encoder.layer_norm.bias",),
    "lm_head": ("lm_head.weight", "language_model.lm_head.weight"),
    "lm_head_bias": ("lm_head.bias", "language_model.lm_head.bias"),
}

# Where the text model's tensors live: causal LMs under "model."; multimodal checkpoints
# (Llama 4) under the language model's own prefix, in the Hub's or transformers 5's naming.
TEXT_PREFIXES = ("model.", "language_model.model.", "model.language_model.")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
HEADER_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16", "U8": "e8m0"}
# What a quantized Linear stores beside (or instead of) its `.weight`: not tensors the engine loads.
QUANT_PARTS = re.compile(r"\.weight_(packed|scale|shape|zero_point|g_idx|scale_inv)$")


class Checkpoint:
    """A Hugging Face model directory: its config and its tensors, read lazily."""

    def __init__(self, model_dir: str | Path):
        self.dir = Path(model_dir)
        if not self.dir.exists():
            raise SpecMoEError(f"model directory {self.dir} does not exist; pass --model DIR of a Hugging Face checkpoint")
        if not self.dir.is_dir():
            raise SpecMoEError(f"{self.dir} is not a directory; pass --model DIR of a Hugging Face checkpoint")
        self.config = ModelConfig.from_dir(self.dir)
        self._handles: dict[str, object] = {}
        self._readers: dict[str, SafetensorsReader] = {}
        self._file_of = self._read_index()
        self.prefix = next((p for p in TEXT_PREFIXES if f"{p}embed_tokens.weight" in self._file_of), "model.")
        qc = read_json(self.dir / "config.json").get("quantization_config") or {}
        self.ct = CompressedTensors(qc, str(self.dir)) if qc.get("quant_method") == "compressed-tensors" else None
        # compressed-tensors' packed weights: `X.weight` is served dequantized from `X.weight_packed`
        self._packed = {n.removesuffix("_packed") for n in self._file_of if n.endswith(".weight_packed")}
        self.config = replace(self.config, expert_quant=self._stored_expert_quant())

    # --- the index ------------------------------------------------------------------

    def _read_index(self) -> dict[str, str]:
        """tensor name -> file name, from model.safetensors.index.json or the single file."""
        index = self.dir / "model.safetensors.index.json"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (OSError, ValueError, KeyError) as exc:
                raise SpecMoEError(f"{index}: unreadable index ({exc}); restore it from the checkpoint") from None
            for fname in set(weight_map.values()):
                if not (self.dir / fname).is_file():
                    raise SpecMoEError(f"{self.dir / fname}: shard named in the index is missing; download it again")
            return dict(weight_map)
        single = self.dir / "model.safetensors"
        if not single.is_file():
            if any(self.dir.glob("*.bin")) or any(self.dir.glob("*.pt")):
                raise SpecMoEError(
                    f"{self.dir}: only pickle weights (*.bin/*.pt) found; specmoe reads safetensors only: "
                    "convert with save_pretrained(safe_serialization=True)"
                )
            raise SpecMoEError(f"{self.dir}: no model.safetensors or model.safetensors.index.json")
        return {name: single.name for name in self._open(single.name).keys()}

    def _open(self, fname: str):
        handle = self._handles.get(fname)
        if handle is None:
            path = self.dir / fname
            try:
                handle = safe_open(str(path), framework="pt", device="cpu")
            except Exception as exc:  # safetensors raises its own error types
                raise SpecMoEError(
                    f"{path}: truncated or corrupt safetensors file ({exc}); download or save it again"
                ) from None
            self._handles[fname] = handle
        return handle

    def layer_prefix(self, layer: int) -> str:
        """Where layer `layer`'s tensors are; an encoder-decoder model numbers its encoder
        layers first, then its decoder layers."""
        enc = self.config.encoder_layers
        if not self.config.seq2seq:
            return f"{self.prefix}layers.{layer}."
        return f"{self.prefix}encoder.layers.{layer}." if layer < enc else f"{self.prefix}decoder.layers.{layer - enc}."

    @property
    def names(self) -> set[str]:
        return set(self._file_of) | self._packed

    def has(self, name: str) -> bool:
        return name in self._file_of or name in self._packed

    def shape(self, name: str) -> tuple[int, ...]:
        """A tensor's shape from the file header, without reading its bytes."""
        if name in self._packed:
            return tuple(int(v) for v in self._raw(name + "_shape").tolist())
        return tuple(self._open(self._file_of[name]).get_slice(name).get_shape())

    def _header_dtype(self, name: str) -> str:
        return self._open(self._file_of[name]).get_slice(name).get_dtype()

    def is_routed_expert(self, name: str) -> bool:
        return ".experts." in name

    def text_names(self) -> list[str]:
        """The tensors the engine loads: the text model's layers (not multi-token-prediction
        layers past num_hidden_layers, not a vision tower) and its embedding, norm and head."""
        layers = tuple(self.layer_prefix(i) for i in range(self.config.num_layers))
        globals_ = {t.format(prefix=self.prefix) for ts in GLOBAL_TENSORS.values() for t in ts}
        return sorted(n for n in self.names if (n.startswith(layers) or n in globals_) and not QUANT_PARTS.search(n))

    def tensor(self, name: str) -> torch.Tensor:
        """A tensor as the model computes with it: quantized weights (other than the
        experts' blobs, `expert_blob`) read as float32 at the checkpoint's values."""
        if self.ct is not None and (name in self._packed or name + "_scale" in self._file_of):
            module = name.removesuffix(".weight")
            parts = {p: self._raw(f"{module}.{p}") for p in ("weight", "weight_packed", "weight_scale", "weight_shape",
                                                             "weight_zero_point") if f"{module}.{p}" in self._file_of}
            return self.ct.dequantize(module, parts)
        t = self._raw(name)
        if t.dtype in FP8_DTYPES and name + "_scale_inv" in self._file_of:
            return dequantize_fp8(t, self._raw(name + "_scale_inv"), self.config.weight_block_size)
        return t

    def _raw(self, name: str) -> torch.Tensor:
        """A tensor as the file stores it."""
        if name not in self._file_of:
            raise SpecMoEError(f"{self.dir}: tensor {name!r} is missing from the checkpoint")
        return self._reader(self._file_of[name]).read(name)

    def _reader(self, fname: str) -> SafetensorsReader:
        """Tensors are read (pread), not mapped: a touched mapped page stays resident, so a pass
        over every expert would hold the whole checkpoint. `_open` checks the header first."""
        if fname not in self._readers:
            self._open(fname)
            self._readers[fname] = SafetensorsReader(self.dir / fname)
        return self._readers[fname]

    # --- tensors by role --------------------------------------------------------------

    def find(self, candidates: tuple[str, ...], **fmt) -> str | None:
        """The first candidate name the checkpoint has, or None."""
        return next((n for n in (t.format(**fmt) for t in candidates) if self.has(n)), None)

    def candidates(self, role: str, layer: int | None = None) -> tuple[str, ...]:
        if layer is None:
            return tuple(t.format(prefix=self.prefix) for t in GLOBAL_TENSORS[role])
        return tuple(self.layer_prefix(layer) + t for t in LAYER_TENSORS[role])

    def get(self, role: str, shape: tuple[int, ...], layer: int | None = None, required: bool = True):
        """The tensor playing `role` (in `layer`), checked against `shape`; None if optional and absent."""
        candidates = self.candidates(role, layer)
        name = self.find(candidates)
        if name is None:
            if required:
                raise SpecMoEError(f"{self.dir}: tensor {candidates[0]!r} is missing from the checkpoint")
            return None
        return self._checked(name, shape)

    def _checked(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        t = self.tensor(name)
        if tuple(t.shape) != tuple(shape):
            raise SpecMoEError(
                f"{self.dir}: tensor {name!r} has shape {list(t.shape)}, config.json implies {list(shape)}"
            )
        return t

    def _layer_has(self, part: str) -> bool:
        layer = self.config.moe_layer_ids[0] if self.config.moe_layer_ids else 0
        pre = self.layer_prefix(layer)
        return self.find(tuple(pre + t for t in FUSED_EXPERT_TENSORS[part])) is not None

    @cached_property
    def fused_layout(self) -> bool:
        return self._layer_has("gate_up") or self.mxfp4

    @cached_property
    def mxfp4(self) -> bool:
        return self._layer_has("gate_up_blocks")

    def expert_buffer(self, layer: int, expert: int, dtype: torch.dtype) -> torch.Tensor:
        """Routed expert `expert` of `layer` as one 1-D buffer in `ExpertSpec`'s layout [w_in (gate
        rows, then up rows) | w_out | b_in | b_out], dequantized (`expert_blob` keeps it quantized)."""
        return torch.cat([p.reshape(-1).to(dtype) for p in self.expert_parts(layer, expert)])

    def expert_parts(self, layer: int, expert: int) -> list[torch.Tensor]:
        """The expert's tensors as the checkpoint has them (`expert_buffer`'s order)."""
        spec = self.config.expert
        if self.fused_layout:
            return self._fused_expert(layer, expert)
        shapes = {"gate": (spec.inter, spec.hidden), "up": (spec.inter, spec.hidden), "down": (spec.hidden, spec.inter),
                  "up_bias": (spec.inter,), "down_bias": (spec.hidden,)}
        names = (("gate", "up", "down") if spec.gated else ("up", "down")) + (("up_bias", "down_bias") if spec.bias else ())
        return [self._checked(self._expert_name(layer, expert, part), shapes[part]) for part in names]

    def _expert_name(self, layer: int, expert: int, part: str) -> str:
        candidates = tuple(self.layer_prefix(layer) + t for t in EXPERT_TENSORS[part])
        name = self.find(candidates, e=expert)
        if name is None:
            raise SpecMoEError(f"{self.dir}: tensor {candidates[0].format(e=expert)!r} is missing from the checkpoint")
        return name

    # --- quantized experts, kept quantized ----------------------------------------------------

    def _stored_expert_quant(self) -> ExpertQuant | None:
        """config.json's word on how the experts are quantized, checked against the tensors:
        experts the checkpoint left in float are float; the scales have the file's dtype."""
        q = self.config.expert_quant
        if q is None or not self.config.moe_layer_ids:
            return q
        if q.source == "mxfp4":
            return q if self.mxfp4 else None
        if self.fused_layout:
            raise SpecMoEError(f"{self.dir}: {q.source} experts in the fused layout are not supported; specmoe reads "
                               "quantized experts stored one tensor per expert (the Hub's layout)")
        scale = self._expert_name(self.config.moe_layer_ids[0], 0, "down") + (
            "_scale_inv" if q.source == "fp8" else "_scale")
        if scale not in self._file_of:
            return None  # quantization left the experts in float
        dtype = HEADER_DTYPES.get(self._header_dtype(scale))
        if dtype is None or dtype == "e8m0":
            raise SpecMoEError(f"{self.dir}: expert scales {scale!r} are {self._header_dtype(scale)}; specmoe reads "
                               "float32, bfloat16 or float16 scales")
        return q.with_scale_dtype(dtype)

    def expert_blob(self, layer: int, expert: int) -> torch.Tensor:
        """Routed expert `expert` of `layer` as the checkpoint quantized it: one uint8 blob
        (layout: `ExpertQuant.sections`), the unit the tiers store and move."""
        q = self.config.expert_quant
        if q.source == "mxfp4":
            return pack_blob(q, *self._mxfp4_expert(layer, expert))
        gated = self.config.expert.gated
        parts = [self._stored_matrix(self._expert_name(layer, expert, p), q.w_in) for p in
                 (("gate", "up") if gated else ("up",))]
        w_out = self._stored_matrix(self._expert_name(layer, expert, "down"), q.w_out)
        return pack_blob(q, stack_rows(parts, q.part_block_rows, q.w_in), w_out)

    def _stored_matrix(self, name: str, m) -> tuple[torch.Tensor, torch.Tensor]:
        """(codes, scales [scale rows, column groups]) of one quantized expert matrix, as stored."""
        module = name.removesuffix(".weight")
        if self.ct is None:  # block-scaled FP8
            codes, scales = self._raw(name), self._raw(name + "_scale_inv")
        else:
            codes = self.ct.codes({p: self._raw(f"{module}.{p}") for p in ("weight", "weight_packed", "weight_shape")
                                   if f"{module}.{p}" in self._file_of}, m.bits)
            scales = self._raw(name + "_scale")
        want = torch.int8 if m.codes.startswith("int") else torch.float8_e4m3fn
        if codes.dtype != want or codes.dim() != 2:
            raise SpecMoEError(f"{self.dir}: expert weight {name!r} is {codes.dtype} {list(codes.shape)}; config.json "
                               f"says {m.codes} codes")
        return codes, scales.reshape(-1, -(-codes.shape[1] // m.group))

    def _mxfp4_expert(self, layer: int, expert: int):
        """GPT-OSS: (w_in, w_out) as (e2m1 codes, e8m0 scales), and the biases."""
        c = self.config
        spec, E = c.expert, c.num_experts
        R, D, I = spec.in_rows, spec.hidden, spec.inter

        def matrix(part: str, rows: int, cols: int):
            blocks = self._fused(layer, f"{part}_blocks", (E, rows, cols // 32, 16), expert)
            return (unpack_nibbles(blocks.reshape(rows, cols // 2)),
                    self._fused(layer, f"{part}_scales", (E, rows, cols // 32), expert))

        w_in, w_out = matrix("gate_up", R, D), matrix("down", D, I)
        b_in, b_out = self._fused(layer, "gate_up_bias", (E, R), expert), self._fused(layer, "down_bias", (E, D), expert)
        if c.family.gate_up_interleaved:  # gate rows first, as in the buffer's layout
            w_in, b_in = tuple(_deinterleave(t) for t in w_in), _deinterleave(b_in)
        return w_in, w_out, b_in, b_out

    def _fused_expert(self, layer: int, expert: int) -> list[torch.Tensor]:
        """One expert's slices of the layer's fused tensors, turned into the buffer's layout."""
        c, fam = self.config, self.config.family
        spec, E = c.expert, c.num_experts
        R, D, I = spec.in_rows, spec.hidden, spec.inter
        if self.mxfp4:  # dequantized on load: the tiers hold (and move) the compute dtype
            w_in = dequantize_mxfp4(self._fused(layer, "gate_up_blocks", (E, R, D // 32, 16), expert),
                                    self._fused(layer, "gate_up_scales", (E, R, D // 32), expert))
            w_out = dequantize_mxfp4(self._fused(layer, "down_blocks", (E, D, I // 32, 16), expert),
                                     self._fused(layer, "down_scales", (E, D, I // 32), expert))
        elif fam.fused_transposed:
            w_in = self._fused(layer, "gate_up", (E, D, R), expert).t()
            w_out = self._fused(layer, "down", (E, I, D), expert).t()
        else:
            w_in = self._fused(layer, "gate_up", (E, R, D), expert)
            w_out = self._fused(layer, "down", (E, D, I), expert)
        parts = [w_in, w_out]
        if spec.bias:
            parts += [self._fused(layer, "gate_up_bias", (E, R), expert), self._fused(layer, "down_bias", (E, D), expert)]
        if fam.gate_up_interleaved:  # rows gate, up, gate, up, ...: gate rows first instead
            parts[0] = _deinterleave(parts[0])
            if spec.bias:
                parts[2] = _deinterleave(parts[2])
        return parts

    def _fused(self, layer: int, part: str, shape: tuple[int, ...], expert: int) -> torch.Tensor:
        """Expert `expert`'s slice of the layer's fused tensor [E, ...], read alone."""
        pre = self.layer_prefix(layer)
        name = self.find(tuple(pre + t for t in FUSED_EXPERT_TENSORS[part]))
        if name is None:  # _checked says the tensor is missing, as for any other
            return self._checked(pre + FUSED_EXPERT_TENSORS[part][0], shape)
        if self.shape(name) != tuple(shape):
            raise SpecMoEError(f"{self.dir}: tensor {name!r} has shape {list(self.shape(name))}, config.json implies "
                               f"{list(shape)}")
        return self._reader(self._file_of[name]).read(name, row=expert)

    def torch_dtype(self) -> torch.dtype:
        return DTYPES.get(self.config.torch_dtype, torch.float32)

    def fingerprint(self) -> str:
        """Identifies the checkpoint's bytes cheaply: file names, sizes and modification times."""
        parts = []
        for fname in sorted(set(self._file_of.values())) + ["config.json"]:
            st = (self.dir / fname).stat()
            parts.append(f"{fname}:{st.st_size}:{st.st_mtime_ns}")
        return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]


def _deinterleave(rows: torch.Tensor) -> torch.Tensor:
    """Rows gate, up, gate, up, ... (GPT-OSS) -> the gate rows, then the up rows."""
    return torch.cat([rows[0::2], rows[1::2]])
