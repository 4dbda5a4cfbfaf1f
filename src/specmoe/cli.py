"""The `specmoe` command line: generate, info, bench, simulate, calibrate, serve.

Every user-fixable problem ends as one line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from pathlib import Path

from .errors import SpecMoEError

# Feature modules that add their own subcommand with `register(subparsers)`.
SUBCOMMAND_MODULES = (
    "specmoe.bench.command",
    "specmoe.perf.simulate",
    "specmoe.perf.calibrate",
    "specmoe.perf.replay",
    "specmoe.server.command",
)


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors (no usage dump), exit status 2."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="Hugging Face model directory (default: the bundled demo model)")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda (default auto)")
    p.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16 | float16")
    p.add_argument("--threads", type=int, help="CPU compute threads (default: half the cores)")


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Flags that choose the policy and the memory/tier setting."""
    add_model_args(p)
    p.add_argument("--policy", default="resident", help="resident | ondemand | overlap | caching | host | specmoe | auto")
    p.add_argument("--offload", default="disk", help="where offloaded experts live: disk | host (default disk)")
    p.add_argument("--offload-dir", help="directory for the disk tier's expert file (default: a cache dir)")
    p.add_argument("--offload-bandwidth", help="cap the slow tier's read rate, e.g. 200MB/s (an emulation of a slower link)")
    p.add_argument("--device-memory", help="device budget for weights, KV cache and experts, e.g. 512MiB, 2GiB; "
                   "or 30%%: non-expert weights + KV cache + 30%% of all expert bytes")
    p.add_argument("--max-model-len", type=int, help="KV positions reserved per sequence (default: model's, at most 2048)")
    p.add_argument("--gamma", type=int, default=5, help="draft tokens per speculative step (specmoe)")
    p.add_argument("--draft-experts", type=int, help="draft experts per MoE block (specmoe; default from the budget)")
    p.add_argument("--draft-set", default="temporal-hot", help="temporal-hot | global-hot | random")
    p.add_argument("--substitution", default="affinity", help="affinity | random")
    p.add_argument("--draft-compute", default="device", help="device | host")
    p.add_argument("--draft-quant", default="auto",
                   help="auto (int8, else int4 copies of every expert where they fit) | none (the paper's draft) | int8 | int4 | int3")
    p.add_argument("--cache-fraction", type=float, default=0.1, help="share of each block kept resident (caching)")
    p.add_argument("--trace", help="write a per-step routing/timing trace (JSON lines) to FILE")


def engine_options(args, max_batch_size: int) -> dict:
    return dict(
        device=args.device, dtype=args.dtype, policy=args.policy, offload=args.offload,
        offload_dir=args.offload_dir, offload_bandwidth=args.offload_bandwidth,
        device_memory=args.device_memory, max_batch_size=max_batch_size, max_model_len=args.max_model_len,
        gamma=args.gamma, draft_experts=args.draft_experts, draft_set=args.draft_set,
        substitution=args.substitution, draft_compute=args.draft_compute, draft_quant=args.draft_quant,
        cache_fraction=args.cache_fraction, trace=args.trace, threads=args.threads,
    )


# --- generate --------------------------------------------------------------------------------


def read_prompts_file(path: str) -> list:
    p = Path(path)
    if not p.is_file():
        raise SpecMoEError(f"--prompts-file {path}: no such file")
    prompts = []
    for n, line in enumerate(p.read_text().splitlines(), 1):
        if not line.strip():
            continue
        if p.suffix == ".jsonl":
            try:
                obj = json.loads(line)
            except ValueError:
                raise SpecMoEError(f"{path}:{n}: not a JSON object; each line must be {{\"prompt\": ...}}") from None
            if "prompt_token_ids" in obj:
                prompts.append(obj["prompt_token_ids"])
            elif "prompt" in obj:
                prompts.append(obj["prompt"])
            else:
                raise SpecMoEError(f"{path}:{n}: needs a \"prompt\" or \"prompt_token_ids\" field")
        else:
            prompts.append(line)
    if not prompts:
        raise SpecMoEError(f"--prompts-file {path} holds no prompts")
    return prompts


def cmd_generate(args) -> int:
    from .engine.sampling import SamplingParams
    from .llm import LLM

    prompts = list(args.prompt)
    if args.prompts_file:
        prompts += read_prompts_file(args.prompts_file)
    if not prompts:
        raise SpecMoEError("no prompt given: pass PROMPT arguments or --prompts-file FILE")
    if args.num_prompts:
        prompts = prompts[: args.num_prompts]
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        seed=args.seed, stop=tuple(args.stop or ()), ignore_eos=args.ignore_eos,
    )
    batch = args.batch_size or len(prompts)
    llm = LLM(model=args.model, **engine_options(args, max_batch_size=batch))
    with _progress(enabled=not args.json and sys.stderr.isatty(), total=len(prompts) * args.max_tokens) as tick:
        outputs = llm.generate(prompts, params, progress=lambda: tick(llm))
    stats = llm.last_stats
    if args.json:
        json.dump(
            {"stats": stats, "outputs": [
                {"text": o.text, "token_ids": o.token_ids, "finish_reason": o.finish_reason} for o in outputs
            ]},
            sys.stdout,
        )
        sys.stdout.write("\n")
    else:
        for prompt, out in zip(prompts, outputs):
            shown = prompt if isinstance(prompt, str) else ""
            print(shown + (out.text if llm.tokenizer else " ".join(map(str, out.token_ids))))
            print()
        print(_stats_line(stats), file=sys.stderr)
    llm.close()
    return 0


def _stats_line(s: dict) -> str:
    parts = [
        f"{s['policy']}", f"{s['generated_tokens']} tokens", f"{s['decode_tokens_per_s']:.1f} tok/s decode",
        f"{s['tokens_per_step']:.2f} tokens/step", f"{s['transfer_bytes_per_token'] / 1e6:.2f} MB moved/token",
    ]
    return "specmoe: " + ", ".join(parts)


class _progress:
    """A rich progress bar over generated tokens, on stderr, only on a terminal."""

    def __init__(self, enabled: bool, total: int):
        self.enabled, self.total, self.bar = enabled, total, None

    def __enter__(self):
        if not self.enabled:
            return lambda llm: None
        from rich.progress import Progress

        self.bar = Progress(transient=True)
        self.bar.start()
        task = self.bar.add_task("generating", total=self.total)

        def tick(llm):
            done = sum(len(s.output_ids) for s in llm.engine.scheduler.running)
            self.bar.update(task, completed=llm.engine.counters.decode_tokens + done)

        return tick

    def __exit__(self, *exc):
        if self.bar:
            self.bar.stop()


# --- info ----------------------------------------------------------------------------------


def cmd_info(args) -> int:
    from .info import model_info, render_info

    info = model_info(args.model, device_memory=args.device_memory, dtype=args.dtype,
                      batch_size=args.batch_size, max_model_len=args.max_model_len, draft_quant=args.draft_quant)
    if args.json:
        print(json.dumps(info))
    else:
        render_info(info)
    return 0


# --- the parser ------------------------------------------------------------------------------


def build_parser() -> Parser:
    parser = Parser(prog="specmoe", description="Offloaded MoE inference with self-assisted speculative decoding.")
    sub = parser.add_subparsers(dest="command", parser_class=Parser, required=True)

    g = sub.add_parser("generate", help="generate continuations of prompts")
    g.add_argument("prompt", nargs="*", help="prompt text (several allowed)")
    g.add_argument("--prompts-file", help="text file (one prompt a line) or .jsonl with prompt / prompt_token_ids")
    g.add_argument("--num-prompts", type=int, help="use only the first N prompts")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int)
    g.add_argument("--stop", action="append", help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--batch-size", type=int, help="sequences decoded together (default: all prompts)")
    g.add_argument("--json", action="store_true", help="print one JSON object {stats, outputs} and nothing else")
    add_engine_args(g)
    g.set_defaults(func=cmd_generate)

    i = sub.add_parser("info", help="describe a model: shape, bytes, what fits in a device budget")
    add_model_args(i)
    i.add_argument("--device-memory", help="report what fits in this budget, e.g. 512MiB")
    i.add_argument("--batch-size", type=int, default=16, help="sequences whose KV cache the budget must hold")
    i.add_argument("--max-model-len", type=int, help="KV positions per sequence (default: model's, at most 2048)")
    i.add_argument("--draft-quant", help="also report per-block quantization error of int8 | int4 | int3 draft copies")
    i.add_argument("--json", action="store_true")
    i.set_defaults(func=cmd_info)

    for name in SUBCOMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name and exc.name.startswith("specmoe"):
                continue  # that feature is not part of this build
            raise
        module.register(sub)
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except SpecMoEError as exc:
        print(f"specmoe: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("specmoe: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
