"""A bounded soak test of `specmoe serve` on loopback: a steady mix of streamed, plain,
cancelled and invalid requests at a fixed concurrency for a fixed time.

    python benchmarks/soak.py --duration 1200 --concurrency 32 -- --policy specmoe --offload disk --device-memory 30%
    python benchmarks/soak.py --model DIR --duration 30 --concurrency 8 --json

Each worker sends one request after another until the time is up, each of a kind drawn
with fixed weights: `stream` (a streamed completion, read to [DONE]), `plain` (a
completion or a chat completion, whole), `cancel` (streamed; the client hangs up after
the first text) and `invalid` (a body the server must refuse with a 4xx error object:
malformed JSON, an unknown field, max_tokens 0, an unknown model, no messages, a body
over 1 MiB). Reported: requests by kind, errors by kind (a 5xx, an error event in a
stream, a wrong answer to an invalid request, a cut connection, a timeout), p50/p99
latency of the served requests, sequences left in the server afterwards, and the
server's resident memory (VmRSS) after a warm-up and at the end, which must stay flat.
Exit status 1 on any error, a leftover sequence, or memory growth over --max-rss-growth.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from collections import Counter
from pathlib import Path

import httpx
from load_test import DEFAULT_PROMPTS, Server, load_prompts, percentile, server_metrics

KINDS = {"stream": 0.4, "plain": 0.3, "cancel": 0.15, "invalid": 0.15}
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
INVALID = [  # (path, raw body, the status it must get)
    (COMPLETIONS, b'{"prompt": "unterminated', 400),
    (COMPLETIONS, json.dumps({"prompt": "hi", "surprise": 1}).encode(), 400),
    (COMPLETIONS, json.dumps({"prompt": "hi", "max_tokens": 0}).encode(), 400),
    (COMPLETIONS, json.dumps({"prompt": "hi", "model": "no-such-model"}).encode(), 404),
    (CHAT, json.dumps({"messages": []}).encode(), 400),
    (CHAT, json.dumps({"messages": [{"role": "wizard", "content": "hi"}]}).encode(), 400),
    (COMPLETIONS, b'{"prompt": "' + b"x" * (1 << 21) + b'"}', 413),
]
MIB = 1 << 20


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="model directory (default: the demo model)")
    p.add_argument("--duration", type=float, default=1200.0, help="seconds of load (default 1200)")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=16, help="output tokens per served request (default 16)")
    p.add_argument("--warmup", type=float, help="seconds before the first memory reading (default: 10%% of "
                                                "--duration, at least 5)")
    p.add_argument("--max-rss-growth", type=float, default=64.0, metavar="MIB",
                   help="fail when resident memory grows more than this after the warm-up (default 64 MiB)")
    p.add_argument("--request-timeout", type=float, default=120.0)
    p.add_argument("--prompts-file", default=str(DEFAULT_PROMPTS), help="JSON lines with a 'prompt' field")
    p.add_argument("--prompt-chars", type=int, default=200, help="cut each prompt to this many characters")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the lines")
    p.add_argument("serve_args", nargs="*", help="after --: extra flags for `specmoe serve`")
    args = p.parse_args(argv)
    if args.duration <= 0 or args.concurrency < 1 or args.max_tokens < 1:
        p.error("--duration, --concurrency and --max-tokens must be positive")
    return args


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


# --- one request of each kind: (outcome, error kind or None) --------------------------------------


async def served(client, body: dict, path: str) -> str | None:
    r = await client.post(path, json=body)
    if r.status_code != 200:
        return f"http_{r.status_code}"
    return None if r.json()["choices"] else "no_choices"


async def streamed(client, body: dict, hang_up: bool) -> str | None:
    async with client.stream("POST", COMPLETIONS, json={**body, "stream": True}) as r:
        if r.status_code != 200:
            return f"http_{r.status_code}"
        last = None
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            last = line[6:]
            if last != "[DONE]" and "error" in json.loads(last):
                return "stream_error_event"
            if hang_up and last != "[DONE]":
                return None  # leaving the block closes the connection mid-stream
        return None if last == "[DONE]" else "stream_without_done"


async def refused(client, path: str, raw: bytes, status: int) -> str | None:
    r = await client.post(path, content=raw, headers={"Content-Type": "application/json"})
    if r.status_code != status:
        return f"invalid_got_{r.status_code}"
    error = r.json().get("error")
    return None if isinstance(error, dict) and error.get("message") else "invalid_without_error_object"


async def one(client, kind: str, prompt: str, rng: random.Random, max_tokens: int) -> str | None:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": rng.choice([0, 0.8]), "seed": rng.randrange(99)}
    if kind == "invalid":
        return await refused(client, *rng.choice(INVALID))
    if kind == "plain":
        if rng.random() < 0.5:
            return await served(client, body, COMPLETIONS)
        chat = {k: v for k, v in body.items() if k != "prompt"}
        return await served(client, {**chat, "messages": [{"role": "user", "content": prompt}]}, CHAT)
    return await streamed(client, body, hang_up=kind == "cancel")


# --- the load ----------------------------------------------------------------------------------


async def soak(args, url: str, pid: int) -> dict:
    prompts = load_prompts(args.prompts_file, args.prompt_chars)
    rng = random.Random(args.seed)
    kinds, weights = list(KINDS), list(KINDS.values())
    counts, errors, latencies = Counter(), Counter(), []
    start = time.monotonic()
    stop_at = start + args.duration
    memory = {}

    async def worker(worker_rng: random.Random):
        while time.monotonic() < stop_at:
            kind = worker_rng.choices(kinds, weights)[0]
            t = time.monotonic()
            try:
                error = await asyncio.wait_for(one(client, kind, worker_rng.choice(prompts), worker_rng,
                                                   args.max_tokens), args.request_timeout)
            except asyncio.TimeoutError:
                error = "timeout"
            except httpx.HTTPError as exc:
                error = f"transport_{type(exc).__name__}"
            counts[kind] += 1
            if error:
                errors[error] += 1
            elif kind in ("stream", "plain"):
                latencies.append(time.monotonic() - t)

    async def watch_memory():
        warmup = args.warmup if args.warmup is not None else max(5.0, 0.1 * args.duration)
        await asyncio.sleep(min(warmup, args.duration / 2))
        memory["start"] = memory["max"] = rss_bytes(pid)
        while time.monotonic() < stop_at:
            await asyncio.sleep(min(5.0, max(0.0, stop_at - time.monotonic())))
            memory["max"] = max(memory["max"], rss_bytes(pid))

    limits = httpx.Limits(max_connections=args.concurrency + 4, max_keepalive_connections=args.concurrency + 4)
    async with httpx.AsyncClient(base_url=url, timeout=args.request_timeout, limits=limits) as client:
        await asyncio.gather(watch_memory(), *(worker(random.Random(rng.random())) for _ in range(args.concurrency)))
        wall = time.monotonic() - start
        memory["end"] = rss_bytes(pid)
        left = await leftover_sequences(client)
    return {
        "duration_s": args.duration, "wall_s": wall, "concurrency": args.concurrency, "max_tokens": args.max_tokens,
        "requests": dict(counts), "served": len(latencies), "errors": dict(errors),
        "latency_p50_s": percentile(latencies, 50), "latency_p99_s": percentile(latencies, 99),
        "leftover_sequences": left,
        "rss_start_mib": memory["start"] / MIB, "rss_end_mib": memory["end"] / MIB, "rss_max_mib": memory["max"] / MIB,
        "rss_growth_mib": (memory["end"] - memory["start"]) / MIB,
    }


async def leftover_sequences(client, settle_s: float = 10.0) -> int:
    """Running + waiting sequences once the load is over (cancelled ones must be gone)."""
    deadline = time.monotonic() + settle_s
    while True:
        values = await server_metrics(client)
        left = int(values.get("specmoe_running_requests", 0) + values.get("specmoe_waiting_requests", 0))
        if left == 0 or time.monotonic() > deadline:
            return left
        await asyncio.sleep(0.2)


def lines(r: dict) -> str:
    errors = ", ".join(f"{k} {v}" for k, v in sorted(r["errors"].items())) or "none"
    kinds = ", ".join(f"{k} {r['requests'].get(k, 0)}" for k in KINDS)
    return (f"soak: {r['wall_s']:.0f} s at concurrency {r['concurrency']}: {sum(r['requests'].values())} requests "
            f"({kinds}), {r['served']} served, errors: {errors}; latency p50 {r['latency_p50_s'] or 0:.2f} s "
            f"p99 {r['latency_p99_s'] or 0:.2f} s; sequences left {r['leftover_sequences']}; resident memory "
            f"{r['rss_start_mib']:.0f} MiB after warm-up, {r['rss_end_mib']:.0f} MiB at the end "
            f"(max {r['rss_max_mib']:.0f}, growth {r['rss_growth_mib']:+.1f} MiB)")


def main(argv=None) -> int:
    args = parse_args(argv)
    server = Server(args.model, args.serve_args, time.perf_counter() + 600)
    try:
        result = asyncio.run(soak(args, server.url, server.proc.pid))
    finally:
        server.close()
    print(json.dumps(result) if args.json else lines(result))
    ok = not result["errors"] and result["leftover_sequences"] == 0 and result["rss_growth_mib"] <= args.max_rss_growth
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
