"""Presenting a benchmark document: progress on stderr, tables on stdout, a markdown section.

The console tables and the markdown tables come from the same row builders, so
BENCHMARKS.md shows exactly what the terminal showed.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from .machine import describe

# --- progress ----------------------------------------------------------------------------------------


class Progress:
    """A rich progress bar over runs on a terminal; one line per run otherwise (logs)."""

    def __init__(self, total: int, stream=None):
        self.total = total
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.done = 0
        self.bar = None

    def __enter__(self):
        if self.tty and self.total:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, SpinnerColumn, TextColumn, TimeElapsedColumn
            from rich.progress import Progress as RichProgress

            self.bar = RichProgress(SpinnerColumn(), TextColumn("[bold]bench[/]"), BarColumn(), MofNCompleteColumn(),
                                    TimeElapsedColumn(), TextColumn("{task.description}"),
                                    console=Console(file=self.stream), transient=True)
            self.bar.start()
            self.task = self.bar.add_task("building", total=self.total)
        return self

    def __exit__(self, *exc):
        if self.bar:
            self.bar.stop()

    def on_run(self, where: str, repeats: int):
        def callback(m, rnd, stats):
            self.done += 1
            what = "warm-up" if rnd == 0 else f"repeat {rnd}/{repeats}"
            text = f"{where} {m.label} {what}: {stats['decode_tokens_per_s']:.1f} tok/s"
            if self.bar:
                self.bar.update(self.task, completed=self.done, description=text)
            else:
                print(f"specmoe bench [{self.done}/{self.total}] {text}", file=self.stream, flush=True)
        return callback

    def note(self, text: str, loud: bool = False) -> None:
        loud = loud or text.startswith("OUTPUT MISMATCH")
        if self.bar:
            self.bar.console.print(f"[bold red]{text}[/]" if loud else text, markup=loud, highlight=False)
        else:
            print(f"specmoe bench: {text}", file=self.stream, flush=True)


# --- cells ---------------------------------------------------------------------------------------------


def _after_skipped(config: dict) -> str:
    skip = config.get("prompts_skip", 0)
    return f" after the file's first {skip}" if skip else ""


def _num(v, fmt="{:.1f}", none="–"):
    return none if v is None else fmt.format(v)


def _spread(rec: dict, key: str, scale: float = 1.0, fmt: str = "{:.1f}") -> str:
    v = rec.get(key)
    if v is None:
        return "–"
    over = (rec.get("over_repeats") or {}).get(key)
    if over and rec.get("repeats", 1) > 1 and over["min"] != over["max"]:
        return f"{fmt.format(over['median'] * scale)} [{fmt.format(over['min'] * scale)}–{fmt.format(over['max'] * scale)}]"
    return fmt.format(v * scale)


def _ratio(v):
    return "–" if v is None else f"{v:.2f}x"


def _same(v):
    return "–" if v is None else ("yes" if v else "NO")


def _ms(v):
    return "–" if v is None else f"{v * 1e3:.1f}"


def _mib(v):
    return "–" if v is None else f"{v / 2**20:.1f}"


MAIN_HEADER = ["B", "policy", "tok/s", "× ondemand", "MB/token", "tok/step", "accept", "TTFT ms", "TBT ms",
               "peak MiB", "= resident"]
LEGEND = ("tok/s: decode tokens/s, median [min–max] over repeats; × ondemand: ratio of medians, same run; "
          "MB/token: expert bytes moved into the device pool per generated token; tok/step: tokens per sequence "
          "per engine step; accept: draft acceptance; TTFT/TBT: mean time to first token / between tokens; "
          "peak MiB: device memory ledger peak; = resident: token_ids_sha256 equal to resident's in every round")


def main_rows(records: list[dict]) -> list[list[str]]:
    rows = []
    for r in records:
        if r.get("skipped"):
            rows.append([str(r["batch_size"]), r["policy"], f"skipped: {r['skipped']}"] + ["–"] * (len(MAIN_HEADER) - 3))
            continue
        acc = r.get("acceptance_rate")
        rows.append([
            str(r["batch_size"]), r["policy"], _spread(r, "decode_tokens_per_s"), _ratio(r.get("ratio_vs_ondemand")),
            _num(r.get("transfer_bytes_per_token", 0) / 1e6, "{:.2f}"), _num(r.get("tokens_per_step"), "{:.2f}"),
            "–" if acc is None else f"{acc:.0%}", _ms(r.get("ttft_s")), _ms(r.get("tbt_s")),
            _mib(r.get("device_peak_bytes")), _same(r.get("outputs_match_resident")),
        ])
    return rows


ANCHOR_HEADER = ["B", "anchor", "tok/s", "end-to-end tok/s", "× resident", "× best offloading policy",
                 "tokens = resident"]


def anchor_rows(anchors: list[dict]) -> list[list[str]]:
    rows = []
    for a in anchors:
        if a.get("skipped") and "batch_size" not in a:
            continue  # not installed: a note, not a row
        if a.get("skipped"):
            rows.append([str(a["batch_size"]), a["anchor"], f"skipped: {a['skipped']}", "–", "–", "–", "–"])
            continue
        best = f"{_ratio(a.get('ratio_vs_best_policy'))} ({a.get('best_policy')})" if a.get("best_policy") else "–"
        agree = a.get("token_agreement_vs_resident")
        rows.append([
            str(a["batch_size"]), f"{a['anchor']} {a.get('version', '')}".strip(), _spread(a, "decode_tokens_per_s"),
            _num(a.get("tokens_per_s_end_to_end")), _ratio(a.get("ratio_vs_specmoe_resident")), best,
            _agreement(agree),
        ])
    return rows


def _agreement(share: float | None) -> str:
    """100% only when every token is equal: one differing token in thousands shows."""
    if share is None:
        return "–"
    return "100%" if share == 1 else f"{min(share, 0.9999):.2%}"


ABLATION_HEADER = ["variant", "N", "gamma", "tok/s", "× ondemand", "tok/step", "accept", "agree", "MB/token",
                   "= ondemand"]


def ablation_rows(entry: dict) -> list[list[str]]:
    rows = []
    for r in entry["records"]:
        if r.get("skipped"):
            rows.append([r["label"], "–", "–", f"skipped: {r['skipped']}"] + ["–"] * 6)
            continue
        acc, agree = r.get("acceptance_rate"), r.get("draft_target_agreement")
        label = r["label"] + (" (budget raised)" if r.get("budget_raised_to_fit_draft_experts") else "")
        rows.append([
            label, _num(r.get("draft_experts"), "{}"), _num(r.get("gamma"), "{}"), _spread(r, "decode_tokens_per_s"),
            _ratio(r.get("ratio_vs_ondemand")), _num(r.get("tokens_per_step"), "{:.2f}"),
            "–" if acc is None else f"{acc:.0%}", "–" if agree is None else f"{agree:.2f}",
            _num(r.get("transfer_bytes_per_token", 0) / 1e6, "{:.2f}"), _same(r.get("outputs_match_ondemand")),
        ])
    return rows


def ratio_lines(records: list[dict]) -> list[str]:
    """Per batch size: specmoe against the baselines, and the best offloading policy."""
    lines = []
    for b in sorted({r["batch_size"] for r in records}):
        at = {r["policy"]: r for r in records if r["batch_size"] == b and not r.get("skipped")}
        offloading = {p: r for p, r in at.items() if p != "resident"}
        if not offloading:
            continue
        best = max(offloading.values(), key=lambda r: r["decode_tokens_per_s"])
        parts = []
        if "specmoe" in at:
            sp = at["specmoe"]["decode_tokens_per_s"]
            vs = [f"{sp / r['decode_tokens_per_s']:.2f}x {p}" for p, r in at.items()
                  if p != "specmoe" and r["decode_tokens_per_s"]]
            moved = [f"{at['specmoe']['transfer_bytes_per_token'] / r['transfer_bytes_per_token']:.0%} of {p}'s bytes/token"
                     for p, r in at.items() if p in ("ondemand", "caching") and r.get("transfer_bytes_per_token")]
            parts.append("specmoe " + ", ".join(vs) + (f"; moves {', '.join(moved)}" if moved else ""))
        parts.append(f"best offloading policy: {best['policy']} ({best['decode_tokens_per_s']:.1f} tok/s)")
        lines.append(f"B={b}: " + "; ".join(parts))
    return lines


def outputs_line(doc: dict) -> str:
    chk = doc["outputs_check"]
    if chk["mismatches"]:
        return (f"OUTPUTS DIFFER: {len(chk['mismatches'])} of {chk['comparisons']} comparisons do not match "
                f"({'; '.join(chk['mismatches'][:3])}{' ...' if len(chk['mismatches']) > 3 else ''})")
    if not chk["comparisons"]:
        return "outputs: nothing to compare (a single policy ran)"
    return (f"outputs: every policy produced the same token ids as {chk['reference']} in every round "
            f"({chk['comparisons']} comparisons of token_ids_sha256, warm-up rounds included)")


def direct_io_line(doc: dict) -> str | None:
    """Whether every disk-tier run read with the page cache bypassed (per run, from its stats)."""
    runs = [r for r in doc["records"] + [r for e in doc["ablations"] for r in e["records"]]
            if r.get("offload_direct") is not None]
    if not runs:
        return None
    buffered = [r for r in runs if not r["offload_direct"]]
    if not buffered:
        return f"disk reads: page cache bypassed (O_DIRECT) in all {len(runs)} disk-tier runs"
    why = sorted({r.get("offload_direct_reason") or "?" for r in buffered})
    return (f"disk reads: BUFFERED in {len(buffered)} of {len(runs)} disk-tier runs ({'; '.join(why)}): "
            "bytes may have come from the page cache, not the disk")


def config_lines(doc: dict) -> list[str]:
    c = doc["config"]
    m = c["model"]
    budgets = ", ".join(f"B={b}: {int(v) / 2**20:.1f} MiB" for b, v in c["device_memory_by_batch"].items())
    tier = c["offload"] + (f" capped at {c['offload_bandwidth']} (emulated)" if c.get("offload_bandwidth") else "")
    apart = any("one at a time" in n for n in doc.get("notes", []))  # grid.measure(together=False): see the notes
    order = "interleaved" + (" where the runners fit side by side" if apart else "")
    return [
        f"machine: {describe(doc['machine'], c.get('threads'))}",
        f"model: {m['path']} ({m['family']}, {m['moe_layers']} MoE layers x {m['experts_per_block']} experts, top-{m['top_k']}, "
        f"{m['dtype']}; non-expert {m['non_expert_bytes'] / 2**20:.1f} MiB, experts {m['expert_bytes_total'] / 2**20:.1f} MiB)",
        f"prompts: {c['prompts_file']} (first {c.get('prompt_batches', 2)} x B of {c['num_prompts_in_file']}"
        f"{_after_skipped(c)}), {c['max_tokens']} tokens each, greedy, EOS ignored; "
        f"tier: {tier}; gamma {c['gamma']}{' first, then chosen each step' if c.get('adapt_gamma') else ''}; {c['repeats']} repeat(s) after 1 warm-up, {order}",
        f"budget: {c['budget_rule']}" + (f" ({budgets})" if budgets else ""),
        *filter(None, [direct_io_line(doc)]),
        f"command: {c['command']}",
    ]


# --- console -------------------------------------------------------------------------------------------


def _table(title, header, rows):
    from rich.markup import escape
    from rich.table import Table

    t = Table(title=escape(title), title_justify="left", header_style="bold")
    for h in header:
        t.add_column(escape(h), overflow="fold")
    for row in rows:
        t.add_row(*(escape(c) if c != "NO" else "[bold red]NO[/]" for c in row))
    return t


def print_console(doc: dict, file=None) -> None:
    from rich.console import Console

    con = Console(file=file or sys.stdout, width=200 if not (file or sys.stdout).isatty() else None)
    for line in config_lines(doc):
        con.print(line, highlight=False, markup=False)
    if doc["records"]:
        con.print(_table("policies x batch sizes", MAIN_HEADER, main_rows(doc["records"])))
    rows = anchor_rows(doc["anchors"])
    if rows:
        con.print(_table("anchors (every weight resident; × resident: ratio to specmoe's resident policy; "
                         "tokens = resident: share of tokens equal to resident's)", ANCHOR_HEADER, rows))
    for entry in doc["ablations"]:
        con.print(_table(f"ablation {entry['ablation']} (B={entry['batch_size']}, N = draft experts per block): {entry['what']}", ABLATION_HEADER,
                         ablation_rows(entry)))
    con.print(LEGEND, highlight=False, markup=False, style="dim")
    for line in ratio_lines(doc["records"]):
        con.print(line, highlight=False, markup=False)
    for a in doc["anchors"]:
        if a.get("skipped") and "batch_size" not in a:
            con.print(a["skipped"], highlight=False, markup=False)
    for note in doc.get("notes", []):
        con.print("note: " + note, highlight=False, markup=False)
    line = outputs_line(doc)
    con.print(f"[bold red]{line}[/]" if doc["outputs_check"]["mismatches"] else line,
              highlight=False, markup=bool(doc["outputs_check"]["mismatches"]))


# --- markdown ------------------------------------------------------------------------------------------


def md_table(header, rows) -> str:
    esc = lambda s: str(s).replace("|", "\\|")  # noqa: E731
    lines = ["| " + " | ".join(map(esc, header)) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(map(esc, r)) + " |" for r in rows]
    return "\n".join(lines)


def default_section(config: dict) -> str:
    name = config["offload"]
    if config.get("offload_bandwidth"):
        name += "-" + re.sub(r"[^A-Za-z0-9.]+", "", str(config["offload_bandwidth"]))
    if config.get("ablations") and not config.get("grid", True):
        name += "-ablations"
    if config.get("quick"):
        name += "-quick"
    return name


def markdown(doc: dict, section: str, heading: bool = True) -> str:
    """The run as a markdown section (`heading=False`: without its title and command, for
    a BENCHMARKS.md section that states them itself)."""
    c = doc["config"]
    out = [f"## `specmoe bench`: {section}", "", f"Regenerate: `{c['command']}`", ""] if heading else []
    out += [f"- {line}" for line in config_lines(doc) if not line.startswith("command:")]
    if doc.get("wall_s"):
        out.append(f"- wall time of the whole run: {doc['wall_s']:.0f} s")
    out.append("")
    if doc["records"]:
        out += ["### Policies x batch sizes", "", md_table(MAIN_HEADER, main_rows(doc["records"])), "", LEGEND + ".", ""]
        ratios = ratio_lines(doc["records"])
        if ratios:
            out += ["Ratios (decode tokens/s, measured in this run):", ""] + [f"- {r}" for r in ratios] + [""]
    rows = anchor_rows(doc["anchors"])
    skipped = [a["skipped"] for a in doc["anchors"] if a.get("skipped") and "batch_size" not in a]
    if rows or skipped:
        out += ["### Anchors", "", "Every weight resident. × resident: ratio to specmoe's resident policy; "
                "tokens = resident: share of generated tokens equal to resident's.", ""]
        if rows:
            out += [md_table(ANCHOR_HEADER, rows), ""]
        out += [f"- {s}" for s in skipped] + ([""] if skipped else [])
    for entry in doc["ablations"]:
        out += [f"### Ablation: {entry['ablation']} (B = {entry['batch_size']})", "", entry["what"] + ".", "",
                md_table(ABLATION_HEADER, ablation_rows(entry)), ""]
    out += [f"- note: {n}" for n in doc.get("notes", [])]
    if doc.get("notes"):
        out.append("")
    out.append(f"**{outputs_line(doc)}**" if doc["outputs_check"]["mismatches"] else outputs_line(doc))
    return "\n".join(out).strip() + "\n"


BEGIN = "<!-- specmoe bench: begin {} -->"
END = "<!-- specmoe bench: end {} -->"


def section_block(text: str, section: str) -> str | None:
    """What the page holds between this section's markers (None: no such section)."""
    begin, end = BEGIN.format(section), END.format(section)
    if begin not in text or end not in text:
        return None
    return text.split(begin, 1)[1].split(end, 1)[0].lstrip("\n")


def has_section(path: Path, section: str) -> bool:
    """Whether the file already has this section between its markers."""
    text = path.read_text() if path.is_file() else ""
    return BEGIN.format(section) in text and END.format(section) in text


def update_markdown(path: Path, section: str, body: str) -> None:
    """Replace this section of the file (between its markers), or append it; other
    sections and hand-written text are kept."""
    block = f"{BEGIN.format(section)}\n{body}{END.format(section)}\n"
    text = path.read_text() if path.is_file() else (
        "# Benchmarks\n\nEvery table below is written by `specmoe bench` (see each section's command); "
        "edit text outside the marked sections only.\n\n")
    begin, end = BEGIN.format(section), END.format(section)
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        _, tail = rest.split(end, 1)
        text = head + block.rstrip("\n") + tail
    else:
        text = text.rstrip("\n") + "\n\n" + block
    path.write_text(text)
