"""`--replicas N` for `specmoe generate` and `specmoe serve`: the same commands over N engine
replicas on a Ray cluster. Without `--replicas` both run as before, without Ray."""

from __future__ import annotations

import functools
import itertools
import json
import sys

from ..base.errors import SpecMoEError
from ..base.prompts import iter_prompts_file
from ..flags import engine_options, open_output, sampling_params, write_record
from .offline import ReplicatedLLM

DEFAULT_BATCH = 32  # prompts per chunk and batch of each replica (a streamed file has no known length)


def add_replica_args(p) -> None:
    g = p.add_argument_group("engine replicas on Ray (pip install 'specmoe[ray]')")
    g.add_argument("--replicas", type=int, help="run N engine replicas on a Ray cluster: one per GPU, or a share "
                   "of the CPUs each")
    g.add_argument("--ray-address", help="the Ray cluster to join (e.g. auto, HEAD:6379; default: $RAY_ADDRESS, "
                   "else a local one for this run)")
    g.add_argument("--replica-cpus", type=float, help="CPUs per replica (fractions share a core; default: the "
                   "cluster's CPUs shared out, 1 beside each GPU)")


def register(generate, serve_parser) -> None:
    """Add the replica flags to both commands; with --replicas they run on Ray."""
    for parser, replicated in ((generate, run_generate), (serve_parser, run_serve)):
        add_replica_args(parser)
        parser.set_defaults(func=functools.partial(dispatch, parser.get_default("func"), replicated))


def dispatch(local, replicated, args) -> int:
    if args.replicas is not None:
        return replicated(args)
    if args.ray_address is not None or args.replica_cpus is not None:
        raise SpecMoEError("--ray-address and --replica-cpus place engine replicas: add --replicas N")
    return local(args)


def replica_options(args) -> dict:
    return dict(replicas=args.replicas, replica_cpus=args.replica_cpus, ray_address=args.ray_address)


def run_serve(args) -> int:
    from .serve import run_serve as serve_replicas  # Ray Serve and FastAPI: optional dependencies

    return serve_replicas(args)


# --- specmoe generate --replicas N ------------------------------------------------------------


def prompt_stream(args):
    """The prompts of the command line, then those of --prompts-file, read as needed."""
    prompts = iter(args.prompt)
    if args.prompts_file:
        prompts = itertools.chain(prompts, iter_prompts_file(args.prompts_file))
    elif not args.prompt:
        raise SpecMoEError("no prompt given: pass PROMPT arguments or --prompts-file FILE")
    return itertools.islice(prompts, args.num_prompts) if args.num_prompts else prompts


def run_generate(args) -> int:
    params = sampling_params(args)
    prompts = prompt_stream(args)
    known = args.num_prompts or (None if args.prompts_file else len(args.prompt))
    options = engine_options(args, max_batch_size=args.batch_size or DEFAULT_BATCH)
    collected = []
    with open_output(args.output) as file, ReplicatedLLM(args.model, **replica_options(args), **options) as llm, \
            _progress(not args.json and sys.stderr.isatty(), known) as tick:
        for result in llm.stream(prompts, params, progress=tick):
            if file:
                write_record(file, result.index, result.prompt, result.output)
            elif args.json:
                collected.append(result.output.summary())
            else:
                shown = result.prompt if isinstance(result.prompt, str) else ""
                print(shown + (result.output.text or " ".join(map(str, result.output.token_ids))) + "\n")
        stats = llm.last_stats
    if args.json:
        json.dump({"stats": stats, **({} if file else {"outputs": collected})}, sys.stdout)
        sys.stdout.write("\n")
    else:
        for replica in stats["replicas"]:
            print(f"specmoe: replica {replica['replica']}: " + _stats_line(replica), file=sys.stderr)
        print(f"specmoe: {stats['num_replicas']} replicas: " + _stats_line(stats), file=sys.stderr)
    return 0


def _stats_line(s: dict) -> str:
    if not s.get("num_requests"):
        return "no prompts"
    parts = [
        f"{s['num_requests']} prompts", f"{s['generated_tokens']} tokens in {s['wall_s']:.1f} s",
        f"{s['tokens_per_s']:.1f} tok/s", f"{s['tokens_per_step']:.2f} tokens/step",
        f"{s['transfer_bytes_per_token'] / 1e6:.2f} MB moved/token",
    ]
    if s.get("restarts"):
        parts.append(f"{s['restarts']} restarts")
    return ", ".join(parts)


class _progress:
    """A rich progress bar over finished prompts, on stderr, only on a terminal."""

    def __init__(self, enabled: bool, total: int | None):
        self.enabled, self.total, self.bar = enabled, total, None

    def __enter__(self):
        if not self.enabled:
            return None
        from rich.progress import Progress

        self.bar = Progress(transient=True)
        self.bar.start()
        task = self.bar.add_task("prompts", total=self.total)
        return lambda n: self.bar.advance(task, n)

    def __exit__(self, *exc):
        if self.bar:
            self.bar.stop()
