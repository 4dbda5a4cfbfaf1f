"""What BENCHMARKS.md's sections are made of: the commands that measure one (`Run`) and
the section itself, rendered from their documents (`Section`; the list: sections.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

BENCH_SMOKE = "--repeats 1 --max-tokens 4 --threads 1"  # every smoke command's reduced run
# the real-size benchmark model, written where a section's runs read it (and its smoke-sized cousin)
REAL_SIZE_MODEL = "python benchmarks/real_size_model.py {out}/real-size-k8-m16 --keep"
REAL_SIZE_SMOKE_MODEL = ("python benchmarks/real_size_model.py {out}/real-size-k2-m2 --hidden-factor 2 "
                         "--expert-factor 2 --keep")


def run_options(tokens: int, prompt_batches: int = 1, repeats: int = 1) -> str:
    """The options of a section's one-thread bench run (one timed repeat unless a goal
    needs the spread of several)."""
    return f"--repeats {repeats} --max-tokens {tokens} --prompt-batches {prompt_batches} --threads 1"


def ablation_run(tokens: int, prompt_batches: int = 1, repeats: int = 1) -> str:
    """An ablation's run options: one thread, no anchors beside it."""
    return f"{run_options(tokens, prompt_batches, repeats)} --anchors none"


def real_size_run(prompt_batches: int = 1) -> str:
    """The real-size runs' options. 64 tokens: room for several steps of the default gamma; one
    batch of prompts per run keeps the real-size section near 45 minutes on 2 cores (ondemand
    alone takes a quarter of an hour at B = 16)."""
    return run_options(64, prompt_batches)


@dataclass(frozen=True)
class Run:
    output: str  # file name in the results dir
    command: str  # {out}: the results dir
    smoke: str  # the same path in seconds, to prove the command works


@dataclass(frozen=True)
class Section:
    name: str  # marker name in BENCHMARKS.md
    title: str
    about: str
    runs: tuple[Run, ...]
    render: Callable[[dict[str, dict]], str]  # {output: document} -> markdown
