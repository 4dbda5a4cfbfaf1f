"""Markdown tables for BENCHMARKS.md sections, each made from one saved JSON document:
a `specmoe bench` run (its breakdown and `auto` tables; the main tables are report.py's),
`specmoe simulate`, `specmoe calibrate` and the scripts under benchmarks/.

Every figure printed here is read from, or computed from, the document it is given.
"""

from __future__ import annotations

from .goals import Verdict, interleaved, judge_records, ratio_interval
from .report import md_table


def _f(v, fmt="{:.1f}", none="–"):
    return none if v is None else fmt.format(v)


# --- a bench run -------------------------------------------------------------------------------------


def breakdown(doc: dict, batch: int) -> str:
    """Where the time of each policy went at one batch size (median repeat)."""
    rows = [[r["policy"], _f(r["decode_tokens_per_s"]), _f(r.get("transfer_bytes_per_token", 0) / 1e6, "{:.2f}"),
             _f(r.get("transfer_wait_s") if r["policy"] != "resident" else None, "{:.2f}"),
             _f(r.get("compute_s"), "{:.2f}"), _f(r.get("decode_s"), "{:.2f}")]
            for r in doc["records"] if r["batch_size"] == batch and not r.get("skipped") and r["policy"] != "auto"]
    if not rows:
        return f"(no records at B = {batch})\n"
    return md_table(["policy", "tok/s", "MB/token", "transfer_wait_s", "compute_s", "decode_s"], rows) + "\n"


AUTO_GOAL = 0.95  # auto's measured tokens/s over the best fixed policy's, at every batch size (#37)


def auto_points(doc: dict) -> tuple[list[str], list[tuple[int, dict, dict[str, float], str, float, Verdict]]]:
    """(the fixed offloading policies that ran, [(B, auto's record, each fixed policy's tok/s,
    the best of them, auto / best, the goal's verdict by goals.py's rule)] for each batch
    size where auto and one of them ran)."""
    fixed = [p for p in ("ondemand", "overlap", "caching", "host", "specmoe")
             if any(r["policy"] == p for r in doc["records"])]
    points = []
    for b in sorted({r["batch_size"] for r in doc["records"]}):
        at = {r["policy"]: r for r in doc["records"] if r["batch_size"] == b and not r.get("skipped")}
        auto = at.get("auto")
        speeds = {p: at[p]["decode_tokens_per_s"] for p in fixed if p in at}
        if auto is None or not speeds:
            continue
        best = max(speeds, key=speeds.get)
        verdict = judge_records(auto, at[best], AUTO_GOAL, interleaved(doc, f"B={b}"))
        points.append((b, auto, speeds, best, auto["decode_tokens_per_s"] / speeds[best], verdict))
    return fixed, points


def auto_against_fixed(doc: dict) -> str:
    """Per batch size: every fixed offloading policy, `auto` with its plan, auto / best fixed,
    its interval over the repeats and whether that meets AUTO_GOAL (goals.py's rule)."""
    fixed, points = auto_points(doc)
    rows = []
    for b, auto, speeds, best, ratio, verdict in points:
        plan = f"{auto['decode_tokens_per_s']:.1f} ({auto.get('auto_plan')}; final γ {auto.get('gamma')})"
        low, high, repeats = ratio_interval(auto, next(r for r in doc["records"]
                                                       if r["batch_size"] == b and r["policy"] == best))
        rows.append([str(b), *[(f"**{speeds[p]:.1f}**" if p == best else _f(speeds.get(p))) for p in fixed], plan,
                     f"{ratio:.2f}", f"{low:.2f}-{high:.2f} ({repeats})", str(verdict)])
    if not rows:
        return "(auto did not run)\n"
    return md_table(["B", *fixed, "auto (its plan; final γ)", "auto / best fixed", "range over repeats (how many)",
                     f"goal ≥ {AUTO_GOAL}"], rows) + "\n"


# --- benchmarks/quant_ablation.py --------------------------------------------------------------------


def quant_ablation(doc: dict) -> str:
    c, modes = doc["config"], doc["modes"]
    rows = [[mode, str(m["draft_experts"]), f"{m['tokens_per_step']:.3f}", f"{m['decode_tokens_per_s']:.1f}",
             f"{m['acceptance_rate']:.3f}", _f(m.get("draft_target_agreement"), "{:.3f}"),
             f"{m['transfer_bytes_per_token'] / 2**20:.2f}", "yes" if m["exact"] else "NO"] for mode, m in modes.items()]
    out = [f"Budget {c['budget'] / 2**20:.1f} MiB (non-expert + KV for {c['batch_size']} x {c['max_model_len']} "
           f"positions + {c['expert_fraction']:.0%} of experts), {c['offload']} tier capped at "
           f"{c['rate'] / 2**20:.0f} MiB/s (one sweep over all experts in {c['sweep_s']:g} s: an emulation), "
           f"B = {c['batch_size']}, {c['num_prompts']} prompts x {c['max_tokens']} tokens, γ = {c['gamma']}, greedy, "
           f"{c['rounds']} interleaved rounds.", "",
           md_table(["draft", "full-precision N", "tokens/step", "decode tok/s", "acceptance", "agreement",
                      "MiB moved/token", "= resident"], rows), ""]
    if "none" in modes:
        base = modes["none"]
        out += [f"- {mode} / none: {m['tokens_per_step'] / base['tokens_per_step']:.2f}x tokens per step, "
                f"{m['decode_tokens_per_s'] / base['decode_tokens_per_s']:.2f}x decode tokens/s"
                for mode, m in modes.items() if mode != "none"]
    return "\n".join(out) + "\n"


# --- benchmarks/quantized_models.py ------------------------------------------------------------------


def models_speeds(doc: dict) -> str:
    """Each (model, policy)'s speed and expert bytes per token at each batch size, against
    ondemand on the bf16 model (benchmarks/quantized_models.py's and gguf_models.py's)."""
    c, batches = doc["config"], sorted({r["batch_size"] for r in doc["records"]})
    rows = []
    for name in doc["models"]:
        for policy in c["policies"]:
            cells = []
            for b in batches:
                r = next((r for r in doc["records"] if (r["model"], r["policy"], r["batch_size"]) == (name, policy, b)),
                         None)
                cells.append("–" if not r or r.get("skipped") else
                             f"{r['decode_tokens_per_s']:.1f} (×{_f(r.get('vs_ondemand_bf16'), '{:.2f}')}), "
                             f"{r['transfer_bytes_per_token'] / 1e6:.3f} MB")
            rows.append([name, policy, *cells])
    return "\n".join([
        f"Disk tier, {c['dtype']}, γ = {c['gamma']}, {c['max_tokens']} tokens per sequence, {c['batches']} x B "
        f"held-out prompts, median of {c['repeats']} interleaved rounds; every model in the same device memory "
        f"(non-expert + KV + {c['expert_fraction']:.0%} of the bf16 expert bytes). Each cell: decode tokens/s "
        "(× ondemand on the bf16 model at that B), expert bytes moved per generated token.", "",
        md_table(["model", "policy", *[f"B = {b}" for b in batches]], rows)]) + "\n"


def quantized_models(doc: dict) -> str:
    """The demo model and its quantized variants: what an expert is, held-out perplexity,
    what quantizing cost in memory; then each policy's speed and bytes per batch size."""
    models = doc["models"]
    rows = []
    for name, m in models.items():
        q = m.get("quantize")
        peak = "–"
        if q:
            grown, largest = q["peak_rss_growth_bytes"], q["largest_tensor_bytes"]
            peak = f"{grown / 2**20:.2f} MiB = {grown / largest:.2f}x its largest tensor ({largest / 2**20:.1f} MiB)"
        rows.append([name, m["expert_format"], f"{m['expert_bytes'] / 2**10:.1f} KiB", f"{m['perplexity']:.3f}", peak])
    tokens = next(iter(models.values()))["perplexity_tokens"]
    out = [md_table(["model", "experts", "one expert", f"held-out perplexity ({tokens} tokens)",
                     "`specmoe quantize` peak memory"], rows), ""]
    return "\n".join(out + [models_speeds(doc)])


# --- benchmarks/spec_identity.py ---------------------------------------------------------------------


def spec_identity(doc: dict) -> str:
    runs = doc["runs"]
    equal = sum(r["equal"] for r in runs)
    by_batch = sorted({r["batch_size"] for r in runs})
    lines = [f"**{equal}/{len(runs)} runs produced resident's `token_ids_sha256`** ({doc['max_tokens']} tokens, "
             f"B = {', '.join(map(str, by_batch))}, tiers {', '.join(sorted({r['tier'] for r in runs}))})."]
    lines += [f"- differs: B={r['batch_size']} {r['tier']} " + ", ".join(f"{k}={v}" for k, v in r.items()
              if k in ("gamma", "draft_quant", "draft_set", "substitution")) for r in runs if not r["equal"]]
    return "\n".join(lines) + "\n"


# --- benchmarks/load_test.py -------------------------------------------------------------------------


def load_tests(docs: dict[str, dict]) -> str:
    rows = []
    for name, r in docs.items():
        latency = f"{_f(r.get('latency_p50_s'), '{:.2f}')} s / {_f(r.get('latency_p99_s'), '{:.2f}')} s"
        rows.append([name, f"{r['completed']}/{r['requests']}", f"{r['requests_per_s']:.2f}",
                     f"{r['output_tokens_per_s']:.1f}", _f(r.get("speedup_vs_one_at_a_time"), "{:.2f}"), latency,
                     _f(r.get("server_mean_batch")), _f(r.get("server_acceptance_rate"), "{:.2f}")])
    return md_table(["run", "ok", "req/s", "output tok/s", "× one at a time", "p50 / p99 latency", "mean batch",
                      "acceptance"], rows) + "\n"


# --- benchmarks/eval_throughput.py and ui_overhead.py ------------------------------------------------


def eval_throughput(rows: list[dict]) -> str:
    """An evaluation's requests through the engine: one row per (workload, policy, B)."""
    out = [[r["workload"], r["policy"], str(r["batch_size"]), str(r["requests"]), f"{r['requests_per_s']:.2f}",
            f"{r['vs_resident']:.2f}x", f"{r['transfer_bytes_per_request'] / 2**20:.2f}",
            "yes" if r["same_as_resident"] else "NO"] for r in rows]
    return md_table(["workload", "policy", "B", "requests", "requests/s", "× resident", "MiB moved per request",
                     "results = resident's"], out) + "\n"


def ui_overhead(docs: dict[str, dict]) -> str:
    """The same load with the web page closed and open, one row per kind of viewer."""
    rows = [[name, f"{d['rounds']} × {d['requests']} requests × {d['max_tokens']} tokens, concurrency "
             f"{d['concurrency']}", f"{d['closed_tokens_per_s']:.1f}", f"{d['open_tokens_per_s']:.1f}",
             f"{d['open_over_closed']:.3f}", _f(d.get("request_open_over_closed"), "{:.3f}"),
             _f(d.get("events_per_s_per_viewer"))] for name, d in docs.items()]
    return md_table(["viewer", "load", "tok/s closed", "tok/s open", "open / closed", "per-request decode open / closed",
                     "events/s per viewer"], rows) + "\n"


# --- benchmarks/soak.py ------------------------------------------------------------------------------


def soak(doc: dict) -> str:
    """One soak run: what was asked, what came back, latency, and resident memory."""
    asked = ", ".join(f"{kind} {n}" for kind, n in sorted(doc["requests"].items()))
    errors = ", ".join(f"{kind} {n}" for kind, n in sorted(doc["errors"].items())) or "none"
    wall = doc["wall_s"]
    row = [f"{wall / 60:.0f} min" if wall >= 120 else f"{wall:.0f} s", str(doc["concurrency"]), asked, str(doc["served"]), errors,
           f"{_f(doc.get('latency_p50_s'), '{:.2f}')} s / {_f(doc.get('latency_p99_s'), '{:.2f}')} s",
           str(doc["leftover_sequences"]),
           f"{doc['rss_start_mib']:.0f} → {doc['rss_end_mib']:.0f} MiB ({doc['rss_growth_mib']:+.1f})"]
    return md_table(["duration", "concurrency", "requests by kind", "served", "errors by kind",
                     "p50 / p99 latency", "sequences left", "resident memory after warm-up → end"], [row]) + "\n"


# --- specmoe simulate --------------------------------------------------------------------------------


def _speedup(doc: dict, batch: int) -> dict:
    return next(r for r in doc["records"] if r["policy"] == "specmoe" and r["batch_size"] == batch)


def simulate_speedups(docs: dict[str, dict]) -> str:
    """SpecMoE over ondemand at each simulated batch size, one row per simulate run."""
    batches = sorted({b for d in docs.values() for b in d["config"]["batch_sizes"]})
    rows = []
    for name, d in docs.items():
        cells = []
        for b in batches:
            if b not in d["config"]["batch_sizes"]:
                cells.append("–")
                continue
            r = _speedup(d, b)
            cells.append(f"{r['speedup_vs_ondemand']:.2f}x ({r['decode_tokens_per_s']:,.0f} tok/s)")
        c = d["config"]
        rows.append([f"{c['model_shape']} ({name}: γ = {c['gamma']}, N = {c['draft_experts']}, acceptance "
                     f"{c['acceptance']:.2f}, skew {c['skew']})", *cells])
    return md_table(["run", *[f"B = {b}" for b in batches]], rows) + "\n"


def simulate_bytes(docs: dict[str, dict], batch: int) -> str:
    """At one batch size: ondemand's bytes per step and SpecMoE's cut in bytes per token."""
    rows = []
    for name, d in docs.items():
        if batch not in d["config"]["batch_sizes"]:
            continue
        on = next(r for r in d["records"] if r["policy"] == "ondemand" and r["batch_size"] == batch)
        sp = _speedup(d, batch)
        rows.append([name, f"{on['transfer_bytes'] / 1e9:.1f} GB", f"{sp['transfer_bytes_per_token'] / 1e6:,.0f} MB",
                     f"{sp['transfer_bytes_per_token'] / on['transfer_bytes_per_token'] - 1:+.1%}"])
    return md_table(["run", f"ondemand bytes/step, B = {batch}", "specmoe bytes/token",
                      "specmoe vs ondemand bytes/token"], rows) + "\n"


def simulate_policies(doc: dict) -> str:
    """Every policy at every batch size of one simulate run: tokens/s and bytes per token."""
    policies = ["ondemand", "overlap", "caching", "specmoe", "auto"]
    rows = []
    for b in doc["config"]["batch_sizes"]:
        at = {r["policy"]: r for r in doc["records"] if r["batch_size"] == b}
        rows.append([str(b), *[f"{at[p]['decode_tokens_per_s']:,.1f} tok/s, {at[p]['transfer_bytes_per_token'] / 1e9:.3g} GB"
                               + (f" ({at[p]['note'].removeprefix('-> ')})" if p == "auto" and at[p].get("note") else "")
                               for p in policies if p in at]])
    return md_table(["B", *policies], rows) + "\n"


# --- specmoe calibrate ---------------------------------------------------------------------------------


def calibration(doc: dict) -> str:
    m, p = doc["measurements"], doc["profile"]
    items = [("disk read", f"{m['disk_read_bw'] / 1e9:.2f} GB/s ({m.get('disk_method', '?')})"),
             ("disk rate left while computing", _f(m.get("disk_read_overlap"), "{:.2f}")),
             ("memory bandwidth", f"{m['host_mem_bw'] / 1e9:.1f} GB/s"),
             ("fp32 matmul", f"{m['host_matmul_flops_fp32'] / 1e9:.0f} GFLOP/s"),
             ("cost per operator", f"{p['kernel_launch_s'] * 1e6:.1f} µs"),
             ("cost per sequence", f"{p['sequence_overhead_s'] * 1e6:.0f} µs"),
             ("one expert fetch", _f(m.get("engine_fetch_s"), "{:.2f} ms", "–") if m.get("engine_fetch_s") is None
              else f"{m['engine_fetch_s'] * 1e3:.2f} ms ({m['engine_fetch_expert_bytes'] / 2**10:.0f} KiB)"),
             ("engine fit error (rms)", _f(m.get("engine_fit_rms_rel_error"), "{:.0%}"))]
    if "fused_kernels" in doc:
        items.append(("torch's fused CPU kernels (self-check here)", fused_kernels(doc["fused_kernels"])))
    return md_table(["calibrated", "value"], [[k, v] for k, v in items]) + "\n"


def fused_kernels(report: dict[str, str]) -> str:
    """'int8 passed N x K 256x256, 4096x2048; int4 ...', a failing shape with its reason."""
    parts = []
    for kernel in ("int8", "int4"):
        rows = {k.split(" ", 1)[1]: why for k, why in report.items() if k.startswith(kernel + " ")}
        passed = [shape for shape, why in rows.items() if why.startswith("fused")]
        failed = [f"{shape} {why}" for shape, why in rows.items() if not why.startswith("fused")]
        if rows:
            parts.append(f"{kernel}: " + "; ".join(([f"passed {', '.join(passed)}"] if passed else []) + failed))
    return " · ".join(parts)


# --- benchmarks/profile_passes.py --------------------------------------------------------------------

UNIT_NAMES = {"decode": "decode step (resident)", "draft": "draft forward (specmoe)",
              "verify": "verify + accept (specmoe)"}


def _profile_rows(doc: dict) -> dict:
    return {(r["unit"], r["batch_size"]): r for r in doc["rows"]}


def profile_summary(before: dict, after: dict) -> str:
    """Per unit and batch size: thread CPU ms per unit and operators per unit, before and
    after, and the share of time between operators."""
    b_rows, a_rows = _profile_rows(before), _profile_rows(after)
    rows = []
    for key in sorted(a_rows, key=lambda k: (list(UNIT_NAMES).index(k[0]), k[1])):
        a, b = a_rows[key], b_rows.get(key)
        ratio = f"{b['cpu_ms'] / a['cpu_ms']:.2f}x" if b and a["cpu_ms"] else "–"
        rows.append([UNIT_NAMES[key[0]], str(key[1]), _f(b and b["cpu_ms"]), _f(a["cpu_ms"]), ratio,
                     f"{_f(b and b['operators'], '{:.0f}')} → {_f(a['operators'], '{:.0f}')}",
                     f"{_f(b and b.get('outside_share'), '{:.0%}')} → {_f(a.get('outside_share'), '{:.0%}')}"])
    return md_table(["unit", "B", "ms before", "ms after", "faster", "operators", "between operators"], rows) + "\n"


def profile_categories(before: dict, after: dict) -> str:
    """Each category's share of operator time, before → after, per unit and batch size."""
    b_rows, a_rows = _profile_rows(before), _profile_rows(after)
    categories = [c for c in after["categories"]
                  if any(c in r["categories"] for r in list(a_rows.values()) + list(b_rows.values()))]
    rows = []
    for key in sorted(a_rows, key=lambda k: (list(UNIT_NAMES).index(k[0]), k[1])):
        cells = []
        for c in categories:
            was = (b_rows.get(key) or {}).get("categories", {}).get(c, {}).get("share")
            now = a_rows[key]["categories"].get(c, {}).get("share")
            cells.append(f"{_f(was, '{:.0%}')} → {_f(now, '{:.0%}')}")
        rows.append([key[0], str(key[1]), *cells])
    return md_table(["unit", "B", *categories], rows) + "\n"


# --- benchmarks/real_size_runs.py -----------------------------------------------------------------------


def real_size_runs(doc: dict) -> str:
    """Each run's exit status, start-up, wall time, peak anonymous RSS against the CPU bound
    of its budget, the process's own peak, tokens against resident's and the draft's kernels."""
    runs, gib = doc["runs"], 2**30
    reference = runs[0]["token_ids_sha256"]
    rows = []
    for r in runs:
        bound = int(r["device_memory"] * 1.15) + (256 << 20) if r.get("device_memory") else None
        within = "–" if bound is None else ("yes" if r["peak_anon_bytes"] <= bound else "NO")
        kernels = {k.split(" ", 1)[1]: v for k, v in (r.get("fused_kernels") or {}).items()}
        rows.append([r["run"], str(r["exit_status"]), _f(r.get("startup_s"), "{:.0f} s"), _f(r["wall_s"], "{:.0f} s"),
                     f"{r['peak_anon_bytes'] / gib:.2f} GiB", _f(bound and bound / gib, "{:.2f} GiB"), within,
                     _f(r.get("host_peak_bytes") and r["host_peak_bytes"] / gib, "{:.2f} GiB"),
                     _f(r.get("decode_tokens_per_s")),
                     "–" if r is runs[0] else ("yes" if r["token_ids_sha256"] == reference else "NO"),
                     fused_kernels(kernels) if kernels else "–"])
    header = ["run", "exit", "start-up", "wall", "peak anonymous RSS", "bound", "within", "host_peak_bytes",
              "decode tok/s", "tokens = resident's", "fused kernels"]
    first = next((r for r in runs if r["run"] == "specmoe, first run" and r.get("startup_s")), None)
    per_gib = (f" SpecMoE's first start-up: {first['startup_s'] / (doc['expert_bytes'] / gib):.1f} s per GiB of "
               f"experts ({doc['expert_bytes'] / gib:.2f} GiB in bf16).") if first else ""
    return (f"B = {doc['batch_size']}, {doc['max_tokens']} tokens, held-out prompts; bound: 1.15 x the run's budget "
            f"+ 256 MiB.{per_gib}\n\n" + md_table(header, rows) + "\n" + _warm_startup(doc.get("warm_startup"))
            + _startup_against(doc.get("startup_against")))


def _startup_medians(rounds: list[dict], field: str, groups: tuple) -> tuple[dict, dict]:
    """Each group's start-up times (sorted, failed runs left out) and their medians (none if empty)."""
    times = {g: sorted(r["startup_s"] for r in rounds if r[field] == g and r["startup_s"] is not None)
             for g in groups}
    return times, {g: t[len(t) // 2] for g, t in times.items() if t}


WARM_STARTUP_GOAL = 1.5  # SpecMoE's start-up from warm caches at most this many times ondemand's


def warm_ratio(rounds: list[dict] | None) -> tuple[dict, float] | None:
    """(each policy's start-up times, SpecMoE's median over ondemand's); None where no run
    or a failed one."""
    if not rounds:
        return None
    times, median = _startup_medians(rounds, "policy", ("ondemand", "specmoe"))
    if not all(times.values()) or any(r["exit_status"] != 0 for r in rounds):
        return None
    return times, median["specmoe"] / median["ondemand"]


def _warm_startup(rounds: list[dict] | None) -> str:
    """SpecMoE's start-up from warm caches against ondemand's, rounds alternating: medians."""
    if not rounds:
        return ""
    warm = warm_ratio(rounds)
    if warm is None:
        return f"\nStart-up from warm caches: a run failed ({[r['exit_status'] for r in rounds]}).\n"
    times, ratio = warm
    return (f"\nStart-up from warm caches, ondemand and SpecMoE in turn, {len(times['specmoe'])} rounds (4 tokens): "
            f"SpecMoE {', '.join(f'{t:.1f}' for t in times['specmoe'])} s against ondemand's "
            f"{', '.join(f'{t:.1f}' for t in times['ondemand'])} s: {ratio:.2f}x (median against median; goal "
            f"at most {WARM_STARTUP_GOAL}x: {'met' if ratio <= WARM_STARTUP_GOAL else 'not met'}).\n")


def _startup_against(against: dict | None) -> str:
    """SpecMoE's first start-up, this tree's against another revision's, rounds alternating."""
    if not against:
        return ""
    rows, rev = against["rounds"], against["rev"]
    times, median = _startup_medians(rows, "source", ("this tree", rev))
    if not all(times.values()):
        return f"\nStart-up against {rev}: a run failed ({[r['exit_status'] for r in rows]}).\n"
    return (f"\nSpecMoE's first start-up (fresh cache dir), this tree against {rev}, {len(times[rev])} alternating "
            f"rounds: {', '.join(f'{t:.0f}' for t in times['this tree'])} s against "
            f"{', '.join(f'{t:.0f}' for t in times[rev])} s: {median[rev] / median['this tree']:.2f}x as fast "
            f"(median against median). A fresh cache dir includes the fused kernels' one-time self-check.\n")
