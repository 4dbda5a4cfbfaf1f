"""Bigger than memory: specmoe and llama.cpp under one memory cap, enforced by the kernel.

The model: the demo model widened as benchmarks/real_size_model.py widens it, with experts
8192 wide (hidden 2048, 16 experts x 8 layers, about 12 GiB in bfloat16), written as a
bfloat16 GGUF and quantized by llama.cpp's own quantizer to Q4_K_M (about 3.7 GB). Each run
is a fresh process in a memory cgroup of its own whose limit is the cap (a share of the
file's size): the kernel counts every page the process allocates and every page of the page
cache it brings in, reclaims cache at the limit and kills the process (OOM) when its own
memory would pass it, as on a machine with that much memory.

- llama.cpp as its users run a file bigger than memory: mmap, weight repacking off (with
  repacking, its default on AVX-512, it copies the Q4_K weights into anonymous buffers and
  is OOM-killed under the cap), its batch API at B > 1, no torch in its process.
- specmoe's SpecMoE policy on the disk tier (page cache bypassed) with `--memory-limit` set
  to the cap: the budget for weights, KV cache, draft and pool derived from it.

Before each run the model file is dropped from the page cache (specmoe's disk tier reads it in place).
Both engines: the same token ids (held-out prompts, each cut to 48 tokens), greedy, the same thread count, B
prompts per run (2 at B = 1, one after the other). Rounds interleave the engines (specmoe
first in even rounds). Per run: decode tokens/s, the cgroup's peak and OOM kills, bytes
read from storage during the generation (the process's /proc/self/io read_bytes), and
specmoe's tokens per step and acceptance.

    python benchmarks/beyond_memory.py --workdir /work/bigw --json beyond-memory.json
    python benchmarks/beyond_memory.py --model FILE.gguf --caps 0.4 --batch-sizes 1 --rounds 1 --json b.json

Needs llama-cpp-python and gguf (make anchors), and root (or a writable memory cgroup);
without a cgroup the anchor is skipped with a one-line note.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve().parent
EXPERT_FACTOR = 64  # experts 8192 wide: a Q4_K_M file several times the caps
DEFAULT_CAPS = (0.4, 0.7)
DEFAULT_BATCHES = (1, 16, 64)


# --- the model --------------------------------------------------------------------------


def build_model(workdir: Path, keep_checkpoint: bool) -> Path:
    """The widened model's Q4_K_M file in `workdir`, made once (the bfloat16 checkpoint and its
    bfloat16 GGUF are written on the way and removed after, unless `keep_checkpoint`)."""
    sys.path.insert(0, str(HERE))
    import shutil

    from real_size_model import DEMO, built, write
    from same_file import quantized_file

    checkpoint = workdir / f"real-size-k8-m{EXPERT_FACTOR}"
    out = workdir / f"{checkpoint.name}-Q4_K_M.gguf"
    if out.is_file():
        return out
    workdir.mkdir(parents=True, exist_ok=True)
    if not built(DEMO, checkpoint, 8, EXPERT_FACTOR):
        write(DEMO, checkpoint, 8, EXPERT_FACTOR)
    path = quantized_file(checkpoint, workdir, "Q4_K_M", source="bf16", keep_source=keep_checkpoint)
    if not keep_checkpoint:
        shutil.rmtree(checkpoint)
    return path


# --- one run, in a child process ------------------------------------------------------------


def read_bytes() -> int:
    """Bytes this process (all its threads) caused to be read from storage: page-cache misses
    and direct reads alike (/proc/self/io)."""
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("read_bytes:"))


def child(spec: dict) -> dict:
    """Run one engine as `spec` says; the figures as a dict (printed as JSON by main)."""
    prompts, batch, tokens, threads = spec["prompts"], spec["batch"], spec["max_tokens"], spec["threads"]
    if spec["engine"] == "llama.cpp":
        from specmoe.bench.llama_batch import LlamaBatch  # no torch in this process

        llama = LlamaBatch(Path(spec["model"]), prompts, batch, tokens, threads, mmap=True, repack=False)
        before, start = read_bytes(), time.perf_counter()
        outputs, _, decode_s = llama.run()
        result = {"wall_s": time.perf_counter() - start, "read_bytes": read_bytes() - before, "decode_s": decode_s,
                  "token_ids": outputs, "tokens_per_step": 1.0, "acceptance_rate": None}
        llama.close()
    else:
        from specmoe import LLM, SamplingParams

        llm = LLM(model=spec["model"], device="cpu", policy=spec["policy"], offload="disk",
                  offload_dir=spec["offload_dir"], memory_limit=spec["cap"], threads=threads,
                  max_batch_size=batch, max_model_len=spec["max_model_len"])
        params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
        before, start = read_bytes(), time.perf_counter()
        outs = llm.generate(prompts, params)
        stats = llm.last_stats
        result = {"wall_s": time.perf_counter() - start, "read_bytes": read_bytes() - before,
                  "decode_s": stats["decode_s"], "token_ids": [o.token_ids for o in outs],
                  "tokens_per_step": stats.get("tokens_per_step"), "acceptance_rate": stats.get("acceptance_rate"),
                  "transfer_bytes": stats.get("transfer_bytes"),
                  "stats": {k: v for k, v in stats.items() if isinstance(v, (int, float, str, type(None)))}}
        llm.close()
    generated = sum(len(t) for t in result["token_ids"])
    result["generated_tokens"] = generated
    result["decode_tokens_per_s"] = (generated - len(prompts)) / result["decode_s"] if result["decode_s"] else 0.0
    result["read_bytes_per_token"] = result["read_bytes"] / generated if generated else None
    return result


def evict(paths) -> None:
    """Drop these files' pages from the page cache: the next run reads them from the disk."""
    for path in paths:
        if Path(path).is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def run_capped(spec: dict, cap: int, files, spec_dir: Path) -> dict:
    """`child(spec)` in a fresh process inside a memory cgroup capped at `cap` bytes."""
    from specmoe.bench.cgroup import Cgroup

    spec_file = spec_dir / f"spec-{os.getpid()}-{time.monotonic_ns()}.json"
    spec_file.write_text(json.dumps(spec))
    evict(files)
    group = Cgroup.make(cap)
    if group is None:
        raise SystemExit("beyond_memory: no memory cgroup can be made here (run as root on cgroup v1, or with "
                         "the v2 memory controller delegated): the caps cannot be enforced")
    cmd = group.join_command([sys.executable, str(Path(__file__).resolve()), "--child", str(spec_file)])
    try:
        proc = subprocess.run(cmd, check=False, capture_output=True, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        peak, kills = group.peak(), group.oom_kills()
    finally:
        group.remove()
        spec_file.unlink(missing_ok=True)
    record = {"engine": spec["engine"], "batch_size": spec["batch"], "cap_bytes": cap, "cgroup_peak_bytes": peak,
              "oom_kills": kills, "returncode": proc.returncode}
    if proc.returncode == 0:
        record.update(json.loads(proc.stdout.strip().splitlines()[-1]))
    else:
        record["error"] = (proc.stderr.strip().splitlines() or ["(no output)"])[-1][:300]
    return record


# --- the whole measurement --------------------------------------------------------------


def prompt_ids(model: Path, n: int, length: int) -> list[list[int]]:
    """The first `n` held-out prompts as token ids, each cut to its first `length` tokens: the
    KV cache of 64 sequences of the longest prompts (255 tokens) would take a large share of
    the smaller cap from both engines and say nothing about moving experts."""
    from specmoe.base.gguf_checkpoint import load_tokenizer, open_checkpoint

    tokenizer = load_tokenizer(open_checkpoint(model))
    lines = (HERE / "prompts" / "heldout.jsonl").read_text().splitlines()
    return [tokenizer.encode(json.loads(line)["prompt"])[:length] for line in lines if line.strip()][:n]


def prepare_specmoe(model: Path, offload_dir: Path, threads: int, policy: str, limit: int) -> list[Path]:
    """A first run's one-time work, done once outside the caps and the timing: SpecMoE's
    affinity table and draft measurements (computed in float32 a block at a time: more than
    the smaller cap holds at this size). Returns the expert files a run must find cold
    (none: the disk tier reads a GGUF file in place; kept for a checkpoint that gets one)."""
    from specmoe import LLM, SamplingParams

    llm = LLM(model=str(model), device="cpu", policy=policy, offload="disk", offload_dir=str(offload_dir),
              memory_limit=limit, threads=threads, max_batch_size=1, max_model_len=64)
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    llm.close()
    return sorted(offload_dir.glob("experts-*.bin"))


def device_rates(path: Path, size: int = 1 << 30) -> dict:
    """The disk's read rates on the file the disk tier reads, page cache bypassed, as
    `specmoe calibrate` measures them: large reads in file order, and expert-sized reads at
    shuffled offsets with the disk tier's reads in flight."""
    from specmoe.autotune.measure import _read_direct, _read_random
    from specmoe.experts.store import DISK_READ_DEPTH

    chunk = 16 << 20
    size = min(size, path.stat().st_size) // chunk * chunk
    evict([path])
    return {"sequential": size / _read_direct(path, size, chunk),
            "random": size / _read_random(path, size, chunk, DISK_READ_DEPTH, direct=True),
            "bytes": size, "chunk": chunk, "depth": DISK_READ_DEPTH}


def summarize(records: list[dict]) -> list[dict]:
    """Per (cap, B): each engine's medians, specmoe ÷ llama.cpp round by round, the peaks."""
    from specmoe.engine.stats import token_ids_sha256

    out = []
    keys = sorted({(r["cap_share"], r["batch_size"]) for r in records})
    for share, batch in keys:
        runs = {e: [r for r in records if (r["cap_share"], r["batch_size"], r["engine"]) == (share, batch, e)]
                for e in ("specmoe", "llama.cpp")}
        ok = {e: [r for r in rs if r["returncode"] == 0] for e, rs in runs.items()}
        row = {"cap_share": share, "batch_size": batch,
               "cap_bytes": next(r["cap_bytes"] for rs in runs.values() for r in rs)}
        for engine, rs in runs.items():
            name = engine.replace(".", "_")
            good = ok[engine]
            row[f"{name}_tok_s"] = [r["decode_tokens_per_s"] for r in good]
            row[f"{name}_peak_bytes"] = max((r["cgroup_peak_bytes"] for r in rs), default=None)
            row[f"{name}_oom_kills"] = sum(r["oom_kills"] for r in rs)
            row[f"{name}_failed_runs"] = len(rs) - len(good)
            row[f"{name}_read_bytes_per_token"] = statistics.median(r["read_bytes_per_token"] for r in good) \
                if good else None
        good = ok["specmoe"]
        if good:
            row["tokens_per_step"] = statistics.median(r["tokens_per_step"] for r in good)
            accepted = [r["acceptance_rate"] for r in good if r["acceptance_rate"] is not None]
            row["acceptance_rate"] = statistics.median(accepted) if accepted else None
            rates = [r["stats"].get("verify_disk_read_rate") for r in good if r.get("stats")]
            row["verify_disk_read_rate"] = statistics.median(rates) if all(rates) and rates else None
            row["specmoe_sha256"] = sorted({token_ids_sha256(r["token_ids"]) for r in good})
        pairs = list(zip(ok["specmoe"], ok["llama.cpp"]))
        ratios = [a["decode_tokens_per_s"] / b["decode_tokens_per_s"] for a, b in pairs if b["decode_tokens_per_s"]]
        row["rounds"] = len(ratios)
        if ratios:
            row.update(ratio_median=statistics.median(ratios), ratio_low=min(ratios), ratio_high=max(ratios))
        out.append(row)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--child", metavar="SPEC", help=argparse.SUPPRESS)
    p.add_argument("--workdir", type=Path, help="where the model is built (and kept) and specmoe's caches go")
    p.add_argument("--model", type=Path, help="a Q4_K_M GGUF file to use instead of building the model")
    p.add_argument("--keep-checkpoint", action="store_true", help="keep the widened bfloat16 checkpoint and its GGUF")
    p.add_argument("--caps", default=",".join(map(str, DEFAULT_CAPS)), help="caps as shares of the file's size")
    p.add_argument("--cap-floor", default="0", help="the least cap, a size (a smoke run's tiny file: 1GiB)")
    p.add_argument("--batch-sizes", default=",".join(map(str, DEFAULT_BATCHES)))
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds of both engines (default: 3)")
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--prompt-tokens", type=int, default=48, help="each prompt's first N tokens (default: 48)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="both engines (default: every core)")
    p.add_argument("--policy", default="specmoe", help="specmoe's policy (default: specmoe)")
    p.add_argument("--json", metavar="FILE", required=False, help="write the document BENCHMARKS.md renders")
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(child(json.loads(Path(args.child).read_text()))))
        return 0
    if not (args.model or args.workdir):
        p.error("give --workdir (the model is built there) or --model FILE")
    from specmoe.base.units import parse_size
    from specmoe.bench.machine import machine_info

    workdir = args.workdir or args.model.parent
    model = args.model or build_model(workdir, args.keep_checkpoint)
    caps = [float(c) for c in args.caps.split(",")]
    batches = [int(b) for b in args.batch_sizes.split(",")]
    offload_dir = workdir / "offload"
    size = model.stat().st_size
    floor = parse_size(args.cap_floor, "--cap-floor") if args.cap_floor != "0" else 0
    cap_of = {share: max(floor, int(share * size)) for share in caps}
    files = [model, *prepare_specmoe(model, offload_dir, args.threads, args.policy, min(cap_of.values()))]
    rates = device_rates(files[-1])
    prompts = prompt_ids(model, max(max(batches), 2), args.prompt_tokens)
    max_model_len = max(len(p) for p in prompts) + args.max_tokens + 8
    doc = {"machine": machine_info("cpu"), "file": model.name, "file_bytes": size, "caps": caps,
           "batch_sizes": batches, "rounds": args.rounds, "max_tokens": args.max_tokens, "threads": args.threads,
           "policy": args.policy, "device_read_rates": rates}
    records = []
    for share in caps:
        for batch in batches:
            spec = {"model": str(model), "batch": batch, "prompts": prompts[: max(batch, 2)],
                    "max_tokens": args.max_tokens, "threads": args.threads, "policy": args.policy,
                    "offload_dir": str(offload_dir), "cap": cap_of[share], "max_model_len": max_model_len}
            for rnd in range(args.rounds):
                order = ["specmoe", "llama.cpp"] if rnd % 2 == 0 else ["llama.cpp", "specmoe"]
                for engine in order:
                    record = run_capped({**spec, "engine": engine}, cap_of[share], files, workdir)
                    record.update(cap_share=share, round=rnd)
                    records.append(record)
                    print(f"cap {share:.0%} B={batch} round {rnd} {engine}: "
                          f"{record.get('decode_tokens_per_s', 0):.2f} tok/s, peak "
                          f"{record['cgroup_peak_bytes'] / 2**30:.2f} GiB, oom {record['oom_kills']}"
                          + (f", {record['error']}" if "error" in record else ""), file=sys.stderr, flush=True)
                    write(doc, records, args.json)  # a run cut short keeps what it measured
    doc["ceiling"] = ceiling(model, prompts, batches, args, max_model_len, files, workdir)
    print(json.dumps(write(doc, records, args.json)["summary"], indent=1))
    return 0


def ceiling(model: Path, prompts, batches, args, max_model_len: int, files, workdir: Path) -> list[dict]:
    """What this machine computes with every weight in memory and nothing read: specmoe's
    resident policy, once per batch size, in a cgroup as large as the machine's memory (its
    peak is measured, nothing is capped). No policy that reads experts decodes faster per
    verified row, so a goal above this figure is above what the machine computes."""
    from specmoe.engine.stats import token_ids_sha256

    out = []
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for batch in batches:
        spec = {"model": str(model), "batch": batch, "prompts": prompts[: max(batch, 2)], "engine": "specmoe",
                "max_tokens": args.max_tokens, "threads": args.threads, "policy": "resident",
                "offload_dir": str(workdir / "offload"), "cap": None, "max_model_len": max_model_len}
        record = run_capped(spec, memory, files, workdir)
        if "token_ids" in record:
            record["sha256"] = token_ids_sha256(record.pop("token_ids"))
        out.append(record)
        print(f"every weight in memory B={batch}: {record.get('decode_tokens_per_s', 0):.2f} tok/s"
              + (f", {record['error']}" if "error" in record else ""), file=sys.stderr, flush=True)
    return out


def write(doc: dict, records: list[dict], path: str | None) -> dict:
    doc = {**doc, "records": [{k: v for k, v in r.items() if k != "token_ids"} for r in records],
           "summary": summarize(records)}
    if path:
        Path(path).write_text(json.dumps(doc, indent=1))
    return doc


if __name__ == "__main__":
    sys.exit(main())
