"""The policy interface.

A policy decides where routed experts are when a MoE block runs and how they get there.
Every forward pass runs inside a pass scope the engine opens on the policy:

    with policy.pass_scope("verify") as experts:   # begin_pass: the pass's ExpertBackend
        model.forward(tokens, batch, cache, experts)
                                                   # end_pass, when the pass succeeded

Kinds: `prefill`, `decode` (plain), `draft` and `verify` (speculative). A policy that
runs some passes differently (SpecMoE's draft) returns a different backend for them;
no mode flag is read while a block runs. Whether decoding is plain or speculative is
the engine's choice, made from `speculative`.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from functools import cached_property
from typing import Iterator

import torch

from ..base.checkpoint import Checkpoint
from ..base.config import EngineConfig, ModelConfig
from ..experts.budget import DeviceBudget
from ..experts.formats import ExpertFormat, checkpoint_expert_dtype, expert_format
from ..kernels.blockdot import as_stored, computes_as_stored
from ..model.moe import ExpertBackend, Routing

PASS_KINDS = ("prefill", "decode", "draft", "verify")


@dataclass
class Runtime:
    """What every policy may use: the model's shape and checkpoint, the device and its budget."""

    config: ModelConfig
    checkpoint: Checkpoint
    device: torch.device
    dtype: torch.dtype
    budget: DeviceBudget
    options: EngineConfig  # policy-specific knobs live there
    weights: object = None  # the ModelWeights (routers and norms, for policies that predict routing)
    max_model_len: int = 2048  # KV positions reserved per sequence

    @property
    def expert_format(self) -> ExpertFormat:
        """How experts are held and moved: the checkpoint's quantized blobs, or float buffers."""
        return expert_format(self.config, self.dtype, self.device, self.checkpoint_expert_dtype,
                             as_stored(self.options.dtype, self.device))

    @cached_property
    def computes_as_stored(self) -> bool:
        """Whether the engine multiplies this model's weights as stored, on the block kernels'
        threads (kernels/blockdot.py): a draft's int8 / int4 copies then run on them too."""
        return computes_as_stored(self.options.dtype, self.config, self.device)

    @cached_property
    def checkpoint_expert_dtype(self) -> torch.dtype | None:
        return checkpoint_expert_dtype(self.checkpoint)

    @property
    def expert_bytes(self) -> int:
        """What one fetch moves."""
        return self.expert_format.nbytes

    @property
    def slot_bytes(self) -> int:
        """What one expert takes in the device pool."""
        return self.expert_format.slot_bytes

    @property
    def expert_keys(self) -> list[tuple[int, int]]:
        return [(layer, e) for layer in self.config.moe_layer_ids for e in range(self.config.num_experts)]

    @property
    def draft_keys(self) -> list[tuple[int, int]]:
        """The experts of the blocks a draft runs (an encoder-decoder model: the decoder's)."""
        return [(layer, e) for layer in self.config.draft_layer_ids for e in range(self.config.num_experts)]


def reserve_scratch(runtime: Runtime) -> None:
    """A quantized expert is dequantized one matrix at a time where it is computed: room for one."""
    scratch = runtime.expert_format.scratch_bytes(runtime.dtype)
    if scratch:
        runtime.budget.reserve("expert dequantization scratch", scratch)


class Policy:
    name = "base"
    speculative = False

    @classmethod
    def min_slots(cls, config, options) -> int:
        """Device pool slots (experts) the policy needs to run at all."""
        return len(config.moe_layer_ids) * config.num_experts

    @classmethod
    def min_device_bytes(cls, config, options, expert_bytes: int, device, dtype) -> int:
        """Device bytes the policy needs beside the weights and the KV cache to run at all:
        its slots (`expert_bytes` each: a pool slot's size), and the scratch a quantized
        expert dequantizes into."""
        return cls.min_slots(config, options) * expert_bytes + expert_format(config, dtype, device).scratch_bytes(dtype)

    def __init__(self, runtime: Runtime):
        self.runtime = runtime
        self.config = runtime.config

    # --- passes ------------------------------------------------------------------------
    @contextmanager
    def pass_scope(self, kind: str) -> Iterator[ExpertBackend]:
        if kind not in PASS_KINDS:
            raise ValueError(f"unknown pass kind {kind!r}")
        experts = self.begin_pass(kind)
        yield experts
        self.end_pass(kind)

    def begin_pass(self, kind: str) -> ExpertBackend:
        """Prepare a pass; return what runs its MoE blocks (the policy itself by default)."""
        return self

    def end_pass(self, kind: str) -> None:
        pass

    # --- ExpertBackend -----------------------------------------------------------------
    def run_moe(self, layer: int, x: torch.Tensor, routing: Routing) -> torch.Tensor:
        raise NotImplementedError

    def after_layer(self, layer: int, hidden: torch.Tensor) -> None:
        pass

    # --- bookkeeping ---------------------------------------------------------------------
    def draft_sets(self) -> dict[int, list[int]]:
        """The experts a speculative draft uses per block (traces record them)."""
        return {}

    def reset_stats(self) -> None:
        pass

    def moved_bytes(self) -> int:
        """Expert bytes moved into the device so far (the run statistics' transfer_bytes)."""
        return 0

    def stats(self) -> dict:
        """Policy counters merged into the run statistics."""
        return {"transfer_bytes": 0, "cache_hit_rate": 1.0, "fused_kernels": self.fused_kernels()}

    def fused_kernels(self) -> dict[str, str]:
        """Per fused-kernel shape class the experts use: fused or portable, and why (kernels.py)."""
        return {f"experts {key}": why for key, why in self.runtime.expert_format.kernels.items()}

    def close(self) -> None:
        pass
