"""Engine traces (``--trace FILE``): what the simulator replays and fits.

Format: JSON lines. Line 1 is a header object::

    {"format": "specmoe-trace", "version": 1, "model": {...ModelShape fields...},
     "config": {...engine settings: policy, gamma, draft_experts, batch_size, ...}}

then one :class:`StepRecord` object per engine step. A step is one pass of the model
over ``positions`` positions of ``batch_size`` sequences:

- ``prefill``: prompt positions; ``decode``: one position per sequence (non-speculative
  policies); ``draft``: one draft position per sequence (speculation, resident experts
  only); ``verify``: gamma+1 positions per sequence (last committed token + gamma drafts).
- ``layers``: one :class:`LayerRouting` per MoE layer the pass ran: how many positions
  each expert got (after the router's top-k; for ``draft`` before substitution, i.e. the
  router's own wish), which experts were copied into the device pool during this pass
  (``fetched``) and how many needed experts were already there (``hits``).
- ``accepted_lengths`` (verify only): per sequence, the number of draft tokens accepted
  (0..gamma), not counting the target's own token; tokens gained = accepted + 1.
- ``draft_set`` (draft/verify): layer -> the draft experts resident for that layer.
- ``timings``: ``wall_s``, ``compute_s``, ``transfer_wait_s`` (any subset).
- ``transfer_bytes``: bytes that entered the device pool during this step.

Engine usage::

    with TraceWriter(path, model=shape_or_dict, config={"policy": "specmoe", "gamma": 5}) as tw:
        tw.write(StepRecord(step=i, kind="verify", batch_size=B, positions=B * (g + 1),
                            layers=[LayerRouting(layer=l, expert_tokens={3: 7, 5: 2},
                                                 fetched=[5], hits=1)], ...))
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, is_dataclass
from pathlib import Path

FORMAT = "specmoe-trace"
VERSION = 1
STEP_KINDS = ("prefill", "decode", "draft", "verify")


@dataclass
class LayerRouting:
    layer: int  # model layer index
    expert_tokens: dict[int, int]  # expert id -> number of positions routed to it
    fetched: list[int] = field(default_factory=list)  # experts copied into the pool in this pass
    hits: int = 0  # needed experts that were already in the pool

    @property
    def distinct(self) -> int:
        """Distinct experts this pass needed in this layer."""
        return sum(1 for n in self.expert_tokens.values() if n > 0)

    def to_json(self) -> dict:
        return {"layer": self.layer, "expert_tokens": {str(e): int(n) for e, n in self.expert_tokens.items()},
                "fetched": [int(e) for e in self.fetched], "hits": int(self.hits)}

    @classmethod
    def from_json(cls, d: dict) -> "LayerRouting":
        return cls(layer=int(d["layer"]), expert_tokens={int(e): int(n) for e, n in d["expert_tokens"].items()},
                   fetched=[int(e) for e in d.get("fetched", [])], hits=int(d.get("hits", 0)))


@dataclass
class StepRecord:
    step: int
    kind: str  # "prefill" | "decode" | "draft" | "verify"
    batch_size: int
    positions: int
    layers: list[LayerRouting] = field(default_factory=list)
    accepted_lengths: list[int] = field(default_factory=list)  # verify only
    draft_set: dict[int, list[int]] = field(default_factory=dict)  # layer -> draft experts
    timings: dict[str, float] = field(default_factory=dict)  # wall_s, compute_s, transfer_wait_s
    transfer_bytes: int = 0

    def __post_init__(self) -> None:
        if self.kind not in STEP_KINDS:
            raise ValueError(f"trace step {self.step}: kind must be one of {', '.join(STEP_KINDS)}, got {self.kind!r}")
        if self.batch_size <= 0 or self.positions <= 0:
            raise ValueError(f"trace step {self.step}: batch_size and positions must be positive")

    @property
    def positions_per_sequence(self) -> int:
        return max(1, self.positions // self.batch_size)

    def to_json(self) -> dict:
        return {"step": self.step, "kind": self.kind, "batch_size": self.batch_size, "positions": self.positions,
                "layers": [lr.to_json() for lr in self.layers],
                "accepted_lengths": [int(a) for a in self.accepted_lengths],
                "draft_set": {str(l): [int(e) for e in es] for l, es in self.draft_set.items()},
                "timings": {k: float(v) for k, v in self.timings.items()},
                "transfer_bytes": int(self.transfer_bytes)}

    @classmethod
    def from_json(cls, d: dict) -> "StepRecord":
        return cls(step=int(d["step"]), kind=d["kind"], batch_size=int(d["batch_size"]), positions=int(d["positions"]),
                   layers=[LayerRouting.from_json(x) for x in d.get("layers", [])],
                   accepted_lengths=[int(a) for a in d.get("accepted_lengths", [])],
                   draft_set={int(l): [int(e) for e in es] for l, es in d.get("draft_set", {}).items()},
                   timings={k: float(v) for k, v in d.get("timings", {}).items()},
                   transfer_bytes=int(d.get("transfer_bytes", 0)))


class TraceWriter:
    """Append-only JSON-lines trace; the header is written on open.

    ``model``: a ModelShape (or anything with ``to_dict()``), a dataclass, or a dict."""

    def __init__(self, path: str | os.PathLike, model=None, config: dict | None = None):
        self.path = Path(path)
        if model is not None and hasattr(model, "to_dict"):
            model = model.to_dict()
        elif model is not None and is_dataclass(model):
            model = asdict(model)
        self.header = {"format": FORMAT, "version": VERSION, "model": model or {}, "config": dict(config or {})}
        self._f = None
        self.records_written = 0

    def open(self) -> "TraceWriter":
        if self._f is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._f = open(self.path, "w")
            self._f.write(json.dumps(self.header, default=_jsonable) + "\n")
        return self

    def write(self, record: StepRecord) -> None:
        self.open()
        self._f.write(json.dumps(record.to_json()) + "\n")
        self.records_written += 1

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None

    def __enter__(self) -> "TraceWriter":
        return self.open()

    def __exit__(self, *exc) -> None:
        self.close()


def _jsonable(o):
    if isinstance(o, (tuple, set, frozenset)):
        return list(o)
    if isinstance(o, Path):
        return str(o)
    return str(o)


def read_trace(path: str | os.PathLike) -> tuple[dict, list[StepRecord]]:
    """(header, records). Raises ValueError naming the line on malformed input."""
    p = Path(path)
    try:
        lines = p.read_text().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"cannot read trace {p}: {e}") from None
    if not lines:
        raise ValueError(f"trace {p} is empty")
    try:
        header = json.loads(lines[0])
    except json.JSONDecodeError as e:
        raise ValueError(f"trace {p}: line 1 is not JSON: {e}") from None
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise ValueError(f"trace {p}: line 1 is not a {FORMAT} header")
    version = header.get("version", VERSION)
    if not isinstance(version, int) or isinstance(version, bool):
        raise ValueError(f"trace {p}: line 1: version must be an integer, got {version!r}")
    if version > VERSION:
        raise ValueError(f"trace {p}: version {header['version']} is newer than this specmoe reads ({VERSION})")
    records = []
    for i, line in enumerate(lines[1:], start=2):
        if not line.strip():
            continue
        try:
            records.append(StepRecord.from_json(json.loads(line)))
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
            raise ValueError(f"trace {p}: line {i}: {e}") from None
    return header, records
