"""`specmoe serve`: an OpenAI-compatible HTTP server over one continuously batching engine.

- protocol.py  request bodies -> validated requests and SamplingParams; OpenAI error objects
- detok.py     incremental text of a growing token list, cut at stop strings
- loop.py      the one thread that owns the engine: admits, steps, hands out new tokens
- metrics.py   Prometheus text of the loop's counters
- app.py       the FastAPI app (endpoints, auth, SSE)
- command.py   the `serve` subcommand
"""
