"""Validate the performance model against a bench run on this machine (specmoe.bench.validate).

    specmoe bench --batch-sizes 1,4,16,64 --repeats 3 --json grid.json --trace-dir traces
    python benchmarks/validate_perf.py grid.json traces [--hardware local] [--json validation.json]
"""

import sys

from specmoe.bench.validate import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
