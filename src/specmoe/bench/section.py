"""What BENCHMARKS.md's sections are made of: the commands that measure one (`Run`) and
the section itself, rendered from their documents (`Section`; the list: sections.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

BENCH_SMOKE = "--repeats 1 --max-tokens 4 --threads 1"  # every smoke command's reduced run


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
