"""`specmoe bench`: every policy side by side on one model, prompt set and memory budget.

One command measures the main grid (policies x batch sizes), the anchors users compare
against (transformers' `generate`, llama.cpp) and the paper's ablations, and writes a
table, JSON, a plot and a BENCHMARKS.md section. Runs are interleaved across policies
(A B C A B C ...) so that machine drift hits all alike, and every performance figure is
a ratio against a baseline measured in the same run.

Modules: `grid` (what runs and how it is timed), `runners` (one object per thing timed),
`anchors` (external systems), `ablation` (variant sets), `report` (table, JSON,
markdown), `plot`, `machine`, `command` (the CLI).
"""
