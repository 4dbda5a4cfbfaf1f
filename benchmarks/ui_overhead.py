"""The live view's cost: decode speed of `specmoe serve` with the web page open vs closed.

The same concurrent load (greedy completions of a fixed length, `ignore_eos`) runs in
rounds, each once with no page connected and once with the page's live view connected,
the order alternating from round to round so that drift hits both alike. "Open" means
`--viewers` clients reading /ui/events (the server-side cost: what the engine thread
and the event loop do for a page), or with `--browser` the page itself in headless
Chromium on this machine (which also pays for rendering). Reported: output tokens/s of
the load and the median of each request's own decode tokens/s (`specmoe_stats`), closed
and open, and their ratios, all measured in the same run; one line, or JSON.

    python benchmarks/ui_overhead.py --rounds 3 --requests 64 --concurrency 16 --max-tokens 64 \\
        -- --policy specmoe --offload disk --device-memory 30% --max-batch-size 16
    python benchmarks/ui_overhead.py --browser ...            # the page in headless Chromium
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time

import httpx
from load_test import DEFAULT_PROMPTS, Server, load_prompts

CHROMIUM_FLAGS = ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--no-first-run", "--window-size=1400,900")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", help="a running server (default: start `specmoe serve` on a free loopback port)")
    p.add_argument("--model", help="model directory for the server this script starts (default: the demo model)")
    p.add_argument("--api-key", help="API key of the server")
    p.add_argument("--rounds", type=int, default=3, help="closed/open pairs (default 3)")
    p.add_argument("--requests", type=int, default=64, help="requests per measurement (default 64)")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=64, help="output tokens per request (default 64)")
    p.add_argument("--prompt-chars", type=int, default=200, help="cut prompts to this many characters (default 200)")
    p.add_argument("--viewers", type=int, default=1, help="live-view clients while open (default 1)")
    p.add_argument("--browser", action="store_true", help="open the page in headless Chromium instead")
    p.add_argument("--time-limit", type=float, default=1800.0, help="hard cap on the whole run, seconds")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the line")
    p.add_argument("serve_args", nargs="*", help="after --: extra flags for `specmoe serve`")
    args = p.parse_args(argv)
    if min(args.rounds, args.requests, args.concurrency, args.max_tokens, args.viewers) < 1:
        p.error("--rounds, --requests, --concurrency, --max-tokens and --viewers must be positive")
    return args


# --- the load ------------------------------------------------------------------------------


async def one_request(client, model: str, prompt: str, max_tokens: int) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "specmoe_stats": True}
    r = await client.post("/v1/completions", json=body)
    if r.status_code != 200:
        raise SystemExit(f"ui_overhead: a request failed ({r.status_code}): {r.text[:200]}")
    return r.json()["specmoe_stats"]


async def measure(client, model: str, prompts: list[str], args) -> dict:
    """The load once: `requests` completions, at most `concurrency` at a time."""
    queue = list(range(args.requests))
    stats: list[dict] = []

    async def worker():
        while queue:
            i = queue.pop()
            stats.append(await one_request(client, model, prompts[i % len(prompts)], args.max_tokens))

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(args.concurrency)))
    wall = time.perf_counter() - start
    speeds = [s["decode_tokens_per_s"] for s in stats if s["decode_tokens_per_s"]]
    return {"wall_s": wall, "tokens": sum(s["completion_tokens"] for s in stats),
            "request_decode_tokens_per_s": statistics.median(speeds) if speeds else None}


# --- the page, open ------------------------------------------------------------------------


class SSEViewers:
    """`n` clients reading /ui/events, as a page's live view does; counts the events they get."""

    def __init__(self, client, n: int):
        self.client, self.n, self.events, self.tasks = client, n, 0, []

    async def read(self):
        async with self.client.stream("GET", "/ui/events") as r:
            if r.status_code != 200:
                raise SystemExit(f"ui_overhead: /ui/events answered {r.status_code}")
            async for line in r.aiter_lines():
                self.events += line.startswith("data: ")

    async def open(self):
        self.tasks = [asyncio.create_task(self.read()) for _ in range(self.n)]
        await asyncio.sleep(0.5)  # connected, first capture taken

    async def close(self):
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)


class BrowserViewer:
    """The page in headless Chromium: open for a measurement, about:blank between."""

    def __init__(self, url: str, api_key: str | None):
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service

        options = webdriver.ChromeOptions()
        options.binary_location = "/usr/bin/chromium"
        for flag in CHROMIUM_FLAGS + (f"--user-data-dir={tempfile.mkdtemp(prefix='ui-overhead-')}",):
            options.add_argument(flag)
        self.driver = webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=options)
        self.url, self.api_key, self.events = url, api_key, None

    async def open(self):
        await asyncio.to_thread(self._open)

    def _open(self):
        self.driver.get(self.url)
        if self.api_key:
            self.driver.execute_script("sessionStorage.setItem('specmoe-api-key', arguments[0])", self.api_key)
            self.driver.get(self.url)
        deadline = time.monotonic() + 30
        while self.driver.execute_script("return document.getElementById('connection').dataset.state") != "live":
            if time.monotonic() > deadline:
                raise SystemExit("ui_overhead: the page did not connect to the live view within 30 s")
            time.sleep(0.1)

    async def close(self):
        await asyncio.to_thread(self.driver.get, "about:blank")

    def quit(self):
        self.driver.quit()


# --- the run -------------------------------------------------------------------------------


async def run(args, url: str) -> dict:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=args.concurrency + args.viewers + 4)
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=None, limits=limits) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        prompts = load_prompts(str(DEFAULT_PROMPTS), args.prompt_chars)
        viewer = BrowserViewer(url, args.api_key) if args.browser else SSEViewers(client, args.viewers)
        await measure(client, model, prompts, args)  # warm-up: caches, the draft set, the pool
        results = {"closed": [], "open": []}
        try:
            for r in range(args.rounds):
                for state in (("closed", "open") if r % 2 == 0 else ("open", "closed")):
                    if state == "open":
                        await viewer.open()
                    started, events_before = time.perf_counter(), viewer.events
                    results[state].append(await measure(client, model, prompts, args))
                    if state == "open" and viewer.events is not None:
                        results[state][-1]["events_per_s"] = (viewer.events - events_before) / (
                            time.perf_counter() - started) / args.viewers
                    if state == "open":
                        await viewer.close()
        finally:
            if args.browser:
                viewer.quit()
    return summarize(args, model, results)


def summarize(args, model: str, results: dict) -> dict:
    def tokens_per_s(runs):
        return sum(r["tokens"] for r in runs) / sum(r["wall_s"] for r in runs)

    def median_request_speed(runs):
        speeds = [r["request_decode_tokens_per_s"] for r in runs if r["request_decode_tokens_per_s"]]
        return statistics.median(speeds) if speeds else None

    closed, opened = tokens_per_s(results["closed"]), tokens_per_s(results["open"])
    req_closed, req_open = median_request_speed(results["closed"]), median_request_speed(results["open"])
    rates = [r["events_per_s"] for r in results["open"] if "events_per_s" in r]
    return {
        "model": model, "viewer": "browser" if args.browser else f"{args.viewers} SSE client(s)",
        "rounds": args.rounds, "requests": args.requests, "concurrency": args.concurrency,
        "max_tokens": args.max_tokens, "closed_tokens_per_s": closed, "open_tokens_per_s": opened,
        "open_over_closed": opened / closed,
        "closed_request_decode_tokens_per_s": req_closed, "open_request_decode_tokens_per_s": req_open,
        "request_open_over_closed": req_open / req_closed if req_open and req_closed else None,
        "events_per_s_per_viewer": statistics.mean(rates) if rates else None,
        "runs": results,
    }


def line(r: dict) -> str:
    events = f", {r['events_per_s_per_viewer']:.1f} events/s per viewer" if r["events_per_s_per_viewer"] else ""
    return (f"ui_overhead: {r['model']}, {r['rounds']} rounds of {r['requests']} requests x {r['max_tokens']} tokens "
            f"at concurrency {r['concurrency']}: {r['closed_tokens_per_s']:.1f} tok/s with the page closed, "
            f"{r['open_tokens_per_s']:.1f} open ({r['viewer']}{events}): {r['open_over_closed']:.3f}x; "
            f"per-request decode {r['closed_request_decode_tokens_per_s']:.1f} vs "
            f"{r['open_request_decode_tokens_per_s']:.1f} tok/s ({r['request_open_over_closed']:.3f}x)")


def main(argv=None) -> int:
    args = parse_args(argv)
    server = None
    if args.url:
        url = args.url.rstrip("/")
    else:
        extra = args.serve_args + (["--api-key", args.api_key] if args.api_key else [])
        server = Server(args.model, extra, time.perf_counter() + args.time_limit)
        url = server.url
    try:
        result = asyncio.run(asyncio.wait_for(run(args, url), args.time_limit))
    finally:
        if server:
            server.close()
    print(json.dumps(result) if args.json else line(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
