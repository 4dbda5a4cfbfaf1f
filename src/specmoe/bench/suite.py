"""One benchmark run: the policy x batch size grid, the anchors in the same rotation, the
ablations, and the document (`--json`) that the table, plot and markdown are made from."""

from __future__ import annotations

import re
from dataclasses import asdict
from pathlib import Path

import torch

from ..base.gguf_checkpoint import open_checkpoint
from ..base.memory import available_bytes
from ..base.units import format_bytes
from ..base.paths import cache_dir
from ..engine.engine import resolve_device, resolve_dtype
from ..engine.sampling import SamplingParams
from ..kernels.cpu import usable_cores
from ..policies.specmoe.policy import WORKING_SLOTS
from . import anchors as anchor_mod
from .ablation import WHAT, variants
from .goals import NOT_INTERLEAVED
from .grid import (
    BUDGET_RULE,
    Builder,
    check_outputs,
    default_budget,
    fit_together,
    held_exact,
    matches_reference,
    max_model_len_for,
    measure,
    prompts_for_batch,
    ratio,
    runner_needs,
    summarize,
    token_agreement,
    tokps,
)
from .runners import PolicyRunner


class Suite:
    def __init__(self, settings, config, info: dict, prompts: list[list[int]], machine: dict):
        self.s = settings
        self.cfg = config
        self.info = info
        self.prompts = prompts
        self.machine = machine
        self.params = SamplingParams(max_tokens=settings.max_tokens, temperature=0.0, ignore_eos=True, seed=0)
        self.notes: list[str] = list(settings.notes)
        self.anchors_ok: list[str] = []
        self.anchor_skips: list[dict] = []
        for name in settings.anchors:
            why = anchor_mod.missing(name)
            if why:
                self.anchor_skips.append({"anchor": name, "skipped": why})
            else:
                self.anchors_ok.append(name)
        if not settings.grid:  # anchors run beside the grid only
            self.anchors_ok, self.anchor_skips = [], []
        self.budgets: dict[int, int] = {}
        self.max_lens: dict[int, int] = {}
        self.traces: list[Path] = []

    # --- plan ---------------------------------------------------------------------------------------

    def anchors_at(self, batch_size: int) -> list[str]:
        return [a for a in self.anchors_ok if anchor_mod.runs_at(a, batch_size)]

    def planned_runs(self) -> int:
        rounds = self.s.repeats + 1
        n = 0
        if self.s.grid:
            n += sum(len(self.s.policies) + len(self.anchors_at(b)) for b in self.s.batch_sizes) * rounds
        for name in self.s.ablations:
            n += (1 + len(variants(name, self.cfg.num_experts, self.s.gamma, self.s.quick, self.s.ablation_gammas,
                                   self.info["expert_bytes_total"], self.s.ablation_shares,
                                   self.s.ablation_ways))) * rounds
        return n

    # --- builders -------------------------------------------------------------------------------------

    def _trace(self, name: str) -> str | None:
        if not self.s.trace_dir:
            return None
        Path(self.s.trace_dir).mkdir(parents=True, exist_ok=True)
        path = Path(self.s.trace_dir) / (re.sub(r"[^A-Za-z0-9_.=-]+", "_", name) + ".jsonl")
        self.traces.append(path)
        return str(path)

    def _options(self, policy: str, batch: int, max_len: int, budget: int | None, trace: str, **over) -> dict:
        s = self.s
        opts = dict(
            device=s.device, dtype=s.dtype, policy=policy, offload=s.offload, offload_dir=s.offload_dir,
            offload_bandwidth=s.offload_bandwidth, device_memory=None if policy == "resident" else budget,
            max_batch_size=batch, max_model_len=max_len, gamma=s.gamma, adapt_gamma=s.adapt_gamma, draft_experts=s.draft_experts,
            trace=self._trace(trace), threads=s.threads,
        )
        if s.draft_quant is not None:
            opts["draft_quant"] = s.draft_quant
        opts.update(over)
        return opts

    def _policy_builder(self, label, policy, prompts, batch, max_len, budget, trace, fields=None, **over) -> Builder:
        opts = self._options(policy, batch, max_len, budget, trace, **over)
        return Builder(label, "policy", lambda: PolicyRunner(label, self.s.model_dir, opts, prompts, self.params, fields),
                       dict(fields or {}))

    def _anchor_builder(self, name, prompts, batch, max_len) -> Builder:

        s = self.s
        device = resolve_device(s.device)
        dtype = resolve_dtype(s.dtype, open_checkpoint(Path(s.model_dir)), device)

        def build():
            if name == "llama.cpp":  # every anchor on as many threads as the engines compute with
                return anchor_mod.LlamaCppRunner(s.model_dir, prompts, batch, s.max_tokens, s.threads or usable_cores(),
                                                 cache_dir())
            return anchor_mod.TransformersRunner(s.model_dir, prompts, batch, s.max_tokens, device, dtype,
                                                 s.threads or usable_cores())
        return Builder(name, "anchor", build)

    def _fit_together(self, needs: dict[str, int], where: str) -> bool:
        """Whether runners holding `needs` bytes of host memory each (label -> bytes) fit side
        by side (then their rounds interleave); if not, a note says they run one after
        another. Only on the host, where a device budget is host memory."""
        available = available_bytes()
        if available is None or resolve_device(self.s.device).type != "cpu":
            return True
        if fit_together(needs, available):
            return True
        self.notes.append(f"{where}: runners built, run and closed one at a time, {NOT_INTERLEAVED} (side by "
                          f"side they would hold {format_bytes(sum(needs.values()))} of the "
                          f"{format_bytes(available)} available)")
        return False

    def _whole_model_bytes(self, batch: int, max_len: int) -> int:
        """Host memory of a runner that holds every weight (resident, the anchors)."""
        info = self.info
        return info["non_expert_bytes"] + info["expert_bytes_total"] + info["kv_bytes_per_token"] * batch * max_len

    def _budget(self, batch: int, max_len: int) -> int:
        return self.s.device_memory or default_budget(self.info, batch, max_len, self.s.expert_fraction)

    # --- the grid ---------------------------------------------------------------------------------------

    def run(self, progress) -> dict:
        s = self.s
        records, anchor_records, ablations = [], [], []
        checked, mismatches = 0, []
        for skip in self.anchor_skips:
            progress.note(skip["skipped"])
        if s.grid:
            for batch in s.batch_sizes:
                recs, anchors, n, bad = self._grid_group(batch, progress)
                records += recs
                anchor_records += anchors
                checked += n
                mismatches += bad
        for name in s.ablations:
            entry, n, bad = self._ablation(name, progress)
            ablations.append(entry)
            checked += n
            mismatches += bad
        if s.trace_dir and not any(p.is_file() for p in self.traces):
            self.notes.append("--trace-dir: no trace was written (this build's engine does not write traces yet)")
        for bad in mismatches:
            progress.note("OUTPUT MISMATCH: " + bad)

        self.machine["torch_threads"] = torch.get_num_threads()  # as the engines set it (--threads)
        self.machine["compute_threads"] = s.threads or usable_cores()  # every engine's, the anchors' too
        return {
            "machine": self.machine,
            "config": self._config(),
            "records": records,
            "anchors": anchor_records + self.anchor_skips,
            "ablations": ablations,
            "outputs_check": {"reference": " and ".join(
                                  ([self._grid_reference()] if s.grid else []) + (["ondemand (ablations)"] if s.ablations else [])),
                              "comparisons": checked,
                              "mismatches": mismatches},
            "notes": self.notes,
        }

    def _grid_reference(self) -> str:
        if "resident" in self.s.policies:
            return "resident (grid)"
        return f"{self.s.policies[0]} (grid; resident did not run)"

    def _grid_group(self, batch: int, progress):
        s = self.s
        prompts = prompts_for_batch(self.prompts, batch, s.prompt_batches)
        max_len = max_model_len_for(prompts, s.max_tokens, s.gamma, self.cfg.max_position_embeddings)
        budget = self._budget(batch, max_len)
        self.budgets[batch], self.max_lens[batch] = budget, max_len
        if len(prompts) < batch * s.prompt_batches:
            self.notes.append(f"B={batch}: the prompts file holds {len(self.prompts)} prompts; runs use all of them "
                              f"(wanted {batch * s.prompt_batches})")
        builders = [self._policy_builder(p, p, prompts, batch, max_len, budget, f"{p}-b{batch}") for p in s.policies]
        builders += [self._anchor_builder(a, prompts, batch, max_len) for a in self.anchors_at(batch)]
        needs = runner_needs([b.label for b in builders], self._whole_model_bytes(batch, max_len), budget)
        together = self._fit_together(needs, f"B={batch}")
        ms = measure(builders, s.repeats, on_run=progress.on_run(f"B={batch}", s.repeats),
                     on_skip=lambda m: progress.note(f"B={batch}: {m.label} skipped: {m.error}"), together=together)
        by = {m.label: m for m in ms}
        ref_label = "resident" if "resident" in by and by["resident"].error is None else next(
            (m.label for m in ms if m.kind == "policy" and m.error is None), None)
        ref = by.get(ref_label)
        if ref_label and ref_label != "resident":
            self.notes.append(f"B={batch}: outputs compared with {ref_label} (resident did not run)")
        n, bad = check_outputs(held_exact(ms, anchor_mod.EXACT), ref_label, f"B={batch}") if ref_label else (0, [])
        recs = []
        for m in ms:
            if m.kind != "policy":
                continue
            rec = summarize(m)
            rec.setdefault("policy", m.label)
            rec["batch_size"] = batch
            rec["outputs_match_resident"] = matches_reference(m, ref)
            recs.append(rec)
        ondemand = next((r for r in recs if r["policy"] == "ondemand"), None)
        for rec in recs:
            rec["ratio_vs_ondemand"] = ratio(tokps(rec), tokps(ondemand))
        resident = next((r for r in recs if r["policy"] == "resident"), None)
        offloading = [r for r in recs if r["policy"] != "resident" and tokps(r) is not None]
        best = max(offloading, key=tokps, default=None)
        anchors = []
        for m in ms:
            if m.kind != "anchor":
                continue
            rec = summarize(m)
            rec["anchor"] = m.label
            rec["batch_size"] = batch
            rec["ratio_vs_specmoe_resident"] = ratio(tokps(rec), tokps(resident))
            rec["best_policy"] = best["policy"] if best else None
            rec["ratio_vs_best_policy"] = ratio(tokps(rec), tokps(best))
            rec["outputs_match_resident"] = matches_reference(m, ref)
            rec["token_agreement_vs_resident"] = token_agreement(m.token_ids, ref.token_ids if ref else None)
            anchors.append(rec)
        return recs, anchors, n, bad

    # --- ablations -----------------------------------------------------------------------------------

    def _ablation(self, name: str, progress):

        s, info = self.s, self.info
        batch = s.ablation_batch_size
        prompts = prompts_for_batch(self.prompts, batch, s.prompt_batches)
        max_len = max_model_len_for(prompts, s.max_tokens, s.gamma, self.cfg.max_position_embeddings)
        base_budget = self._budget(batch, max_len)
        builders = [self._policy_builder("ondemand", "ondemand", prompts, batch, max_len, base_budget,
                                         f"{name}-ondemand-b{batch}", {"variant": "ondemand"})]
        needs = {"ondemand": base_budget}  # host memory each runner holds: its budget
        unit = info["expert_bytes_total"]
        if name == "draft-split":  # what the budget leaves for experts
            unit = base_budget - default_budget(info, batch, max_len, fraction=0.0)  # less non-expert and KV
        for v in variants(name, self.cfg.num_experts, s.gamma, s.quick, s.ablation_gammas, unit, s.ablation_shares,
                          s.ablation_ways):
            gamma = v.options.get("gamma", s.gamma)
            v_len = max_model_len_for(prompts, s.max_tokens, gamma, self.cfg.max_position_embeddings)
            budget = self._budget(batch, v_len)
            fields = {"variant": v.label, **v.fields}
            if "draft_experts" in v.options and s.device_memory is None:
                need = (info["non_expert_bytes"] + info["kv_bytes_per_token"] * batch * v_len
                        + (v.options["draft_experts"] * len(self.cfg.moe_layer_ids) + WORKING_SLOTS) * info["expert_bytes"])
                if need > budget:
                    budget = need
                    fields["budget_raised_to_fit_draft_experts"] = True
            if "draft_memory" in v.options and s.device_memory is None and name == "draft-memory":
                budget += v.options["draft_memory"]  # the same pool for verification at every point
            builders.append(self._policy_builder(v.label, "specmoe", prompts, batch, v_len, budget,
                                                 f"{name}-{v.label}-b{batch}", fields, **v.options))
            needs[v.label] = budget
        where = f"ablation {name}, B={batch}"
        # real-size draft-memory variants each hold a draft beside a full pool: side by side
        # at B = 64 and 40 % they outgrew 24 GiB and the kernel killed the run
        together = self._fit_together(needs, where)
        ms = measure(builders, s.repeats, on_run=progress.on_run(f"{name} B={batch}", s.repeats),
                     on_skip=lambda m: progress.note(f"{where}: {m.label} skipped: {m.error}"), together=together)
        n, bad = check_outputs(ms, "ondemand", where)
        ref = next((m for m in ms if m.label == "ondemand"), None)
        recs = []
        for m in ms:
            rec = summarize(m)
            rec.setdefault("policy", "ondemand" if m.label == "ondemand" else "specmoe")
            rec["batch_size"] = batch
            rec["outputs_match_ondemand"] = matches_reference(m, ref)
            recs.append(rec)
        base = recs[0] if recs and recs[0]["label"] == "ondemand" else None
        for rec in recs:
            rec["ratio_vs_ondemand"] = ratio(tokps(rec), tokps(base))
        return {"ablation": name, "what": WHAT[name], "batch_size": batch, "records": recs}, n, bad

    # --- the config block ----------------------------------------------------------------------------

    def _config(self) -> dict:
        s = self.s
        cfg = {k: v for k, v in asdict(s).items() if k not in ("notes",)}
        info = self.info
        cfg["model"] = {
            "path": s.model_dir, "family": info.get("family"), "moe_layers": info.get("moe_layers"),
            "experts_per_block": info.get("experts_per_block"), "top_k": info.get("top_k"),
            "dtype": info.get("dtype"), "non_expert_bytes": info["non_expert_bytes"],
            "expert_bytes": info["expert_bytes"], "expert_bytes_total": info["expert_bytes_total"],
            "kv_bytes_per_token": info["kv_bytes_per_token"],
        }
        cfg["num_prompts_in_file"] = len(self.prompts)
        cfg["prompts_per_run"] = {str(b): len(prompts_for_batch(self.prompts, b, s.prompt_batches)) for b in s.batch_sizes}
        cfg["sampling"] = {"temperature": 0.0, "ignore_eos": True, "max_tokens": s.max_tokens, "seed": 0}
        cfg["warmup_runs"] = 1
        cfg["budget_rule"] = (f"--device-memory {s.device_memory} bytes for every policy but resident"
                              if s.device_memory else BUDGET_RULE.format(pct=f"{s.expert_fraction * 100:g}"))
        if s.device_memory:
            cfg["expert_fraction"] = None
        cfg["device_memory_by_batch"] = {str(b): v for b, v in self.budgets.items()}
        cfg["max_model_len_by_batch"] = {str(b): v for b, v in self.max_lens.items()}
        cfg["timing"] = ("one LLM per (policy, batch size) built once; 1 warm-up round then --repeats rounds, policies "
                         "interleaved within each round, each round in another order (a Williams design: every runner "
                         "follows every other equally often); records are the median run by decode tokens/s (lower median "
                         "for an even count) with min/median/max over the timed runs; decode tokens/s excludes prefill")
        return cfg
