"""Where the time of a decode step goes: a plain decode step, a draft forward and the
verify part of a speculative step, timed unprofiled and then profiled with torch.profiler.

Units of work (what a row of the table is about):
- `decode`: one plain decode step (resident): its forward pass and its sampling;
- `draft`: one draft forward (one token for each of the B sequences) with its sampling;
- `verify`: the rest of a speculative step: the verify pass over B x (gamma + 1)
  positions, acceptance and the cache roll-back.

Each unit is timed on the thread that computes (thread CPU time, which a loaded machine
changes less than wall time; with one torch thread all compute runs there) and on the wall
clock. A profiled run then records every operator with the Python stack that called it;
each top-level operator's time goes to the category of the code it was called from
(`category_of`). Profiling slows everything down, so its times give shares, never
durations; `outside operators` is the share of a unit's profiled time spent between
operators (Python, and the profiler's own cost), from a run profiled without stacks.
"""

from __future__ import annotations

import contextlib
import importlib
import re
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field

import torch

CATEGORIES = ("attention", "router", "expert matmuls", "expert dispatch", "norms", "LM head", "other model",
              "step setup", "sampling & acceptance", "engine")
UNITS = ("decode", "draft", "verify")
LABEL = "specmoe:"  # the profiler ranges this module opens: specmoe:<unit>
MATMUL_OPS = ("aten::linear", "aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::_grouped_mm",
              "aten::_weight_int4pack_mm_for_cpu", "aten::_weight_int8pack_mm", "blockdot::matmul",
              "blockdot::experts", "blockdot::linear", "blockdot::matmul_bf16")
OPERATORS = ("aten::", "blockdot::")  # torch's operators, and specmoe's block kernels (kernels/blockdot.py)
_FRAME = re.compile(r"specmoe/((?:\w+/)*\w+)\.py\(\d+\): (\w+)")


def is_operator(name: str) -> bool:
    return name.startswith(OPERATORS)


def frames_of(names: list[str]) -> list[tuple[str, str]]:
    """(module path under specmoe/, function) of each specmoe frame among event names."""
    return [(m.group(1), m.group(2)) for m in map(_FRAME.search, names) if m]


def category_of(op: str, frames: list[tuple[str, str]]) -> str:
    """The category of a top-level operator `op` called from `frames` ((module, function)
    pairs of specmoe code, in any order): the first rule that any frame matches."""
    modules = {m for m, _ in frames}
    funcs = {f for _, f in frames}
    if "model/routers" in modules or "route_block" in funcs:
        return "router"
    if modules & {"model/attention", "model/rope"} or funcs & {"write_and_read", "_ring_write_and_read"}:
        return "attention"
    if ("run_moe" in funcs or "swiglu" in funcs
            or modules & {"model/moe", "experts/executor", "experts/quant", "policies/specmoe/draft"}):
        return "expert matmuls" if op in MATMUL_OPS else "expert dispatch"
    if funcs & {"norm", "rms_norm"}:
        return "norms"
    if "logits" in funcs:
        return "LM head"
    if "model/transformer" in modules:
        return "other model"
    if funcs & {"build", "step_batch", "forward_logits", "window_mask"}:
        return "step setup"
    if modules & {"engine/sampling", "engine/acceptance", "engine/speculative"} or "sample_token" in funcs:
        return "sampling & acceptance"
    return "engine"


# --- timing the units on a live engine -------------------------------------------------------------


@dataclass
class UnitClock:
    """Thread CPU and wall seconds per unit, and how many units ran."""

    cpu: dict = field(default_factory=lambda: defaultdict(float))
    wall: dict = field(default_factory=lambda: defaultdict(float))
    count: Counter = field(default_factory=Counter)

    def reset(self) -> None:
        self.cpu.clear()
        self.wall.clear()
        self.count.clear()


KERNELS = ("smk_quantize", "smk_matmul", "smk_experts", "smk_linear", "smk_matmul_f32", "smk_attend", "smk_rms_norm",
           "smk_matmul_bf16")  # the block kernels' entry points that compute (kernels/blockdot.py)


def label_block_kernels(package: str) -> None:
    """Wrap the block kernels' entry points of the specmoe `package` (this tree's, or an
    older one's under another name) so that torch's profiler records each call as a range
    `blockdot::NAME` (it cannot see into a ctypes call). Done here, by the profiling code, so
    that no run outside it pays for the wrapper; once per process."""
    try:
        blockdot = importlib.import_module(package + ".kernels.blockdot")
    except ImportError:
        return  # a revision from before the block kernels
    lib = blockdot.library().lib
    if lib is None or getattr(lib, "_labelled", False):
        return
    for name in KERNELS:
        fn, label = getattr(lib, name), "blockdot::" + name[len("smk_"):]

        def call(*args, fn=fn, label=label):
            if not torch.autograd._profiler_enabled():
                return fn(*args)
            with torch.profiler.record_function(label):
                return fn(*args)
        setattr(lib, name, call)
    lib._labelled = True


class Instrumented:
    """Times the units of one engine and labels them for the profiler, by wrapping the
    engine's own methods on this instance and the block kernels' calls (nothing in the
    package changes)."""

    def __init__(self, engine):
        label_block_kernels(type(engine).__module__.split(".")[0])
        self.engine = engine
        self.clock = UnitClock()
        self.draft_cpu = self.draft_wall = 0.0  # inside the current speculative step
        self.in_draft = False
        self._wrap_decode()
        self._wrap_speculative()

    def _timed(self, unit: str):
        clock, record_function = self.clock, torch.profiler.record_function

        @contextlib.contextmanager
        def scope():
            cpu, wall = time.thread_time(), time.perf_counter()
            with record_function(LABEL + unit):
                yield
            clock.cpu[unit] += time.thread_time() - cpu
            clock.wall[unit] += time.perf_counter() - wall
        return scope()

    def _wrap_decode(self) -> None:
        decode = self.engine._decode

        def timed_decode(seqs):
            with self._timed("decode"):
                out = decode(seqs)
            self.clock.count["decode"] += 1
            return out
        self.engine._decode = timed_decode

    def _wrap_speculative(self) -> None:
        engine = self.engine
        if engine.decoder is None:
            return
        step, pass_scope, forward = engine.decoder.step, engine.pass_scope, engine.forward_logits

        def timed_step(seqs):  # verify = the step less its draft pass
            cpu, wall = self.clock.cpu["draft"], self.clock.wall["draft"]
            with self._timed("verify"):
                out = step(seqs)
            self.clock.cpu["verify"] -= self.clock.cpu["draft"] - cpu
            self.clock.wall["verify"] -= self.clock.wall["draft"] - wall
            self.clock.count["verify"] += 1
            return out

        @contextlib.contextmanager
        def timed_scope(kind):
            if kind != "draft":
                with pass_scope(kind) as experts:
                    yield experts
                return
            self.in_draft = True
            try:
                with self._timed("draft"), pass_scope(kind) as experts:
                    yield experts
            finally:
                self.in_draft = False

        def counted_forward(*args, **kwargs):
            if self.in_draft:
                self.clock.count["draft"] += 1  # a draft unit is one forward
            return forward(*args, **kwargs)

        engine.decoder.step, engine.pass_scope, engine.forward_logits = timed_step, timed_scope, counted_forward


# --- reading a profile ---------------------------------------------------------------------------------


def _ancestors(event):
    parent = event.cpu_parent
    while parent is not None:
        yield parent
        parent = parent.cpu_parent


def _unit_of(names: list[str]) -> str | None:
    """The innermost unit label among ancestor names (draft inside a speculative step wins)."""
    for name in names:
        if name.startswith(LABEL):
            return name[len(LABEL):]
    return None


def operator_shares(events, counts: Counter) -> dict:
    """From a profile with stacks: per unit, top-level operators per unit and each
    category's share of their time. `counts`: units run while profiling."""
    time_by = defaultdict(Counter)
    ops_by = defaultdict(Counter)
    for e in events:
        if not is_operator(e.name):
            continue
        names = [a.name for a in _ancestors(e)]
        if any(map(is_operator, names)):
            continue  # inside another operator: counted with it
        unit = _unit_of(names)
        if unit is None:
            continue
        category = category_of(e.name, frames_of(names))
        time_by[unit][category] += e.cpu_time_total
        ops_by[unit][category] += 1
    out = {}
    for unit, times in time_by.items():
        total = sum(times.values()) or 1.0
        n = max(1, counts.get(unit, 0))
        out[unit] = {"operators": sum(ops_by[unit].values()) / n,
                     "categories": {c: {"share": times[c] / total, "operators": ops_by[unit][c] / n}
                                    for c in CATEGORIES if ops_by[unit][c]}}
    return out


def outside_share(events) -> dict:
    """From a profile without stacks: per unit, the share of its time between operators."""
    spans, inside = Counter(), Counter()
    for e in events:
        names = [a.name for a in _ancestors(e)]
        if e.name.startswith(LABEL):
            spans[e.name[len(LABEL):]] += e.cpu_time_total
            continue
        if is_operator(e.name) and not any(map(is_operator, names)):
            unit = _unit_of(names)
            if unit is not None:
                inside[unit] += e.cpu_time_total
    # verify's range encloses the draft's: take the draft's span and operators out of it
    if "verify" in spans and "draft" in spans:
        spans["verify"] -= spans["draft"]
    return {u: max(0.0, 1 - inside[u] / spans[u]) for u in spans if spans[u] > 0}
