"""Command-line flags shared by the commands that build an engine (generate, serve,
bench), and the parser class every command uses."""

from __future__ import annotations

import argparse
import contextlib
import json

from .base.config import EngineConfig
from .base.errors import SpecMoEError
from .engine.sampling import SamplingParams


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors (no usage dump), exit status 2."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="Hugging Face model directory (default: the bundled demo model)")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda (default auto)")
    p.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16 | float16")
    p.add_argument("--threads", type=int, help="CPU compute threads (default: the cores this process may use, as llama.cpp counts them)")


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Flags that choose the policy and the memory/tier setting."""
    add_model_args(p)
    p.add_argument("--policy", default="resident", help="resident | ondemand | overlap | caching | host | specmoe | auto")
    p.add_argument("--offload", default="disk", help="where offloaded experts live: disk | host (default disk)")
    p.add_argument("--offload-dir", help="directory for the disk tier's expert file (default: a cache dir; "
                   "a GGUF file is read in place and only caches go there)")
    p.add_argument("--offload-bandwidth", help="cap the slow tier's read rate, e.g. 200MB/s (an emulation of a slower link)")
    p.add_argument("--device-memory", help="device budget for weights, KV cache and experts, e.g. 512MiB, 24G "
                   "(K/M/G/T are binary: 24G = 24GiB; kB/MB/GB are decimal); or 30%%: non-expert weights + KV cache "
                   "+ 30%% of all expert bytes")
    add_memory_limit_arg(p)
    p.add_argument("--max-model-len", type=int, help="KV positions reserved per sequence (default: model's, at most 2048)")
    p.add_argument("--gamma", type=int,
                   help=f"draft tokens in every speculative step (specmoe; default: {EngineConfig.gamma} in the first, "
                   "then chosen each step from measured acceptance and pass times, down to plain decoding where "
                   "drafts do not pay)")
    p.add_argument("--draft-experts", type=int, help="draft experts per MoE block (specmoe; default from the budget)")
    p.add_argument("--draft-set", default="temporal-hot", help="temporal-hot | global-hot | random")
    p.add_argument("--substitution", default="affinity", help="affinity | random")
    p.add_argument("--draft-compute", default="device", help="device | host")
    p.add_argument("--draft-quant", default="auto",
                   help="auto (each expert's precision chosen under --draft-memory, which a --device-memory "
                   "budget plans by default; without one int8, else int4 copies of every expert where they fit) | "
                   "none (the paper's draft) | int8 | int4 | int3 | int2 (with "
                   "--draft-memory: that precision only, for the experts it holds)")
    p.add_argument("--draft-memory", help="device bytes the draft may hold, e.g. 400MiB, or a share of the device "
                   "budget, e.g. 20%%: quantized copies and full-precision draft experts chosen expert by expert "
                   "from how often each is picked; auto: the split with verification's pool predicted fastest for "
                   "this batch size (specmoe; default: auto under --device-memory unless --draft-quant or "
                   "--draft-experts fixes the draft, else --draft-quant's rule)")
    p.add_argument("--draft-dense", default=EngineConfig.draft_dense,
                   help="none (default: the compute dtype) | bfloat16 | auto (bfloat16 where a start-up probe finds "
                   "this CPU multiplies it faster): the draft's attention projections and LM head in bfloat16, kept "
                   "so where the checkpoint stores them so (specmoe)")
    p.add_argument("--cache-fraction", type=float, default=0.1, help="share of each block kept resident (caching)")
    p.add_argument("--trace", help="write a per-step routing/timing trace (JSON lines) to FILE")


def add_memory_limit_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--memory-limit", help="CPU only, instead of --device-memory: the whole process's memory, e.g. "
                   "16GiB, or 50%% of this machine's; the device budget is what is left after what the process "
                   "holds before loading weights (measured), a step's activations, the tier's buffers and the "
                   "allocator's slack")


def engine_options(args, max_batch_size: int) -> dict:
    return dict(
        device=args.device, dtype=args.dtype, policy=args.policy, offload=args.offload,
        offload_dir=args.offload_dir, offload_bandwidth=args.offload_bandwidth,
        device_memory=args.device_memory, memory_limit=args.memory_limit, max_batch_size=max_batch_size, max_model_len=args.max_model_len,
        gamma=EngineConfig.gamma if args.gamma is None else args.gamma, adapt_gamma=args.gamma is None,
        draft_experts=args.draft_experts, draft_set=args.draft_set,
        substitution=args.substitution, draft_compute=args.draft_compute, draft_quant=args.draft_quant,
        draft_dense=args.draft_dense, draft_memory=args.draft_memory,
        cache_fraction=args.cache_fraction, trace=args.trace, threads=args.threads,
    )


def sampling_params(args) -> SamplingParams:
    """The SamplingParams of `specmoe generate`'s flags."""
    return SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        seed=args.seed, stop=tuple(args.stop or ()), ignore_eos=args.ignore_eos,
    )


def open_output(path: str | None):
    """--output FILE: a text file to write JSON lines to (None: a context yielding None)."""
    if path is None:
        return contextlib.nullcontext(None)
    try:
        return open(path, "w", encoding="utf-8")
    except OSError as exc:
        raise SpecMoEError(f"--output {path}: cannot write there ({exc.strerror})") from None


def write_record(file, index: int, prompt, output) -> None:
    """One line of --output: the prompt's place in the input, the prompt, its output."""
    file.write(json.dumps({"index": index, "prompt": prompt, **output.summary()}) + "\n")
    file.flush()  # a reader (or a crash) sees every finished line
