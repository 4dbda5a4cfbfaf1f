"""`--plot`: throughput and bytes moved per token vs batch size per policy, and tokens
per step vs gamma (from the gamma ablation when it ran, else specmoe at the measured gamma)."""

from __future__ import annotations

from pathlib import Path

from .draft_memory import draft_memory_columns

MARKERS = {"resident": "s", "ondemand": "o", "overlap": "^", "caching": "D", "host": "v", "specmoe": "*"}


def _series(records, key, scale=1.0):
    by = {}
    for r in records:
        if r.get("skipped") or r.get(key) is None:
            continue
        by.setdefault(r["policy"], []).append((r["batch_size"], r[key] * scale, r))
    return {p: sorted(v, key=lambda t: t[0]) for p, v in by.items()}


def _batch_axis(ax, records) -> None:
    from matplotlib.ticker import NullFormatter, NullLocator

    sizes = sorted({r["batch_size"] for r in records})
    ax.set_xscale("log", base=2)
    if sizes:
        ax.set_xticks(sizes, [str(b) for b in sizes])
        ax.xaxis.set_minor_locator(NullLocator())
        ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel("batch size (sequences)")


def _plain_log_labels(ax) -> None:
    """Log-axis labels as plain numbers (60, not 6 x 10^1)."""
    from matplotlib.ticker import FuncFormatter

    fmt = FuncFormatter(lambda v, _: f"{v:g}")
    ax.yaxis.set_major_formatter(fmt)
    ax.yaxis.set_minor_formatter(fmt)


def write_plot(doc: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = doc["records"]
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
    _throughput(axes[0], records, doc["anchors"])
    _transfer(axes[1], records, doc["config"]["offload"])
    _gamma(axes[2], records, doc["ablations"], doc["config"])
    if not records:
        for ax in axes[:2]:
            ax.cla()
            ax.set_axis_off()
            ax.text(0.5, 0.5, "no policy x batch size grid in this run\n(--no-grid)", ha="center", va="center",
                    transform=ax.transAxes, color="grey")
    fig.suptitle(_title(doc), fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _throughput(ax, records, anchors) -> None:
    for policy, pts in _series(records, "decode_tokens_per_s").items():
        xs = [p[0] for p in pts]
        ys = [p[1] for p in pts]
        lo = [p[1] - p[2]["over_repeats"].get("decode_tokens_per_s", {}).get("min", p[1]) for p in pts]
        hi = [p[2]["over_repeats"].get("decode_tokens_per_s", {}).get("max", p[1]) - p[1] for p in pts]
        ax.errorbar(xs, ys, yerr=[lo, hi], marker=MARKERS.get(policy, "o"), capsize=3, label=policy,
                    linestyle="--" if policy == "resident" else "-")
    for a in anchors:
        if not a.get("skipped") and "batch_size" in a:
            ax.scatter([a["batch_size"]], [a["decode_tokens_per_s"]], marker="x", s=60, color="black", zorder=5)
            ax.annotate(a["anchor"], (a["batch_size"], a["decode_tokens_per_s"]), fontsize=7,
                        xytext=(4, 4), textcoords="offset points")
    _batch_axis(ax, records)
    ax.set_yscale("log")
    _plain_log_labels(ax)
    ax.set_ylabel("decode throughput (tokens/s, log)")
    ax.set_title("Throughput vs batch size (median, min–max bars)")
    ax.grid(True, alpha=0.3)
    if records:
        ax.legend(fontsize=8)


def _transfer(ax, records, offload: str) -> None:
    for policy, pts in _series(records, "transfer_bytes_per_token", 1e-6).items():
        pts = [p for p in pts if p[1] > 0]  # resident moves nothing: no point on a log axis
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=MARKERS.get(policy, "o"), label=policy)
    _batch_axis(ax, records)
    ax.set_yscale("log")
    _plain_log_labels(ax)
    ax.set_ylabel("expert bytes moved per generated token (MB/token, log)")
    ax.set_title(f"Transfer per token ({offload} tier)")
    ax.grid(True, which="both", alpha=0.3)
    if ax.lines:
        ax.legend(fontsize=8)


def _gamma(ax, records, ablations, config) -> None:
    """Tokens per step vs gamma: the gamma ablation when it ran, else the grid's points."""
    gamma = next((e for e in ablations if e["ablation"] == "gamma"), None)
    if gamma:
        _gamma_ablation(ax, gamma)
    else:
        for r in records:
            if r.get("policy") == "specmoe" and not r.get("skipped") and r.get("gamma"):
                ax.scatter([r["gamma"]], [r["tokens_per_step"]], label=f"specmoe, B={r['batch_size']}")
        ax.set_title("Tokens per step at the measured gamma\n(--ablation gamma sweeps it)")
    gmax = max([1] + [ln.get_xdata().max() for ln in ax.lines if len(ln.get_xdata())] + [config.get("gamma", 1)])
    ax.plot([0, gmax], [1, gmax + 1], color="grey", linestyle=":", linewidth=1, label="upper bound (gamma + 1)")
    ax.axhline(1.0, color="grey", linewidth=0.8, label="plain decoding (1)")
    ax.set_xlabel("gamma (draft tokens per step)")
    ax.set_ylabel("tokens per step (per sequence)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")
    ax.title.set_fontsize(10)


def _gamma_ablation(ax, gamma: dict) -> None:
    runs = [r for r in gamma["records"] if not r.get("skipped") and r.get("policy") == "specmoe" and r.get("gamma")]
    pts = sorted((r["gamma"], r["tokens_per_step"]) for r in runs)
    ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="*", label=f"tokens per step (specmoe, B={gamma['batch_size']})")
    ax.set_title("Tokens per step and throughput vs gamma (gamma ablation)")
    thr = sorted((r["gamma"], r["decode_tokens_per_s"]) for r in runs)
    base = next((r for r in gamma["records"] if r.get("policy") == "ondemand" and not r.get("skipped")), None)
    twin = ax.twinx()
    twin.plot([p[0] for p in thr], [p[1] for p in thr], color="tab:purple", linestyle="--", marker=".",
              label="decode tokens/s (specmoe)")
    if base:
        twin.axhline(base["decode_tokens_per_s"], color="tab:orange", linestyle="--", linewidth=1,
                     label="decode tokens/s (ondemand)")
    twin.set_ylabel("decode throughput (tokens/s)")
    tops = [p[1] for p in thr] + ([base["decode_tokens_per_s"]] if base else [])
    twin.set_ylim(0, 1.35 * max(tops + [1.0]))  # headroom: the legends sit at the top
    twin.legend(fontsize=8, loc="center right")


def _title(doc: dict) -> str:
    c, m = doc["config"], doc["machine"]
    model = Path(c["model"]["path"]).name
    budget = (f"{c['expert_fraction'] * 100:g} % of expert bytes + non-expert + KV" if c.get("expert_fraction")
              else "fixed --device-memory")
    return (f"specmoe bench: model {model}, {c['offload']} tier, device budget {budget}, {c['max_tokens']} tokens/prompt, "
            f"median of {c['repeats']} — {m['cpu']} ({m['cores']} cores), {m['date'][:10]}")


WAY_STYLES = {"allocated": ("*", "-", 2.2), "paper": ("x", ":", 1.2)}


def write_draft_memory_plot(docs: list[dict], path: str) -> None:
    """The draft-memory ablation's curves, one column per batch size: tokens per step
    (top) and decode throughput as a multiple of ondemand in the same run (bottom) against
    the draft's bytes as a share of all expert bytes, one line per way of holding them."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curves = draft_memory_columns(docs)
    fig, axes = plt.subplots(2, len(curves), figsize=(5.2 * len(curves), 7.5), squeeze=False)
    for col, (batch, points) in enumerate(curves):
        top, bottom = axes[0][col], axes[1][col]
        for way in dict.fromkeys(w for _, w in sorted(points, key=lambda k: k[1] != "allocated")):
            pts = sorted(((s * 100, r, base) for (s, w), (r, base) in points.items() if w == way),
                         key=lambda p: p[0])
            marker, style, width = WAY_STYLES.get(way, ("o", "--", 1.0))
            top.plot([x for x, _, _ in pts], [r["tokens_per_step"] for _, r, _ in pts], marker=marker,
                     linestyle=style, linewidth=width, label=way)
            timed = [(x, r["decode_tokens_per_s"] / base["decode_tokens_per_s"]) for x, r, base in pts if base]
            if timed:  # each point against the ondemand of its own run
                bottom.plot(*zip(*timed), marker=marker, linestyle=style, linewidth=width, label=way)
        bottom.axhline(1.0, color="grey", linewidth=0.8, label="ondemand")
        top.set_title(f"B = {batch}")
        top.set_ylabel("tokens per step (per sequence)")
        bottom.set_ylabel("decode tok/s ÷ ondemand's (same run)")
        for ax in (top, bottom):
            ax.set_xscale("log")
            ax.set_xticks(sorted({s * 100 for s, _ in points}), [f"{s * 100:g} %" for s in sorted({s for s, _ in points})])
            ax.minorticks_off()
            ax.set_xlabel("draft memory (share of all expert bytes)")
            ax.grid(True, alpha=0.3)
        top.legend(fontsize=8)
    model = Path(docs[0]["config"]["model"]["path"]).name if docs else ""
    fig.suptitle(f"The draft under a memory budget: {model}, {docs[0]['config']['offload']} tier" if docs else "",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
