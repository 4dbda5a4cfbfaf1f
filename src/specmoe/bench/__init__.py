"""`specmoe bench`: every policy side by side on one model, prompt set and memory budget.

One command measures the main grid (policies x batch sizes), the anchors users compare
against (transformers' `generate`, llama.cpp) and the paper's ablations, and writes a
table, JSON, a plot and a BENCHMARKS.md section. Runs are interleaved across policies,
each round in another order (A B C, B C A, ...), so that machine drift and what one run
leaves behind hit all alike, and every performance figure is a ratio against a baseline
measured in the same run.

Modules: `command` (the CLI and its flags), `suite` (one run: grid, anchors, ablations,
the JSON document), `grid` (prompts, the budget rule, interleaved timing, medians, the
token-identity check), `runners` (one object per thing timed), `anchors` (external
systems), `ablation` (variant sets), `report` (progress, tables, markdown), `plot`,
`machine`, `validate` (the performance model against a run's traces), `sections`
(BENCHMARKS.md as data: each section's commands and how it is rendered from their saved
JSON; `specmoe bench --report`) and `tables` (the renderers of those sections).
"""
