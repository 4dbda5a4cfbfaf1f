"""Draw the draft-memory curves (tokens per step and throughput against draft memory, per
way of holding experts, one column per batch size) from `specmoe bench --ablation
draft-memory` JSON documents: python benchmarks/plot_draft_memory.py OUT.png DOC.json..."""

import json
import sys

from specmoe.bench.plot import write_draft_memory_plot

if __name__ == "__main__":
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    write_draft_memory_plot([json.loads(open(p).read()) for p in sys.argv[2:]], sys.argv[1])
