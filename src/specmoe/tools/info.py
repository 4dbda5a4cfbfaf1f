"""`specmoe info`: a model's shape, its bytes by kind, and what fits in a device budget."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from ..base.gguf_checkpoint import GGUFCheckpoint, open_checkpoint, tensor_kind
from ..base.gguf_file import is_gguf, model_file
from ..base.memory import anon_rss_bytes, host_bound
from ..base.config import EngineConfig, expert_share
from ..base.paths import offload_dir, resolve_model_dir
from ..base.units import format_bytes, parse_size
from ..engine.engine import DEFAULT_MAX_MODEL_LEN, MAX_PREFILL_TOKENS, resolve_device, resolve_dtype
from ..engine.gamma import MAX_GAMMA
from ..engine.host_memory import check_limit, measure_fixed, plan_limit
from ..experts.formats import ExpertFormat, checkpoint_expert_dtype, checkpoint_format, expert_format
from ..experts.quant import BITS, draft_kernel_choices, draft_modes, expert_matrices, kernel_notes
from ..experts.quant_report import quant_error_report
from ..experts.direct_file import direct_io_support, direct_read_support
from ..flags import add_memory_limit_arg, add_model_args
from ..kernels import blockdot
from ..kernels.blockdot import as_stored
from ..policies import POLICIES, min_device_bytes
from ..policies.specmoe.draft_memory import describe as describe_draft


def register(subparsers) -> None:
    i = subparsers.add_parser("info", help="describe a model: shape, bytes, what fits in a device budget")
    add_model_args(i)
    i.add_argument("--device-memory", help="report what fits in this budget, e.g. 512MiB, 24G (GiB) or 30%%")
    add_memory_limit_arg(i)
    i.add_argument("--policy", default="specmoe", help="the policy whose per-step activations --memory-limit "
                   "plans for (default specmoe: its verify pass is the widest)")
    i.add_argument("--offload", default="disk", help="the tier --memory-limit plans for: disk | host (default disk)")
    i.add_argument("--batch-size", type=int, default=16, help="sequences whose KV cache the budget must hold")
    i.add_argument("--max-model-len", type=int, help="KV positions per sequence (default: model's, at most 2048)")
    i.add_argument("--draft-quant", help="also report per-block quantization error of int8 | int4 | int3 | int2 draft "
                   "copies; with --draft-memory, the ways the draft may hold experts (auto | none | a mode)")
    i.add_argument("--draft-memory", help="report what SpecMoE's draft would hold in this many bytes (e.g. 400MiB) "
                   "or share of --device-memory (e.g. 20%%), with --draft-quant's ways (default auto: each expert's)")
    i.add_argument("--offload-dir", help="where the disk tier's expert file would live (default: the cache dir); "
                   "info says whether reads there bypass the page cache (for a GGUF file, read in place: "
                   "whether reads of the file do)")
    i.add_argument("--json", action="store_true")
    i.set_defaults(func=run_info)


def run_info(args) -> int:
    directory = Path(args.offload_dir) if args.offload_dir else offload_dir()
    info = model_info(args.model, device_memory=args.device_memory, dtype=args.dtype,
                      batch_size=args.batch_size, max_model_len=args.max_model_len, draft_quant=args.draft_quant,
                      draft_memory=args.draft_memory, cache_dir=directory, memory_limit=args.memory_limit,
                      policy=args.policy, offload=args.offload, device=args.device)
    info["offload_dir"] = str(directory)
    model = resolve_model_dir(args.model)
    if args.offload == "disk" and is_gguf(model):  # the disk tier reads the GGUF file in place
        read = model_file(model)
        info["offload_reads"] = str(read)
        info["offload_direct"], info["offload_direct_reason"] = direct_read_support(read)
    else:
        info["offload_direct"], info["offload_direct_reason"] = direct_io_support(directory)
    if args.json:
        print(json.dumps(info))
    else:
        render_info(info)
    return 0


def model_info(model=None, device_memory=None, dtype="auto", batch_size=16, max_model_len=None, device="auto",
               draft_quant=None, draft_memory=None, cache_dir=None, memory_limit=None, policy="specmoe",
               offload="disk") -> dict:
    limit_options = None
    if memory_limit is not None:  # checked as the engine checks it: one of the two, on the CPU
        limit_options = EngineConfig(device=device, dtype=dtype, policy=policy, offload=offload,
                                     device_memory=device_memory, memory_limit=memory_limit, max_batch_size=batch_size)
        fixed = measure_fixed(resolve_device(device))  # this process, before any weight, as the engine measures its own
    ckpt = open_checkpoint(resolve_model_dir(model))
    c = ckpt.config
    compute_dtype = resolve_dtype(dtype, ckpt, resolve_device(device))
    stored = blockdot.computes_as_stored(dtype, ckpt.config, resolve_device(device))
    elem = torch.tensor([], dtype=compute_dtype).element_size()
    # what the engine loads: not a vision tower, not multi-token-prediction layers
    # an expert as the engine holds it: as the tiers hold and move it (a quantized checkpoint's blob, a bfloat16
    # one's bfloat16 where held so), its slot, and the kernels that compute it
    fmt = expert_format(c, compute_dtype, resolve_device(device), checkpoint_expert_dtype(ckpt),
                        as_stored(dtype, resolve_device(device)))
    expert_bytes = fmt.nbytes
    num_experts_total = len(c.moe_layer_ids) * c.num_experts
    max_len = min(max_model_len or DEFAULT_MAX_MODEL_LEN, c.max_position_embeddings)
    kv_per_token = c.kv_elements_per_token * elem
    info = {
        "path": str(ckpt.dir),
        "family": c.family.name,
        "architecture": c.architecture,
        "dtype": str(compute_dtype).removeprefix("torch."),
        "checkpoint_dtype": c.torch_dtype,
        "layers": c.num_layers,
        "moe_layers": len(c.moe_layer_ids),
        "hidden_size": c.hidden_size,
        "vocab_size": c.vocab_size,
        "experts_per_block": c.num_experts,
        "top_k": c.top_k,
        "router": c.router.kind,
        "shared_expert": c.shared_expert_intermediate_size > 0,
        "attention": _attention_summary(c),
        "expert_format": c.expert_quant.describe() if c.expert_quant else _float_experts(ckpt, compute_dtype, stored),
        "expert_bytes": expert_bytes,
        "expert_bytes_total": expert_bytes * num_experts_total,
        "non_expert_bytes": _non_expert_bytes(ckpt, elem, stored),
        "kv_bytes_per_token": kv_per_token,
        "max_position_embeddings": c.max_position_embeddings,
    }
    info.update(_encodings(ckpt, as_stored(dtype, resolve_device(device)), stored, fmt))
    if c.seq2seq:  # the encoder runs once per request, the decoder every step (and drafts)
        info.update(
            encoder_decoder=True, encoder_layers=c.encoder_layers, decoder_layers=len(c.decoder_layer_ids),
            encoder_moe_blocks=list(c.encoder_moe_layer_ids), decoder_moe_blocks=list(c.draft_layer_ids),
            decoder_start_token_id=c.seq2seq.decoder_start_token_id,
            # each decoder layer also keeps the source's cross-attention K/V (kv_elements_per_sequence)
            kv_cross_bytes_per_source_token=len(c.decoder_layer_ids) * c.attention.kv_elements_per_token * elem,
        )
    info["fused_kernels"] = fused_kernels(c, fmt, resolve_device(device), stored)
    if draft_quant and draft_quant not in ("none", "auto"):
        # relative L2 error of each block's expert outputs with quantized copies (random inputs)
        info["draft_quant_error"] = {
            row["layer"]: {"mean_rel_l2": round(row["mean_rel_l2"], 4), "max_rel_l2": round(row["max_rel_l2"], 4),
                           "bytes_per_expert": row["bytes_per_expert"]}
            for row in quant_error_report(ckpt, draft_quant)
        }
    if limit_options is not None:
        plan = _limit_plan(info, c, limit_options, fixed, fmt, elem, max_len, compute_dtype)
        device_memory = plan.budget  # below: what fits in it, as for --device-memory
    if device_memory is not None:
        _what_fits(info, c, device_memory, fmt.slot_bytes, elem, max_len, batch_size)
        if limit_options is not None:  # the limit is what it may peak at
            info["host_peak_bound_bytes"] = plan.limit
        elif resolve_device(device).type == "cpu":  # the budget is the process's memory: what it may peak at
            # this process's own memory, as the engine's before its weights: both have imported the same
            info["host_fixed_bytes"] = anon_rss_bytes()
            info["host_peak_bound_bytes"] = host_bound(info["device_memory"], info["host_fixed_bytes"])
    if draft_memory is not None:
        info.update(describe_draft(ckpt, draft_memory, info.get("device_memory"), fmt.slot_bytes,
                                   resolve_device(device), compute_dtype, draft_quant or "auto", cache_dir, stored))
    return info


def _what_fits(info: dict, c, device_memory, slot: int, elem: int, max_len: int, batch_size: int) -> None:
    """The budget as the engine takes it and what fits in it, into `info`. `slot`: a pool
    slot, as the engine holds an expert (a bfloat16 checkpoint's in bfloat16 where held as stored)."""
    num_experts_total = len(c.moe_layer_ids) * c.num_experts
    kv = c.kv_elements_per_sequence(max_len, MAX_GAMMA) * elem * batch_size  # as the engine reserves it
    share = expert_share(device_memory)
    if share is None:
        budget = parse_size(device_memory, "--device-memory")
    else:  # as the engine takes a share: of the experts as the pool holds them
        budget = int(info["non_expert_bytes"] + kv + share * slot * num_experts_total)
    fit = max(0, int((budget - info["non_expert_bytes"] - kv) // slot))
    info["device_memory"] = budget
    info["kv_reserved_bytes"] = kv
    info["kv_reserved_for"] = f"{batch_size} sequences x {max_len} positions"
    info["experts_fit"] = min(fit, num_experts_total)
    info["experts_fit_per_block"] = min(c.num_experts, fit // max(1, len(c.moe_layer_ids)))
    info["policies_fit"] = _policies_that_fit(c, fit, num_experts_total)


def _limit_plan(info: dict, c, options: EngineConfig, fixed: int, fmt, elem: int, max_len: int, compute_dtype):
    """--memory-limit's split as the engine plans it, into `info`; a limit below the smallest
    configuration is the engine's own error."""
    plan = plan_limit(options, c, fixed=fixed, elem=elem, max_model_len=max_len,
                      prefill_tokens=MAX_PREFILL_TOKENS, stored_bytes=fmt.nbytes, converts=fmt.converts)
    info["memory_limit_plan"] = plan.as_dict()
    # the smallest configuration, as the engine counts it
    kv = c.kv_elements_per_sequence(max_len, MAX_GAMMA) * elem * options.max_batch_size
    need = info["non_expert_bytes"] + kv + min_device_bytes(c, options, fmt.slot_bytes, resolve_device(options.device),
                                                           compute_dtype)
    info["memory_limit_smallest"] = plan.limit_for(need)
    check_limit(plan, need)
    return plan


AS_STORED = ("embedding", "attention", "lm head", "experts", "shared experts", "dense MLP")


def _encodings(ckpt, kernels_here: bool, stored: bool, fmt: ExpertFormat) -> dict:
    """A GGUF file's encodings per kind of tensor, and how the engine computes each; a
    safetensors checkpoint's where it multiplies some as stored or has quantized experts."""
    if isinstance(ckpt, GGUFCheckpoint):
        return {**ckpt.summary(), "weights_compute": gguf_compute(ckpt, kernels_here)}
    quant = ckpt.config.expert_quant
    compute = {}
    if quant is not None:
        compute["experts"] = quantized_experts_compute(ckpt.config, fmt)
    if stored:
        what = "bfloat16 matrices" if quant is not None else "bfloat16 matrices and experts"
        compute["kernel"] = (f"{what} multiplied as stored by {blockdot.library().describe()}; "
                             "norms and routers in float32")
    return {"weights_compute": compute} if compute else {}


def quantized_experts_compute(c, fmt: ExpertFormat) -> str:
    """How a quantized checkpoint's experts are computed (`fmt`: as the engine holds them) and
    the bytes they take: in their slots, and as stored and moved."""
    n = len(c.moe_layer_ids) * c.num_experts
    how = fmt.kernels.get(f"{c.expert_quant.scheme} experts") or (
        "converted for torch's fused int4 kernel (fused_kernels)" if fmt.converts else "dequantized per call")
    return (f"{c.expert_quant.scheme}: {how}; {format_bytes(fmt.slot_bytes * n)} held in their slots, "
            f"{format_bytes(fmt.nbytes * n)} stored and moved")


def _held(t, kind: str, stored: bool) -> tuple[bool, int]:
    """(whether the engine keeps a GGUF tensor in its encoding, the bytes it then holds)."""
    kept = (stored and len(t.shape) >= 2 and blockdot.computes(t.type_name) and kind in AS_STORED
            and not t.name.endswith(("attn_k_b.weight", "attn_v_b.weight", "attn_kv_b.weight")))  # MLA's kv_b
    per_call = kind == "experts" and not kept
    return kept, t.nbytes if kept or per_call or t.type_name == "F32" else math.prod(t.shape) * 4


def _non_expert_bytes(ckpt, elem: int, stored: bool) -> int:
    """What the engine holds of the weights that are not routed experts: a GGUF file's kept
    in their encodings (gguf_compute), a bfloat16 checkpoint's matrices in bfloat16 where held
    as stored (its routers and norms in float32), else everything in the compute dtype."""
    if isinstance(ckpt, GGUFCheckpoint):
        return sum(_held(t, tensor_kind(t.name), stored)[1] for t in ckpt.file.tensors.values()
                   if not tensor_kind(t.name).startswith("experts"))
    routers = {ckpt.find(ckpt.candidates("router", layer)) for layer in ckpt.config.moe_layer_ids}
    names = [n for n in ckpt.text_names() if not ckpt.is_routed_expert(n)]
    return sum(math.prod(ckpt.shape(n)) * (2 if stored and len(ckpt.shape(n)) >= 2 and n not in routers else elem)
               for n in names)


def gguf_compute(ckpt: GGUFCheckpoint, stored: bool) -> dict[str, str]:
    """Per kind of tensor in a GGUF file: how the engine computes it (its encoding kept and
    multiplied by the block kernels, or dequantized) and the bytes it then holds."""
    kinds: dict[str, dict[str, list[int]]] = {}
    for t in ckpt.file.tensors.values():
        kind = tensor_kind(t.name)
        if kind.startswith("experts "):
            kind = "experts"
        kept, held = _held(t, kind, stored)
        per_call = kind == "experts" and not kept  # the tiers keep them as stored either way
        way = "as stored" if kept else "dequantized per call" if per_call else "in float32"
        entry = kinds.setdefault(kind, {}).setdefault(f"{t.type_name} {way}", [0, 0])
        entry[0], entry[1] = entry[0] + 1, entry[1] + held
    how = f"multiplied as stored by {blockdot.library().describe()}" if stored else "dequantized"
    report = {}
    for kind, parts in sorted(kinds.items()):
        text = ", ".join(f"{name} x{n}" for name, (n, _) in parts.items())
        held = sum(b for _, b in parts.values())
        note = " (experts: in their tier and pool, moved as stored)" if kind == "experts" else ""
        report[kind] = f"{text}; {format_bytes(held)} held{note}"
    report["kernel"] = how if stored else how + " (--dtype float32, the reference; or no block kernels here)"
    return report


def fused_kernels(c, fmt: ExpertFormat, device, stored: bool = False) -> dict[str, str]:
    """Which kernels compute the experts here (`fmt`: as the engine holds them) and their draft
    copies, and why not torch's fused CPU kernels where not: the checkpoint's own int4
    experts, and the int8 and int4 draft copies (quant.device_layout: on the block kernels
    first where the engine computes as stored, `stored`)."""
    report = {f"experts {key}": why for key, why in fmt.kernels.items()}
    for mode in draft_modes(c.expert_quant):
        choices = draft_kernel_choices(c.expert, mode, device, stored)
        notes = kernel_notes([(BITS[mode], *m) for m in expert_matrices(c.expert)], choices, device, stored)
        report.update({f"draft {key}": why for key, why in notes.items()})
    return report


def _attention_summary(c) -> str:
    """What attention computes and what its KV cache holds per token and layer."""
    a = c.attention
    if a.kind == "mla":
        text = (f"multi-head latent attention, {a.num_heads} heads; the cache holds a {a.kv_lora_rank}-element "
                f"latent + {a.qk_rope_dim}-element rotary key per token and layer")
    else:
        text = f"{a.num_heads} query / {a.num_kv_heads} kv heads of {a.head_dim}"
    windows = [w for w in c.windows if w is not None]
    if windows:
        text += f"; {len(windows)} of {c.num_layers} layers {windows[0].kind} over {windows[0].size} positions"
    if c.family.positions == "sinusoidal":
        text += "; sinusoidal positions (no RoPE)"
    elif not all(c.rope_layers):
        text += f"; {c.rope_layers.count(False)} layers without RoPE"
    return text


def _policies_that_fit(config, slots: int, total: int) -> dict[str, str]:
    verdicts = {}
    for name, cls in POLICIES.items():
        need = cls.min_slots(config, EngineConfig(offload="host" if name == "host" else "disk"))
        verdicts[name] = "fits" if slots >= need else f"needs room for {need} experts"
    return verdicts


def render_info(info: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(show_header=False, box=None)
    for key, value in info.items():
        if key.endswith("bytes") or key.endswith("_bytes_total") or key in ("device_memory", "draft_memory",
                                                                                           "memory_limit_smallest"):
            value = f"{format_bytes(value)} ({value:,} B)"
        elif isinstance(value, dict):
            value = ", ".join(f"{k}: {v}" for k, v in value.items())
        table.add_row(key, str(value))
    Console().print(table)


def _float_experts(ckpt, compute_dtype, stored: bool) -> str:
    """Where float experts are kept in which dtype (the offload tiers may keep the checkpoint's)."""
    fmt = checkpoint_format(ckpt, compute_dtype)
    name = str(compute_dtype).removeprefix("torch.")
    if stored:
        return f"{ckpt.config.torch_dtype} checkpoint, multiplied as stored (float32 products, bfloat16 slots)"
    return f"{ckpt.config.torch_dtype} checkpoint, computed in {name}" + (
        f", stored and moved in {fmt.name}" if fmt.converts else "")
