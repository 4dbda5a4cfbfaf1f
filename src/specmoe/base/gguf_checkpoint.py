"""A GGUF model (llama.cpp's, Ollama's) read as a checkpoint: `Checkpoint`'s interface,
its tensors by the Hugging Face names the engine asks for (gguf_arch.py maps them).

Non-expert tensors are dequantized to float32 when read (at load). Routed experts stay in
the file's encoding: `expert_blob` is one expert's slices of the block's stacked tensors
(gguf_layout.py), what the tiers store and a fetch moves; `expert_parts` dequantizes them
for what needs float weights (the draft's quantized copies, the affinity table).

`open_checkpoint(path)` is where every command opens --model: a GGUF file (or a directory
holding one, or a split model's first shard) gives a GGUFCheckpoint, anything else the
safetensors `Checkpoint`.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch

from .checkpoint import Checkpoint
from .errors import SpecMoEError
from .gguf_arch import EXPERT_PARTS, hf_config, tensor_map
from .gguf_file import GGUFFile, is_gguf
from .gguf_layout import HEADER, GGUFExpertQuant
from .gguf_quants import dequantize
from .model_config import ModelConfig
from .tokenizer import Tokenizer


def open_checkpoint(path: str | Path) -> Checkpoint:
    """--model as a checkpoint: GGUF or a Hugging Face safetensors directory."""
    return GGUFCheckpoint(path) if is_gguf(Path(path)) else Checkpoint(path)


def load_tokenizer(ckpt: Checkpoint) -> Tokenizer | None:
    """The checkpoint's tokenizer: a tokenizer.json beside it (a GGUF file's too), else a
    GGUF file's own vocabulary; None: prompts must be token ids."""
    if isinstance(ckpt, GGUFCheckpoint):
        return ckpt.tokenizer()
    return Tokenizer.from_dir(ckpt.dir)


class GGUFCheckpoint(Checkpoint):
    fused_layout = False  # experts are read per expert from their stacked tensors, below
    mxfp4 = False

    def __init__(self, path: str | Path):
        self.file = GGUFFile(path)
        self.path = self.file.path
        self.dir = self.path.parent
        self.arch = self.file.architecture
        config = ModelConfig.from_dict(hf_config(self.file), None, where=str(self.path))
        self._handles, self._readers, self._packed, self.ct, self.prefix = {}, {}, set(), None, "model."
        self._file_of = tensor_map(self.file, config.num_layers)  # Hugging Face name -> GGUF name
        self.config = replace(config, expert_quant=self._expert_quant(config))

    # --- non-expert tensors ---------------------------------------------------------------------

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._raw(name).shape) if self._transformed(name) else self.file.info(self._gguf(name)).shape

    def _gguf(self, name: str) -> str:
        g = self._file_of.get(name)
        if g is None:
            raise SpecMoEError(f"{self.path}: tensor {name!r} (by its Hugging Face name) is missing from the GGUF file")
        return g

    def _transformed(self, name: str) -> bool:
        g = self._gguf(name)
        return g.endswith(("attn_k_b.weight", "ffn_gate_inp_shexp.weight"))

    def _raw(self, name: str) -> torch.Tensor:
        g = self._gguf(name)
        t = self.file.dequantized(g)
        a = self.config.attention
        if self.arch == "llama" and g.endswith(("attn_q.weight", "attn_k.weight")):
            t = rope_to_half(t, a.num_heads if g.endswith("attn_q.weight") else a.num_kv_heads)
        elif g.endswith("attn_k_b.weight"):  # k_b [H, c, dn] and v_b [H, dv, c] -> kv_b [H (dn + dv), c]
            v_b = self.file.dequantized(g.replace("attn_k_b", "attn_v_b"))
            t = torch.cat([t.transpose(1, 2), v_b], dim=1).reshape(-1, t.shape[1])
        elif g.endswith("ffn_gate_inp_shexp.weight"):
            t = t.reshape(1, -1)
        return t

    def stored_matrix(self, role: str, shape: tuple[int, ...], layer: int | None = None):
        """(bytes, ggml type) of a 2-D tensor as the file stores it: None where it is absent,
        transformed on reading (MLA's k_b / v_b, a reshaped gate) or not 2-D. llama.cpp's
        q / k row order is undone on the rows' bytes (a row is whole blocks)."""
        name = self.find(self.candidates(role, layer))
        if name is None or self._transformed(name) or len(shape) != 2:
            return None
        g = self._gguf(name)
        t = self.file.info(g)
        if tuple(t.shape) != tuple(shape):
            return None
        raw = self.file.read(g)
        if self.arch == "llama" and g.endswith(("attn_q.weight", "attn_k.weight")):
            a = self.config.attention
            rows = raw.view(shape[0], -1)
            raw = rope_to_half(rows, a.num_heads if g.endswith("attn_q.weight") else a.num_kv_heads).reshape(-1)
        return raw, t.type_name

    # --- routed experts -----------------------------------------------------------------------------

    def _expert_quant(self, config: ModelConfig) -> GGUFExpertQuant:
        spec, E = config.expert, config.num_experts
        D, I = spec.hidden, spec.inter
        layers = []
        first = config.moe_layer_ids[0]
        if f"blk.{first}.ffn_gate_exps.weight" not in self.file.tensors and f"blk.{first}.ffn_gate.0.weight" in \
                self.file.tensors:
            raise SpecMoEError(f"{self.path}: an old GGUF file with one tensor per expert (blk.N.ffn_gate.E); "
                               "convert the model again with a current llama.cpp (its experts stacked per block)")
        for layer in config.moe_layer_ids:
            types = []
            for part, shape in zip(EXPERT_PARTS, ((E, I, D), (E, I, D), (E, D, I))):
                t = self.file.info(f"blk.{layer}.{part}.weight")
                if t.shape != shape:
                    raise SpecMoEError(f"{self.path}: {t.name} has shape {list(t.shape)}, the metadata implies "
                                       f"{list(shape)} (expert count, hidden and expert sizes)")
                types.append(t.type_name)
            layers.append((layer, tuple(types)))
        bias = spec.bias and f"blk.{config.moe_layer_ids[0]}.ffn_down_exps.bias" in self.file.tensors
        if spec.bias and not bias:
            raise SpecMoEError(f"{self.path}: {config.architecture} experts have biases, the file has none")
        return GGUFExpertQuant(D, I, bias, tuple(layers))

    def _expert_bytes(self, layer: int, expert: int) -> dict[str, torch.Tensor]:
        return {part: self.file.slice_bytes(f"blk.{layer}.{part}.weight", expert) for part in EXPERT_PARTS}

    def _expert_biases(self, layer: int, expert: int) -> tuple[torch.Tensor, torch.Tensor]:
        def bias(part):
            name = f"blk.{layer}.{part}.bias"
            t = self.file.info(name)
            return dequantize(self.file.slice_bytes(name, expert), t.type_name, 1, t.shape[-1]).reshape(-1)
        return torch.cat([bias("ffn_gate_exps"), bias("ffn_up_exps")]), bias("ffn_down_exps")

    def expert_blob(self, layer: int, expert: int) -> torch.Tensor:
        """The expert as the file encodes it: one uint8 blob (gguf_layout.py)."""
        q = self.config.expert_quant
        types = q.types_of(layer)
        sections = q.sections(types)
        blob = torch.zeros(q.nbytes, dtype=torch.uint8)
        blob[:HEADER] = torch.tensor(q.header(types), dtype=torch.uint8)
        parts = self._expert_bytes(layer, expert)
        if q.bias:
            b_in, b_out = self._expert_biases(layer, expert)
            parts.update(b_in=b_in.view(torch.uint8), b_out=b_out.view(torch.uint8))
        for name, data in parts.items():
            offset, n = sections[name.removeprefix("ffn_").removesuffix("_exps")]
            blob[offset:offset + n] = data
        return blob

    def expert_parts(self, layer: int, expert: int) -> list[torch.Tensor]:
        """The expert dequantized, in `expert_buffer`'s order: w_in (gate rows, then up), w_out, biases."""
        D, I = self.config.expert.hidden, self.config.expert.inter
        types = self.config.expert_quant.types_of(layer)
        raw = self._expert_bytes(layer, expert)
        gate, up, down = (dequantize(raw[p], t, rows, cols) for p, t, (rows, cols) in
                          zip(EXPERT_PARTS, types, ((I, D), (I, D), (D, I))))
        parts = [torch.cat([gate, up]), down]
        if self.config.expert_quant.bias:
            parts += list(self._expert_biases(layer, expert))
        return parts

    def expert_part_shapes(self, layer: int) -> list[tuple[int, ...]]:
        D, I = self.config.expert.hidden, self.config.expert.inter
        shapes = [(2 * I, D), (D, I)]
        return shapes + ([(2 * I,), (D,)] if self.config.expert_quant.bias else [])

    def expert_part_rows(self, layer: int, expert: int, part: int, start: int, stop: int) -> torch.Tensor:
        """Rows start:stop of the expert's `part`-th tensor (`expert_parts`' order) in float32,
        2-D: only those rows' blocks are read and dequantized (a GGUF row is whole blocks)."""
        if part > 1:  # biases: small
            return self.expert_parts(layer, expert)[part].reshape(-1, 1)[start:stop]
        D, I = self.config.expert.hidden, self.config.expert.inter
        types = self.config.expert_quant.types_of(layer)
        # part 0 is gate rows then up rows; part 1 is down
        pieces = [(0, 0, I, D), (1, I, 2 * I, D)] if part == 0 else [(2, 0, D, I)]
        out = []
        for p, first, end, cols in pieces:
            lo, hi = max(start, first), min(stop, end)
            if lo < hi:
                name = f"blk.{layer}.{EXPERT_PARTS[p]}.weight"
                t = self.file.info(name)
                per_expert = t.nbytes // t.shape[0]  # as slice_bytes takes one expert of the stack
                row = per_expert // (end - first)
                raw = self.file.read(name, expert * per_expert + (lo - first) * row, (hi - lo) * row)
                out.append(dequantize(raw, types[p], hi - lo, cols))
        return torch.cat(out)

    def fingerprint(self) -> str:
        return self.file.fingerprint()

    def summary(self) -> dict:
        """For `specmoe info`: the file, its llama.cpp architecture, the encoding of each kind
        of tensor (with how many tensors have it) and one expert's bytes as stored."""
        kinds: dict[str, dict[str, int]] = {}
        for t in self.file.tensors.values():
            per = kinds.setdefault(tensor_kind(t.name), {})
            per[t.type_name] = per.get(t.type_name, 0) + 1
        q = self.config.expert_quant
        return {"gguf_file": str(self.path), "gguf_shards": len(self.file.paths), "gguf_architecture": self.arch,
                "quantization": {k: ", ".join(f"{n} x{c}" for n, c in v.items()) for k, v in sorted(kinds.items())},
                "expert_bytes_as_stored": {"/".join(t): q.stored_bytes(t) for t in q.combos}}

    def tokenizer(self) -> Tokenizer | None:
        if (self.dir / "tokenizer.json").is_file():  # beside the file: it takes precedence
            return Tokenizer(self.dir)
        return gguf_tokenizer(self.file)


def tensor_kind(name: str) -> str:
    """What a GGUF tensor is, for `specmoe info`."""
    part = name.split(".")[-2] if name.count(".") >= 1 else name
    if name.endswith(".bias") or part.endswith("_b") and part.startswith("exp_probs"):
        return "biases"
    if part.endswith("norm"):
        return "norms"
    table = {"token_embd": "embedding", "output": "lm head", "ffn_gate_inp": "routers", "ffn_gate_exps": "experts gate",
             "ffn_up_exps": "experts up", "ffn_down_exps": "experts down"}
    if part in table:
        return table[part]
    if part.endswith("shexp"):
        return "shared experts"
    if part.startswith("attn"):
        return "attention"
    return "dense MLP" if part in ("ffn_gate", "ffn_up", "ffn_down") else part


def rope_to_half(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows of a q or k projection [heads * d, D] from llama.cpp's interleaved pairs (2i,
    2i + 1) back to the rotate-half order (i, i + d/2), undoing its converter's permutation."""
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_tokenizer(f: GGUFFile) -> Tokenizer | None:
    """The file's tokenizer (tokenizer.ggml.*), built by transformers' GGUF converter."""
    if f.value("tokenizer.ggml.model") is None:
        return None
    try:
        from transformers.integrations.gguf import convert_gguf_tokenizer, get_gguf_tokenizer
    except ImportError:
        raise SpecMoEError(f"{f.path}: reading a GGUF file's tokenizer needs transformers (pip install transformers); "
                           "or put the model's tokenizer.json beside the file, or pass prompts as token ids") from None
    arch, tokens, config = get_gguf_tokenizer(str(f.path))
    backend, _ = convert_gguf_tokenizer(arch, tokens)
    names = f.value("tokenizer.ggml.tokens") or []
    eos = f.value("tokenizer.ggml.eos_token_id")
    return Tokenizer.from_parts(backend, {
        "chat_template": f.value("tokenizer.chat_template"),
        "bos_token": config.get("bos_token"), "eos_token": names[eos] if eos is not None and eos < len(names) else None,
        "add_bos_token": bool(f.value("tokenizer.ggml.add_bos_token", config.get("add_bos_token", False))),
    })
