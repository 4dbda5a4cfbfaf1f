"""`specmoe serve`: an OpenAI-compatible HTTP server over one continuously batching engine.

- protocol.py  request bodies -> validated requests and SamplingParams; OpenAI error objects
- detok.py     incremental text of a growing token list, cut at stop strings
- loop.py      the one thread that owns the engine: admits, steps, hands out new tokens
- metrics.py   Prometheus text of the loop's counters
- answer_stats.py  a request's own engine statistics (`specmoe_stats`)
- live.py      the live view's data: expert map, memory ledger, rates; read between steps
- ui.py        the web page at / and its event stream /ui/events (files in static/)
- app.py       the FastAPI app (endpoints, auth, SSE)
- command.py   the `serve` subcommand
"""
