"""The `specmoe` command line: generate, info, bench, simulate, calibrate, replay, serve.

Every problem ends as one line on stderr: exit status 2 for bad input, 1 when the
machine fails (a full or read-only disk, a read error); `--debug` shows the traceback.
"""

from __future__ import annotations

import argparse
import json
import sys

from .api import LLM
from .base.errors import SpecMoEError
from .base.prompts import read_prompts_file
from .bench import command as bench_command
from .distributed import command as replicas_command
from .flags import Parser, add_engine_args, engine_options, open_output, sampling_params, write_record
from .server import command as serve_command
from .tools import calibrate as calibrate_command
from .tools import info as info_command
from .tools import quantize as quantize_command
from .tools import simulate as simulate_command
from .tools.replay import command as replay_command

# Commands that add their own subparser with `register(subparsers)`.
SUBCOMMANDS = (info_command, bench_command, simulate_command, calibrate_command, replay_command, serve_command,
               quantize_command)


# --- generate --------------------------------------------------------------------------------


def cmd_generate(args) -> int:
    prompts = list(args.prompt)
    if args.prompts_file:
        prompts += read_prompts_file(args.prompts_file)
    if not prompts:
        raise SpecMoEError("no prompt given: pass PROMPT arguments or --prompts-file FILE")
    if args.num_prompts:
        prompts = prompts[: args.num_prompts]
    params = sampling_params(args)
    batch = args.batch_size or len(prompts)
    llm = LLM(model=args.model, **engine_options(args, max_batch_size=batch))
    with open_output(args.output) as file:  # opened first: a bad path fails before the run
        with _progress(enabled=not args.json and sys.stderr.isatty(), total=len(prompts) * args.max_tokens) as tick:
            outputs = llm.generate(prompts, params, progress=lambda: tick(llm), src_lang=args.src_lang,
                                   tgt_lang=args.tgt_lang)
        for index, (prompt, out) in enumerate(zip(prompts, outputs)):
            if file:
                write_record(file, index, prompt, out)
    stats = llm.last_stats
    if args.json:
        shown = {} if args.output else {"outputs": [o.summary() for o in outputs]}
        json.dump({"stats": stats, **shown}, sys.stdout)
        sys.stdout.write("\n")
    elif not args.output:
        for prompt, out in zip(prompts, outputs):
            # a translation stands alone; a continuation follows its prompt
            shown = prompt if isinstance(prompt, str) and not llm.config.seq2seq else ""
            print(shown + (out.text if llm.tokenizer else " ".join(map(str, out.token_ids))))
            print()
    if not args.json:
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
    g.add_argument("--src-lang", help="an encoder-decoder (translation) model: the source's language, "
                                      "an NLLB code such as eng_Latn (default: the tokenizer's)")
    g.add_argument("--tgt-lang", help="an encoder-decoder model: the language to translate into, e.g. fra_Latn")
    g.add_argument("--json", action="store_true", help="print one JSON object {stats, outputs} and nothing else")
    g.add_argument("--output", metavar="FILE.jsonl", help="write one JSON line per prompt {index, prompt, text, "
                   "token_ids, finish_reason} to FILE, in prompt order (with --replicas: as results finish)")
    add_engine_args(g)
    g.set_defaults(func=cmd_generate)

    for command in SUBCOMMANDS:
        command.register(sub)
    replicas_command.register(sub.choices["generate"], sub.choices["serve"])  # --replicas N: on Ray
    parser.add_argument("--debug", action="store_true", help="show the traceback of an error")
    for command_parser in sub.choices.values():  # `specmoe generate --debug` works as well
        command_parser.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                                    help="show the traceback of an error")
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.debug:  # the traceback, for a bug report
        return args.func(args)
    try:
        return args.func(args)
    except SpecMoEError as exc:  # bad input: 2; the machine said no (EnvironmentFailure): 1
        print(f"specmoe: error: {exc}", file=sys.stderr)
        return exc.exit_status
    except KeyboardInterrupt:
        print("specmoe: interrupted", file=sys.stderr)
        return 130
    except OSError as exc:  # one not translated where it happened: still one line, naming the file
        where = f"{exc.filename}: " if exc.filename else ""
        print(f"specmoe: error: {where}{(exc.strerror or str(exc)).lower()}", file=sys.stderr)
        return 1
    except Exception as exc:  # a bug: say so in one line; --debug shows where
        print(f"specmoe: internal error: {type(exc).__name__}: {exc} (run again with --debug for the traceback)",
              file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
