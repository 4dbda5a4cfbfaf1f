"""A bounded load test of `specmoe serve` on loopback.

Sends N streamed greedy completions at a fixed concurrency (each a fixed number of
output tokens: ignore_eos) and reports requests/s, output tokens/s and p50/p99 latency
(and time to first token), as one line, or one JSON object with --json. Before that it
sends a few requests one at a time, so the concurrent throughput is also given as a
ratio to one-at-a-time serving measured in the same run. A hard time limit bounds the
whole test; requests still open at the limit are cancelled and counted as unfinished.

    python benchmarks/load_test.py --model DIR            # starts the server itself
    python benchmarks/load_test.py --url http://127.0.0.1:8000 --api-key KEY
    python benchmarks/load_test.py --model DIR -- --policy specmoe --offload disk   # serve flags after --
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

DEFAULT_PROMPTS = Path(__file__).parent / "prompts" / "heldout.jsonl"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", help="a running server (default: start `specmoe serve` on a free loopback port)")
    p.add_argument("--model", help="model directory for the server this script starts (default: the demo model)")
    p.add_argument("--api-key", help="API key of the server (--url)")
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=32, help="output tokens per request (default 32)")
    p.add_argument("--prompts-file", default=str(DEFAULT_PROMPTS), help="JSON lines with a 'prompt' field")
    p.add_argument("--prompt-chars", type=int, help="cut each prompt to this many characters (small contexts)")
    p.add_argument("--baseline-requests", type=int, default=8, help="requests sent one at a time first (0: none)")
    p.add_argument("--time-limit", type=float, default=300.0, help="hard cap on the whole test, seconds")
    p.add_argument("--no-stream", action="store_true", help="plain requests (no TTFT; less client work)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the line")
    p.add_argument("serve_args", nargs="*", help="after --: extra flags for `specmoe serve`")
    args = p.parse_args(argv)
    if args.requests < 1 or args.concurrency < 1 or args.max_tokens < 1:
        p.error("--requests, --concurrency and --max-tokens must be positive")
    return args


def load_prompts(path: str, chars: int | None) -> list[str]:
    prompts = []
    for line in Path(path).read_text().splitlines():
        if line.strip():
            prompt = json.loads(line)["prompt"]
            prompts.append(prompt[:chars] if chars else prompt)
    if not prompts:
        raise SystemExit(f"load_test: {path} holds no prompts")
    return prompts


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0..100)."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


# --- the server ---------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`specmoe serve` in a subprocess on a free loopback port, until closed."""

    def __init__(self, model: str | None, extra: list[str], deadline: float):
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix="specmoe-serve-", suffix=".log", delete=False)
        cmd = [sys.executable, "-m", "specmoe.cli", "serve", "--port", str(port), *extra]
        if model:
            cmd += ["--model", model]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        while True:
            if self.proc.poll() is not None:
                raise SystemExit(f"load_test: the server exited ({self.proc.returncode}):\n{self.log_text()}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if time.perf_counter() > deadline:
                text = self.log_text()
                self.close()
                raise SystemExit(f"load_test: the server was not ready within the time limit:\n{text}")
            time.sleep(0.2)

    def log_text(self) -> str:
        self.log.flush()
        return Path(self.log.name).read_text()[-4000:]

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()
        os.unlink(self.log.name)


# --- the load ------------------------------------------------------------------------------------


async def one_request(client: httpx.AsyncClient, model: str, prompt: str, max_tokens: int, stream: bool) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    start = time.perf_counter()
    if not stream:
        r = await client.post("/v1/completions", json=body)
        if r.status_code != 200:
            return {"ok": False, "status": r.status_code, "error": r.text[:200]}
        tokens = r.json()["usage"]["completion_tokens"]
        return {"ok": True, "latency_s": time.perf_counter() - start, "ttft_s": None, "tokens": tokens}
    body.update(stream=True, stream_options={"include_usage": True})
    ttft, tokens = None, 0
    async with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            await r.aread()
            return {"ok": False, "status": r.status_code, "error": r.text[:200]}
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                return {"ok": False, "status": 200, "error": event["error"]["message"]}
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
            elif ttft is None and event["choices"] and event["choices"][0].get("text"):
                ttft = time.perf_counter() - start
    return {"ok": True, "latency_s": time.perf_counter() - start, "ttft_s": ttft, "tokens": tokens}


async def run_load(client, model, prompts, n, concurrency, max_tokens, stream, deadline) -> dict:
    """n requests with at most `concurrency` open at once, cut off at `deadline` (perf_counter)."""
    results: list[dict] = []
    next_index = 0

    async def worker():
        nonlocal next_index
        while next_index < n and time.perf_counter() < deadline:
            i = next_index
            next_index += 1
            try:
                results.append(await one_request(client, model, prompts[i % len(prompts)], max_tokens, stream))
            except httpx.HTTPError as exc:
                results.append({"ok": False, "status": None, "error": f"{type(exc).__name__}: {exc}"})

    start = time.perf_counter()
    tasks = [asyncio.create_task(worker()) for _ in range(min(concurrency, n))]
    _, pending = await asyncio.wait(tasks, timeout=max(0.0, deadline - start))
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    wall = time.perf_counter() - start
    ok = [r for r in results if r["ok"]]
    latencies = [r["latency_s"] for r in ok]
    ttfts = [r["ttft_s"] for r in ok if r["ttft_s"] is not None]
    tokens = sum(r["tokens"] for r in ok)
    return {
        "requests": n, "completed": len(ok), "errors": len(results) - len(ok), "unfinished": n - len(results),
        "first_error": next((r["error"] for r in results if not r["ok"]), None),
        "wall_s": wall, "requests_per_s": len(ok) / wall, "output_tokens": tokens,
        "output_tokens_per_s": tokens / wall,
        "latency_p50_s": percentile(latencies, 50), "latency_p99_s": percentile(latencies, 99),
        "ttft_p50_s": percentile(ttfts, 50), "ttft_p99_s": percentile(ttfts, 99),
    }


async def server_metrics(client: httpx.AsyncClient) -> dict[str, float]:
    values = {}
    for line in (await client.get("/metrics")).text.splitlines():
        match = re.match(r"^(specmoe_\w+)\{[^}]*\}\s+(\S+)$", line)
        if match and "finish_reason" not in line and "status=" not in line:
            values[match.group(1)] = float(match.group(2))
    return values


async def main_async(args, url: str, deadline: float) -> dict:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    with httpx.Client(base_url=url, headers=headers, timeout=30) as sync:
        models = sync.get("/v1/models")
        if models.status_code != 200:
            raise SystemExit(f"load_test: GET {url}/v1/models answered {models.status_code}: {models.text[:200]}")
        model = models.json()["data"][0]["id"]
    prompts = load_prompts(args.prompts_file, args.prompt_chars)
    limits = httpx.Limits(max_connections=args.concurrency + 4, max_keepalive_connections=args.concurrency + 4)
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=None, limits=limits) as client:
        baseline = None
        if args.baseline_requests:
            baseline = await run_load(client, model, prompts[::-1], args.baseline_requests, 1, args.max_tokens,
                                      not args.no_stream, deadline)
        before = await server_metrics(client)  # the server's counters cover the concurrent load only
        load = await run_load(client, model, prompts, args.requests, args.concurrency, args.max_tokens,
                              not args.no_stream, deadline)
        after = await server_metrics(client)

    def delta(name):
        return after.get(name, 0.0) - before.get(name, 0.0)

    steps = delta("specmoe_decode_steps_total")
    drafted = delta("specmoe_draft_tokens_total")
    result = {
        "model": model, "url": url, "concurrency": args.concurrency, "max_tokens": args.max_tokens,
        "stream": not args.no_stream, **load,
        "time_limit_s": args.time_limit,
        "baseline_output_tokens_per_s": baseline["output_tokens_per_s"] if baseline else None,
        "baseline_completed": baseline["completed"] if baseline else None,
        "speedup_vs_one_at_a_time": (load["output_tokens_per_s"] / baseline["output_tokens_per_s"]
                                     if baseline and baseline["output_tokens_per_s"] else None),
        "server_mean_batch": delta("specmoe_decode_sequence_steps_total") / steps if steps else None,
        "server_acceptance_rate": delta("specmoe_accepted_draft_tokens_total") / drafted if drafted else None,
        "server_transfer_bytes": delta("specmoe_transfer_bytes_total"),
    }
    return result


def line(r: dict) -> str:
    def s(v):
        return "n/a" if v is None else f"{v:.2f} s"

    parts = [
        f"load_test: {r['model']}, {r['completed']}/{r['requests']} requests ok"
        + (f" ({r['errors']} errors, {r['unfinished']} unfinished at the {r['time_limit_s']:.0f} s limit)"
           if r["errors"] or r["unfinished"] else ""),
        f"concurrency {r['concurrency']}, {r['max_tokens']} tokens each",
        f"{r['requests_per_s']:.2f} req/s",
        f"{r['output_tokens_per_s']:.1f} output tok/s",
    ]
    if r["speedup_vs_one_at_a_time"]:
        parts.append(f"{r['speedup_vs_one_at_a_time']:.2f}x one-at-a-time ({r['baseline_output_tokens_per_s']:.1f} tok/s)")
    parts.append(f"latency p50 {s(r['latency_p50_s'])} p99 {s(r['latency_p99_s'])}")
    parts.append(f"ttft p50 {s(r['ttft_p50_s'])}")
    if r["server_mean_batch"]:
        parts.append(f"mean batch {r['server_mean_batch']:.1f}")
    parts.append(f"in {r['wall_s']:.1f} s")
    text = ", ".join(parts)
    if r["first_error"]:
        text += f"\nload_test: first error: {r['first_error']}"
    return text


def main(argv=None) -> int:
    args = parse_args(argv)
    deadline = time.perf_counter() + args.time_limit  # for everything, server start included
    server = None
    if args.url:
        url = args.url.rstrip("/")
    else:
        extra = args.serve_args + (["--api-key", args.api_key] if args.api_key else [])
        server = Server(args.model, extra, deadline)
        url = server.url
    try:
        result = asyncio.run(main_async(args, url, deadline))
    finally:
        if server:
            server.close()
    print(json.dumps(result) if args.json else line(result))
    return 0 if result["completed"] == result["requests"] else 1


if __name__ == "__main__":
    sys.exit(main())
