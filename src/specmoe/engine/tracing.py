"""`--trace FILE`: one JSON-lines record per forward pass (prefill, decode, draft, verify)
with each MoE block's router picks (expert -> positions), the experts fetched into the
pool during the pass, accepted lengths, the draft set and timings. The performance
model and `specmoe replay` read these (format: base/trace.py)."""

from __future__ import annotations

import time

import torch

from ..base.trace import LayerRouting, StepRecord, TraceWriter
from ..model.moe import Routing


class RecordingBackend:
    """Wraps a pass's ExpertBackend: notes the router's picks per block, then lets it run them."""

    def __init__(self, kind: str, experts):
        self.kind, self.experts = kind, experts
        self.picks: dict[int, dict[int, int]] = {}

    def run_moe(self, layer: int, x: torch.Tensor, routing: Routing) -> torch.Tensor:
        ids, counts = torch.unique(routing.ids, return_counts=True)
        self.picks[layer] = dict(zip(ids.tolist(), counts.tolist()))
        return self.experts.run_moe(layer, x, routing)

    def after_layer(self, layer: int, hidden: torch.Tensor) -> None:
        self.experts.after_layer(layer, hidden)


class StepTracer:
    def __init__(self, path: str, engine):
        self.policy = engine.policy
        c = engine.config
        model = {"name": str(engine.checkpoint.dir.name), "num_layers": c.num_layers, "moe_layers": list(c.moe_layer_ids),
                 "num_experts": c.num_experts, "top_k": c.top_k, "hidden": c.hidden_size,
                 "expert_intermediate": c.expert_intermediate_size, "expert_bytes": engine.policy.runtime.expert_bytes}
        opts = engine.options
        config = {"policy": opts.policy, "gamma": opts.gamma, "adapt_gamma": opts.adapt_gamma, "offload": opts.offload,
                  "device_memory": opts.device_memory, "max_batch_size": opts.max_batch_size,
                  "device": str(engine.device), "dtype": str(engine.dtype).removeprefix("torch.")}
        self.writer = TraceWriter(path, model=model, config=config).open()
        self.step = 0
        self.last: StepRecord | None = None
        self.backend: RecordingBackend | None = None
        self._opened = False

    def open(self) -> None:
        """A pass scope opens: what the policy fetches when it begins the pass (SpecMoE's
        verify prefetches) counts towards the pass's first forward."""
        self._snapshot()
        self._opened = True

    def wrap(self, kind: str, experts) -> RecordingBackend:
        """The backend a pass of `kind` runs with, recorded."""
        self.backend = RecordingBackend(kind, experts)
        return self.backend

    def begin(self) -> None:
        """A forward of the current pass starts."""
        if not self._opened:
            self._snapshot()
        self._opened = False
        self.backend.picks = {}

    def _snapshot(self) -> None:
        transfer = getattr(self.policy, "transfer", None)
        self._fetched_before = len(transfer.fetched) if transfer else 0
        self._bytes_before = transfer.transfer_bytes if transfer else 0
        self._wait_before = transfer.wait_s if transfer else 0.0
        self._start = time.perf_counter()

    def end(self, batch_size: int, positions: int) -> None:
        wall = time.perf_counter() - self._start
        transfer = getattr(self.policy, "transfer", None)
        fetched = transfer.fetched[self._fetched_before:] if transfer else []
        wait = (transfer.wait_s - self._wait_before) if transfer else 0.0
        layers = []
        for layer, picks in sorted(self.backend.picks.items()):
            got = [e for (l, e) in fetched if l == layer]
            layers.append(LayerRouting(layer, picks, fetched=got, hits=len(set(picks) - set(got))))
        self.last = StepRecord(
            step=self.step, kind=self.backend.kind, batch_size=batch_size, positions=positions,
            layers=layers, draft_set={l: list(es) for l, es in self.policy.draft_sets().items()},
            timings={"wall_s": wall, "transfer_wait_s": wait, "compute_s": wall - wait},
            transfer_bytes=(transfer.transfer_bytes - self._bytes_before) if transfer else 0,
        )
        self.step += 1
        if self.last.kind != "verify":
            self.flush()

    def flush(self, accepted_lengths: list[int] | None = None) -> None:
        if self.last is not None:
            if accepted_lengths is not None:
                self.last.accepted_lengths = list(accepted_lengths)
            self.writer.write(self.last)
            self.last = None

    def close(self) -> None:
        self.flush()
        self.writer.close()
