"""The things a benchmark times, behind one small interface.

A runner is built once (model loaded, expert file written, pool filled) and then `run()`
any number of times on the same prompts; each run returns the run statistics (`LLM.last_stats`) and
the generated token ids. Building is never timed; runs of different runners are
interleaved by `grid.measure`.
"""

from __future__ import annotations

import gc

from ..api import LLM
from ..engine.sampling import SamplingParams


class Runner:
    label: str = ""  # the row name in tables: a policy, an ablation variant, an anchor
    kind: str = "policy"  # "policy" | "anchor"
    fields: dict = {}  # copied into every record of this runner (variant settings, notes)

    def run(self) -> tuple[dict, list[list[int]]]:
        raise NotImplementedError

    def close(self) -> None:
        pass


class PolicyRunner(Runner):
    """One `LLM` with one policy (and its knobs), on fixed token-id prompts."""

    kind = "policy"

    def __init__(self, label: str, model_dir, options: dict, prompts: list[list[int]], params: SamplingParams,
                 fields: dict | None = None):

        self.label = label
        self.options = options
        self.prompts = prompts
        self.params = params
        self.fields = dict(fields or {})
        self.llm = LLM(model=model_dir, **options)

    def run(self) -> tuple[dict, list[list[int]]]:
        self.llm.engine.use_threads()  # runners interleave: the one built last set torch's pool
        outs = self.llm.generate(self.prompts, self.params)
        stats = dict(self.llm.last_stats)
        stats["threads"] = self.llm.engine.threads
        stats["device_memory"] = self.options.get("device_memory")
        stats["max_model_len"] = self.llm.engine.max_model_len
        return stats, [o.token_ids for o in outs]

    def close(self) -> None:
        self.llm.close()
        self.llm = None
        gc.collect()
