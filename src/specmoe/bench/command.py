"""`specmoe bench`: the CLI, and the run that ties grid, anchors and ablations together."""

from __future__ import annotations

import json
import shlex
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..base.config import OFFLOAD_TIERS, POLICY_NAMES, EngineConfig, expert_share
from ..base.gguf_checkpoint import open_checkpoint
from ..base.errors import SpecMoEError
from ..base.paths import resolve_model_dir
from ..base.prompts import read_prompts_file
from ..base.units import parse_batch_sizes, parse_rate, parse_size
from ..flags import add_model_args
from ..tools.info import model_info
from . import report, sections
from .ablation import ABLATIONS, CURVE_WAYS, parse_ablations
from .anchors import ANCHORS
from .grid import EXPERT_FRACTION, encode_prompts
from .machine import machine_info
from .plot import write_plot
from .suite import Suite

DEFAULT_POLICIES = ("resident", "ondemand", "overlap", "caching", "specmoe")
DEFAULT_BATCH_SIZES = (1, 4, 16, 64)
QUICK_BATCH_SIZES = (1, 16)
DEFAULT_MAX_TOKENS, QUICK_MAX_TOKENS = 32, 16
DEFAULT_REPEATS, QUICK_REPEATS = 3, 1
BATCHES_PER_RUN = 2  # each run decodes BATCHES_PER_RUN x B prompts (the first ones of the file)
HELDOUT = Path("benchmarks") / "prompts" / "heldout.jsonl"

_PARSER = None  # the bench subparser, to print the exact command back in canonical form


def register(subparsers) -> None:
    global _PARSER

    p = subparsers.add_parser(
        "bench", help="benchmark every policy side by side across batch sizes (table, JSON, plot, BENCHMARKS.md)",
        description="Run every policy on the same model, prompts and device budget across batch sizes, interleaved "
        "(each round in another order) after a warm-up, and report the median of --repeats runs with min/max, ratios to "
        "ondemand measured in the same run, and whether every policy produced resident's tokens (exit status 1 "
        "if not). Default budget: non-expert bytes + the KV cache reserved for the run + 30 % of expert bytes.",
    )
    add_model_args(p)
    p.add_argument("--prompts-file", help=f"prompts (.jsonl with prompt / prompt_token_ids, or text lines); default {HELDOUT}")
    p.add_argument("--policies", help="comma-separated (default resident,ondemand,overlap,caching,specmoe; plus host with --offload host)")
    p.add_argument("--batch-sizes", help="comma-separated batch sizes (default 1,4,16,64; --quick: 1,16)")
    p.add_argument("--offload", default="disk", help="tier of offloaded experts: disk | host (default disk)")
    p.add_argument("--offload-dir", help="directory for the disk tier's expert file (default: the cache dir)")
    p.add_argument("--offload-bandwidth", help="cap the slow tier's read rate, e.g. 200MB/s (an emulation of a slower link)")
    p.add_argument("--device-memory", help="one device budget for every run, e.g. 512MiB; or a share like 50%% "
                   "(non-expert + KV + that share of expert bytes, per batch size; default 30%%)")
    p.add_argument("--prompt-batches", type=int, default=2,
                   help="each run generates for N x B prompts, B at a time (default 2; 1 halves a long run)")
    p.add_argument("--prompts-skip", type=int, default=0,
                   help="start after the file's first N prompts: another sample of the same prompts (default 0)")
    p.add_argument("--max-tokens", type=int, help=f"tokens generated per prompt (default {DEFAULT_MAX_TOKENS}; --quick: {QUICK_MAX_TOKENS})")
    p.add_argument("--repeats", type=int, help=f"timed runs per policy after one warm-up (default {DEFAULT_REPEATS}; --quick: {QUICK_REPEATS})")
    p.add_argument("--gamma", type=int,
                   help=f"draft tokens in every speculative step (default: {EngineConfig.gamma} in the first, then "
                   "chosen each step from measured acceptance and pass times, as `specmoe generate` does)")
    p.add_argument("--draft-experts", type=int, help="draft experts per MoE block (default: from the budget)")
    p.add_argument("--draft-quant", help="specmoe's draft: none (the paper's: resident experts + substitutes) | auto | "
                   "int8 | int4 (quantized copies of every expert); default: the engine's")
    p.add_argument("--quick", action="store_true", help="a small grid for smoke runs: batch sizes 1,16, 16 tokens, 1 repeat")
    p.add_argument("--json", metavar="FILE", help="write machine, config, records, anchors, ablations as JSON")
    p.add_argument("--plot", metavar="FILE.png", help="write a PNG: throughput, bytes moved per token, tokens per step vs gamma")
    p.add_argument("--markdown", metavar="FILE", help="write or update this run's section of FILE (e.g. BENCHMARKS.md)")
    p.add_argument("--markdown-section", help="section name in --markdown FILE (default: from tier, bandwidth and --quick)")
    p.add_argument("--report", metavar="DIR", help="run nothing: rewrite every BENCHMARKS.md section in --markdown FILE "
                   "from the JSON that benchmarks/run_all.py saved in DIR (make bench-report)")
    p.add_argument("--ablation", help=" | ".join(ABLATIONS) + ", comma-separated, or all")
    p.add_argument("--ablation-batch-size", type=int, default=16, help="batch size of the ablations (default 16)")
    p.add_argument("--ablation-gammas", help="the gamma ablation's draft lengths, comma-separated (default 1 to 10, "
                   "16, 24, 32; --quick: 1,3,5,10)")
    p.add_argument("--ablation-draft-memory", help="the draft-memory ablation's draft memories as shares of all "
                   "expert bytes, comma-separated, e.g. 10%%,20%% (default 2%%,5%%,10%%,20%%,40%%; --quick: 5%%,20%%); "
                   "draft-split's as shares of what the budget leaves for experts (default 10%% .. 90%%)")
    p.add_argument("--ablation-draft-ways", help="the draft-memory and draft-split curves' ways to run, "
                   "comma-separated (default every one: " + ", ".join(CURVE_WAYS) + ")")
    p.add_argument("--no-grid", action="store_true", help="run only the ablations, not the policy x batch size grid")
    p.add_argument("--anchors", default="auto", help="auto (every one installed) | none | transformers,llama.cpp")
    p.add_argument("--trace-dir", help="write each run's routing/timing trace to DIR/<policy>-b<B>.jsonl")
    p.set_defaults(func=run_bench)
    _PARSER = p


# --- settings ---------------------------------------------------------------------------------------


@dataclass
class Settings:
    model_dir: str
    prompts_file: str
    policies: list[str]
    batch_sizes: list[int]
    offload: str
    offload_dir: str | None
    offload_bandwidth: str | None
    device_memory: int | None  # one absolute budget; None: the share rule with expert_fraction
    expert_fraction: float
    max_tokens: int
    repeats: int
    gamma: int  # the first step's gamma (every step's where adapt_gamma is False)
    adapt_gamma: bool
    draft_experts: int | None
    draft_quant: str | None
    device: str
    dtype: str
    quick: bool
    ablations: list[str]
    ablation_batch_size: int
    grid: bool
    anchors: list[str]
    trace_dir: str | None
    threads: int | None = None
    prompt_batches: int = 2  # each run generates for prompt_batches x B prompts
    prompts_skip: int = 0  # ... from the file's (prompts_skip + 1)th on
    ablation_gammas: list[int] | None = None  # the gamma ablation's drafts; None: its default list
    ablation_shares: list[float] | None = None  # the draft-memory ablation's points; None: its default list
    ablation_ways: tuple[str, ...] | None = None  # the curves' ways to run; None: every one
    command: str = ""
    notes: list[str] = field(default_factory=list)


def _positive(value, flag) -> int:
    if value is None or isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise SpecMoEError(f"{flag} must be a positive integer, got {value!r}")
    return value


def _non_negative(value, flag) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise SpecMoEError(f"{flag} must be 0 or a positive integer, got {value!r}")
    return value


def parse_policies(text: str | None, offload: str) -> list[str]:
    if text is None:
        return list(DEFAULT_POLICIES) + (["host"] if offload == "host" else [])
    names = list(dict.fromkeys(n.strip() for n in text.split(",") if n.strip()))
    if not names:
        raise SpecMoEError(f"--policies {text!r}: name at least one of: {', '.join(POLICY_NAMES)}")
    for n in names:
        if n not in POLICY_NAMES:
            raise SpecMoEError(f"unknown policy {n!r} in --policies; choose from: {', '.join(POLICY_NAMES)}")
        EngineConfig(policy=n, offload=offload)  # the engine's own checks (host needs --offload host)
    return names


def parse_anchors(text: str) -> list[str]:

    if text == "auto":
        return list(ANCHORS)
    if text == "none":
        return []
    names = [n.strip() for n in text.split(",") if n.strip()]
    for n in names:
        if n not in ANCHORS:
            raise SpecMoEError(f"unknown anchor {n!r} in --anchors; choose from: auto, none, {', '.join(ANCHORS)}")
    return list(dict.fromkeys(names))


def default_prompts_file() -> Path:
    for root in (Path(__file__).resolve().parents[3], Path.cwd()):
        if (root / HELDOUT).is_file():
            return root / HELDOUT
    raise SpecMoEError(f"the held-out prompts ({HELDOUT}) are not found here: pass --prompts-file FILE")


def canonical_command(args) -> str:
    """The command line that reproduces this run: every flag that differs from its default."""
    parts = ["specmoe", "bench"]
    if _PARSER is None:
        return " ".join(parts)
    for action in _PARSER._actions:
        if not action.option_strings or action.dest in ("help",):
            continue
        value = getattr(args, action.dest, None)
        if value is None or value == action.default:
            continue
        flag = action.option_strings[-1] if action.option_strings[-1].startswith("--") else action.option_strings[0]
        if value is True:
            parts.append(flag)
        else:
            parts += [flag, str(value)]
    return shlex.join(parts)


def settings_from_args(args) -> Settings:

    if args.offload not in OFFLOAD_TIERS:
        raise SpecMoEError(f"unknown --offload {args.offload!r}; choose one of: {', '.join(OFFLOAD_TIERS)}")
    policies = parse_policies(args.policies, args.offload)
    quick = bool(args.quick)
    batch_sizes = parse_batch_sizes(args.batch_sizes) if args.batch_sizes else list(QUICK_BATCH_SIZES if quick else DEFAULT_BATCH_SIZES)
    max_tokens = _positive(args.max_tokens if args.max_tokens is not None else (QUICK_MAX_TOKENS if quick else DEFAULT_MAX_TOKENS), "--max-tokens")
    repeats = _positive(args.repeats if args.repeats is not None else (QUICK_REPEATS if quick else DEFAULT_REPEATS), "--repeats")
    adapt_gamma = args.gamma is None
    gamma = EngineConfig.gamma if adapt_gamma else _positive(args.gamma, "--gamma")
    draft_experts = _positive(args.draft_experts, "--draft-experts") if args.draft_experts is not None else None
    if args.threads is not None:
        _positive(args.threads, "--threads")
    ablations = parse_ablations(args.ablation)
    notes = []
    if args.ablation and args.ablation.strip() == "all" and args.offload != "host":
        ablations.remove("draft-compute")
        notes.append("--ablation all: draft-compute skipped (it needs --offload host)")
    if "draft-compute" in ablations and args.offload != "host":
        raise SpecMoEError("--ablation draft-compute compares drafting on the device with drafting on the host where "
                           "the experts live, and needs --offload host")
    if args.ablation_gammas and "gamma" not in ablations:
        raise SpecMoEError("--ablation-gammas sets the gamma ablation's draft lengths: add --ablation gamma")
    if args.ablation_draft_memory and not {"draft-memory", "draft-split"} & set(ablations):
        raise SpecMoEError("--ablation-draft-memory sets the draft-memory and draft-split ablations' points: add "
                           "--ablation draft-memory or draft-split")
    if args.ablation_draft_ways and not {"draft-memory", "draft-split"} & set(ablations):
        raise SpecMoEError("--ablation-draft-ways picks the draft-memory and draft-split curves' ways: add "
                           "--ablation draft-memory or draft-split")
    if args.no_grid and not ablations:
        raise SpecMoEError("--no-grid leaves nothing to run: add --ablation NAME")
    if args.offload_bandwidth is not None:
        parse_rate(args.offload_bandwidth)  # validated now, applied by the engine
    device_memory, fraction = None, EXPERT_FRACTION
    if args.device_memory is not None:
        share = expert_share(args.device_memory)
        if share is None:
            device_memory = parse_size(args.device_memory, "--device-memory")
        else:
            fraction = share
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise SpecMoEError("--plot needs matplotlib: pip install 'specmoe[bench]'") from None
        if not str(args.plot).lower().endswith(".png"):
            raise SpecMoEError(f"--plot {args.plot}: the plot is a PNG; give a file name ending in .png")
    # The engine's own validation, once, so a bad value is one line now, not a skipped row later.
    EngineConfig.from_kwargs(device=args.device, dtype=args.dtype, offload=args.offload, gamma=gamma,
                             draft_experts=draft_experts, threads=args.threads,
                             **({"draft_quant": args.draft_quant} if args.draft_quant is not None else {}))
    model_dir = str(resolve_model_dir(args.model))
    return Settings(
        model_dir=model_dir, prompts_file=str(args.prompts_file or default_prompts_file()), policies=policies,
        batch_sizes=batch_sizes, offload=args.offload, offload_dir=args.offload_dir,
        offload_bandwidth=args.offload_bandwidth, device_memory=device_memory, expert_fraction=fraction,
        max_tokens=max_tokens,
        repeats=repeats, gamma=gamma, adapt_gamma=adapt_gamma, draft_experts=draft_experts, draft_quant=args.draft_quant, device=args.device, dtype=args.dtype,
        quick=quick, ablations=ablations, ablation_batch_size=_positive(args.ablation_batch_size, "--ablation-batch-size"),
        grid=not args.no_grid, anchors=parse_anchors(args.anchors), trace_dir=args.trace_dir, threads=args.threads,
        prompt_batches=_positive(args.prompt_batches, "--prompt-batches"),
        prompts_skip=_non_negative(args.prompts_skip, "--prompts-skip"),
        ablation_gammas=parse_batch_sizes(args.ablation_gammas, "--ablation-gammas") if args.ablation_gammas else None,
        ablation_shares=_shares(args.ablation_draft_memory) if args.ablation_draft_memory else None,
        ablation_ways=_ways(args.ablation_draft_ways) if args.ablation_draft_ways else None,
        command=canonical_command(args), notes=notes,
    )


# --- the run ----------------------------------------------------------------------------------------


def run_bench(args) -> int:
    if args.report:
        return write_report(args)
    settings = settings_from_args(args)  # every flag is checked before anything runs
    before = torch.get_num_threads()
    try:
        return _run_bench(args, settings)
    finally:
        torch.set_num_threads(before)  # the engines set it (--threads); leave the caller's as it was


def _run_bench(args, s: Settings) -> int:

    cfg = open_checkpoint(Path(s.model_dir)).config
    prompts = encode_prompts(read_prompts_file(s.prompts_file), Path(s.model_dir), cfg.vocab_size)
    if s.prompts_skip >= len(prompts):
        raise SpecMoEError(f"--prompts-skip {s.prompts_skip} leaves no prompts: {s.prompts_file} has {len(prompts)}; "
                           "give a smaller number")
    prompts = prompts[s.prompts_skip:]
    info = model_info(s.model_dir, dtype=s.dtype, device=s.device)
    suite = Suite(s, cfg, info, prompts, machine_info())
    start = time.perf_counter()
    with report.Progress(total=suite.planned_runs()) as progress:
        doc = suite.run(progress)
    doc["wall_s"] = time.perf_counter() - start
    report.print_console(doc)
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=1, default=_json_default) + "\n")
        print(f"specmoe bench: wrote {args.json}", file=sys.stderr)
    if args.plot:

        write_plot(doc, args.plot)
        print(f"specmoe bench: wrote {args.plot}", file=sys.stderr)
    if args.markdown:
        section = args.markdown_section or report.default_section(doc["config"])
        report.update_markdown(Path(args.markdown), section, report.markdown(doc, section))
        print(f"specmoe bench: updated section {section!r} of {args.markdown}", file=sys.stderr)
    return 1 if doc["outputs_check"]["mismatches"] else 0


def write_report(args) -> int:
    results = Path(args.report)
    if not args.markdown:
        raise SpecMoEError("--report DIR rewrites a markdown file: add --markdown BENCHMARKS.md")
    if not results.is_dir():
        raise SpecMoEError(f"--report {results}: no such directory; benchmarks/run_all.py --results DIR writes it")
    measured = sections.write_report(results, Path(args.markdown))
    missing = [s.name for s in sections.SECTIONS if s.name not in measured]
    print(f"specmoe bench: rewrote {args.markdown} from {results}: {len(measured)} sections with figures"
          + (f"; not measured yet: {', '.join(missing)}" if missing else ""), file=sys.stderr)
    return 0


def _json_default(obj):
    if isinstance(obj, Path):
        return str(obj)
    if hasattr(obj, "item"):
        return obj.item()
    return str(obj)


def _ways(text: str) -> tuple[str, ...]:
    """--ablation-draft-ways: comma-separated names of the curves' ways."""
    ways = tuple(w.strip() for w in text.split(",") if w.strip())
    unknown = [w for w in ways if w not in CURVE_WAYS]
    if unknown or not ways:
        raise SpecMoEError(f"--ablation-draft-ways {text!r}: {', '.join(unknown) or 'nothing'} is not a way; use some "
                           f"of {', '.join(CURVE_WAYS)}")
    return ways


def _shares(text: str) -> list[float]:
    """--ablation-draft-memory: comma-separated shares of all expert bytes (10% or 0.1)."""
    out = []
    for item in text.split(","):
        item = item.strip()
        try:
            share = float(item[:-1]) / 100 if item.endswith("%") else float(item)
        except ValueError:
            share = -1.0
        if not 0 < share <= 1:
            raise SpecMoEError(f"--ablation-draft-memory {item!r} is not a share of the expert bytes; "
                               "use e.g. 10%,20% or 0.1,0.2")
        out.append(share)
    return out
