"""BENCHMARKS.md as data: each section names the commands that measure it (each writes
one JSON document into a results directory) and how the section is rendered from those
documents. `benchmarks/run_all.py` runs the commands (`make bench`); `specmoe bench
--report DIR --markdown BENCHMARKS.md` rewrites every section from the saved JSON
(`make bench-report`), between its markers, keeping hand-written text outside them.

Prose here says what a section measures and how; every figure comes from a document.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

from . import beyond_memory, draft_memory, draft_split, gguf_tables, real_size, replicas, report, summary, tables, translate, validate  # noqa: E501
from .section import BENCH_SMOKE, REAL_SIZE_MODEL, REAL_SIZE_SMOKE_MODEL, Run, Section, real_size_run, run_options

COMMANDS_FILE = "commands.json"  # output file -> the command that wrote it, recorded by run_all.py
KEPT = Path("benchmarks") / "results"  # beside BENCHMARKS.md: the documents committed with it


def _bench(name: str, extra: Callable[[dict], str] | None = None) -> Callable[[dict[str, dict]], str]:
    def render(docs):
        doc = docs[name]
        return report.markdown(doc, name, heading=False) + ("\n" + extra(doc) if extra else "")
    return render


def _grid_extra(doc: dict) -> str:
    batches = sorted({r["batch_size"] for r in doc["records"]}) or [16]
    b = 16 if 16 in batches else batches[-1]
    return (f"### Where the time goes, B = {b}\n\nMedian repeat: time compute waited for transfers (transfer_wait_s), "
            "the rest (compute_s, prefill included) and the decode wall time.\n\n" + tables.breakdown(doc, b)
            + "\n### `--policy auto` against the best fixed policy\n\n" + tables.auto_against_fixed(doc))


PROFILE_BASE = "c95390e"  # main before the compute work of this section (profile_passes.py --source-rev)
STARTUP_BASE = "1702eb7"  # main before the kernel guard and the streaming start-up (real_size_runs.py)
REAL_SIZE_RUN = real_size_run()
# the paper's draft: slower than ondemand at this size, so shorter runs and no B = 64
REAL_SIZE_PAPER_RUN = run_options(32)
SIM = "specmoe simulate --hardware h100-pcie5 --json --model-shape "
SIMULATIONS = {
    "nllb": "nllb-moe-54b --batch-sizes 1,16,64,256 --gamma 10 --tokens-per-step 7.27",
    "nllb-skew1.2": "nllb-moe-54b --batch-sizes 1,16,64,256 --gamma 10 --tokens-per-step 7.27 --skew 1.2",
    "mixtral": "mixtral-8x7b --batch-sizes 1,16,64,256",
    "scout": "llama-4-scout --batch-sizes 1,16,64,256",
    "deepseek-v3": "deepseek-v3 --batch-sizes 1,16,64,256",
    "gpt-oss-120b": "gpt-oss-120b --batch-sizes 1,16,64,256",
}


def _projections(docs):
    sims = {name: docs[f"simulate-{name}.json"] for name in SIMULATIONS}
    return ("SpecMoE × ondemand (simulated) and its tokens/s, per batch size:\n\n" + tables.simulate_speedups(sims)
            + "\nBytes moved at B = 256:\n\n" + tables.simulate_bytes(sims, 256)
            + "\nEvery policy, Mixtral-8x7B at B = 1, 16, 256 (decode tokens/s, expert bytes per token):\n\n"
            + tables.simulate_policies(docs["simulate-mixtral-check.json"]))


SECTIONS = (
    Section("machine", "This machine, as calibration measured it",
            "`specmoe calibrate` measures the disk, memory and matmul rates and times the engine itself on the demo "
            "model; saved as the profile `local`, it is what `auto` plans from in the grid and what the "
            "performance model is validated with below.",
            (Run("calibration.json", "specmoe calibrate --json > {out}/calibration.json",
                 "specmoe calibrate --size 16MiB --json > {out}/calibration.json"),),
            lambda docs: tables.calibration(docs["calibration.json"])),
    Section("real-size-runs", "Real size: every policy's start-up and memory, and the run that crashed",
            "The real-size model (benchmarks/real_size_model.py: the demo model widened 8x in hidden size and heads, "
            "16x in expert width; 24 MiB bf16 experts, 3.2 GiB) run as a user runs it, each `specmoe generate` its "
            "own process, the disk tier at 30 %: resident; ondemand, caching and overlap each with a fresh cache dir "
            "(its first run builds the disk tier's file) and again from ondemand's; SpecMoE with another fresh "
            "cache dir, then again from its caches (the int8 draft copies read back from their safetensors file: the run that segfaulted in torch's int8 kernel before "
            "the kernel guard). Peak anonymous RSS: polled from outside the process; host_peak_bytes: what the "
            "process reports itself (the kernel's peak RSS, shared libraries included); start-up: wall time minus "
            "the generation's own; then ondemand and SpecMoE from their caches three times in turn (their start-ups "
            "compared median against median: one run each moves by seconds with the page cache); and SpecMoE's "
            "first start-up against the code before the streaming start-up, alternating.",
            (Run("real-size-runs.json", f"python benchmarks/real_size_runs.py --startup-against {STARTUP_BASE} "
                 "--json {out}/real-size-runs.json", f"python benchmarks/real_size_runs.py --smoke --startup-against "
                 f"{STARTUP_BASE} --rounds 1 --json {{out}}/real-size-runs.json"),),
            lambda docs: tables.real_size_runs(docs["real-size-runs.json"])),
    Section("real-size", "Real size: every policy and the engines users would pick, at real dimensions",
            "The real-size model (benchmarks/real_size_model.py: the demo model widened without changing its "
            "function, 8x in hidden size and heads, 16x in expert width: hidden 2048, 24 MiB bf16 experts, 3.2 GiB; "
            "a benchmark device with real shapes and a trained model's routing and draft acceptance, not a model "
            "anyone would deploy), float32, greedy, held-out prompts, one torch thread for every engine: "
            "specmoe's resident policy, transformers' `generate` and llama.cpp (a float32 GGUF copy, its batch "
            "API at B > 1) with every weight in memory, at B = 1 and 16; ondemand and SpecMoE on the real disk "
            "tier at 30 % of the expert bytes at B = 1, 16 and 64 (overlap and caching at this size: the section "
            "above), 64 tokens for each of B prompts; then the paper's draft in a run of its own with ondemand "
            "beside it (B = 1 and 16, 32 tokens: it is slower than ondemand here). Where the runners do not "
            "fit in memory side by side the bench runs them one after another (its notes say so). Each ratio "
            "below is of two figures of one run.",
            (Run("real-size.json", f"{REAL_SIZE_MODEL} && specmoe bench --model {{out}}/real-size-k8-m16 "
                 f"--batch-sizes 1,16 --policies resident,ondemand,specmoe {REAL_SIZE_RUN} "
                 "--anchors transformers,llama.cpp --json {out}/real-size.json",
                 f"{REAL_SIZE_SMOKE_MODEL} && specmoe bench --model {{out}}/real-size-k2-m2 --batch-sizes 1,2 "
                 f"--policies resident,ondemand,specmoe {BENCH_SMOKE} --anchors transformers,llama.cpp "
                 "--json {out}/real-size.json"),
             Run("real-size-64.json", f"{REAL_SIZE_MODEL} && specmoe bench --model {{out}}/real-size-k8-m16 "
                 f"--batch-sizes 64 --policies ondemand,specmoe {REAL_SIZE_RUN} --anchors none "
                 "--json {out}/real-size-64.json",
                 f"{REAL_SIZE_SMOKE_MODEL} && specmoe bench --model {{out}}/real-size-k2-m2 --batch-sizes 4 "
                 f"--policies ondemand,specmoe {BENCH_SMOKE} --anchors none --json {{out}}/real-size-64.json"),
             Run("real-size-paper.json", f"{REAL_SIZE_MODEL} && specmoe bench --model {{out}}/real-size-k8-m16 "
                 f"--batch-sizes 1,16 --policies ondemand,specmoe --draft-quant none {REAL_SIZE_PAPER_RUN} "
                 "--anchors none --json {out}/real-size-paper.json",
                 f"{REAL_SIZE_SMOKE_MODEL} && specmoe bench --model {{out}}/real-size-k2-m2 --batch-sizes 1,2 "
                 f"--policies ondemand,specmoe --draft-quant none {BENCH_SMOKE} --anchors none "
                 "--json {out}/real-size-paper.json")),
            lambda docs: (report.markdown(docs["real-size.json"], "real-size", heading=False)
                          + "\n### B = 64\n\n" + report.markdown(docs["real-size-64.json"], "real-size", heading=False)
                          + "\n### The goals, each a ratio within one run\n\n"
                          + real_size.real_size_goals([docs["real-size.json"], docs["real-size-64.json"]],
                                                      docs["real-size-paper.json"]))),
    Section("real-size-drafts", "Real size: the paper's draft at B = 64, and the draft's bfloat16 projections",
            "The real-size model, disk tier at 30 %, held-out prompts, one torch thread. First the paper's draft "
            "(`--draft-quant none`) beside ondemand at B = 64, 32 tokens (B = 1 and 16: the section above). Then "
            "`--draft-dense` at B = 16 and 64 (64 tokens, int8 copies of every expert: the default draft when "
            "measured): the draft's attention projections and LM head multiplied in float32 (none) against kept in bfloat16 as the checkpoint stores them "
            "(bfloat16, what auto chose at these batch sizes), each beside ondemand in one rotation: whether "
            "bfloat16 drafts pay, and whether they cost acceptance.",
            (Run("real-size-paper-64.json", f"{REAL_SIZE_MODEL} && specmoe bench --model {{out}}/real-size-k8-m16 "
                 f"--batch-sizes 64 --policies ondemand,specmoe --draft-quant none {REAL_SIZE_PAPER_RUN} "
                 "--anchors none --json {out}/real-size-paper-64.json",
                 f"{REAL_SIZE_SMOKE_MODEL} && specmoe bench --model {{out}}/real-size-k2-m2 --batch-sizes 4 "
                 f"--policies ondemand,specmoe --draft-quant none {BENCH_SMOKE} --anchors none "
                 "--json {out}/real-size-paper-64.json"),
             *(Run(f"draft-dense-real-size-{b}.json", f"{REAL_SIZE_MODEL} && specmoe bench --model "
                   f"{{out}}/real-size-k8-m16 --no-grid --ablation draft-dense --ablation-batch-size {b} "
                   f"{REAL_SIZE_RUN} --anchors none --json {{out}}/draft-dense-real-size-{b}.json",
                   f"{REAL_SIZE_SMOKE_MODEL} && specmoe bench --model {{out}}/real-size-k2-m2 --no-grid --ablation "
                   f"draft-dense --ablation-batch-size {s} {BENCH_SMOKE} --anchors none "
                   f"--json {{out}}/draft-dense-real-size-{b}.json") for b, s in ((16, 2), (64, 4)))),
            lambda docs: (report.markdown(docs["real-size-paper-64.json"], "real-size", heading=False)
                          + "\n" + report.markdown(docs["draft-dense-real-size-16.json"], "real-size", heading=False)
                          + "\n" + report.markdown(docs["draft-dense-real-size-64.json"], "real-size",
                                                   heading=False))),
    Section("gamma-real-size", "Choosing gamma and the draft's dense precision at real size",
            "The defaults of γ and `--draft-dense` are chosen on the training prompts "
            "(benchmarks/prompts/train.jsonl), not the held-out ones every other table reports on. On the "
            "real-size model at B = 16, 30 % budget, real disk tier, 64 tokens, int8 copies of every expert (the "
            "default draft when measured), each run against ondemand in one rotation. First γ = 10 (the default before), 16, 24 and 32, then 16 and 32 at "
            "B = 1 (four prompts one after another) and 64: a verify pass streams nearly every expert through the "
            "pool whatever γ is, so its cost hardly grows with γ, while each draft pass costs the same: longer "
            "drafts pay while the draft keeps agreeing with the model. Then the "
            "draft's attention projections and LM head multiplied in float32 (none, the default) against kept "
            "in bfloat16 (what `--draft-dense auto` chooses on this machine at this width).",
            (Run("gamma-real-size.json", f"{REAL_SIZE_MODEL} && specmoe bench --model {{out}}/real-size-k8-m16 "
                 "--prompts-file benchmarks/prompts/train.jsonl --no-grid --ablation gamma --ablation-batch-size 16 "
                 f"--ablation-gammas 10,16,24,32 {REAL_SIZE_RUN} --anchors none --json {{out}}/gamma-real-size.json",
                 f"{REAL_SIZE_SMOKE_MODEL} && specmoe bench --model {{out}}/real-size-k2-m2 "
                 "--prompts-file benchmarks/prompts/train.jsonl --no-grid --ablation gamma --ablation-batch-size 2 "
                 f"--ablation-gammas 2,4 {BENCH_SMOKE} --anchors none --json {{out}}/gamma-real-size.json"),
             *(Run(f"gamma-real-size-{b}.json", f"{REAL_SIZE_MODEL} && specmoe bench --model "
                   "{out}/real-size-k8-m16 --prompts-file benchmarks/prompts/train.jsonl --no-grid --ablation gamma "
                   f"--ablation-batch-size {b} --ablation-gammas 16,32 {real_size_run(batches)} "
                   f"--anchors none --json {{out}}/gamma-real-size-{b}.json",
                   f"{REAL_SIZE_SMOKE_MODEL} && specmoe bench --model {{out}}/real-size-k2-m2 --prompts-file "
                   f"benchmarks/prompts/train.jsonl --no-grid --ablation gamma --ablation-batch-size {s} "
                   f"--ablation-gammas 2,4 {BENCH_SMOKE} --anchors none --json {{out}}/gamma-real-size-{b}.json")
               for b, batches, s in ((1, 4, 1), (64, 1, 4))),
             Run("draft-dense-train-16.json", f"{REAL_SIZE_MODEL} && specmoe bench --model "
                 "{out}/real-size-k8-m16 --prompts-file benchmarks/prompts/train.jsonl --no-grid --ablation "
                 f"draft-dense --ablation-batch-size 16 {REAL_SIZE_RUN} --anchors none "
                 "--json {out}/draft-dense-train-16.json",
                 f"{REAL_SIZE_SMOKE_MODEL} && specmoe bench --model {{out}}/real-size-k2-m2 --prompts-file "
                 f"benchmarks/prompts/train.jsonl --no-grid --ablation draft-dense --ablation-batch-size 2 "
                 f"{BENCH_SMOKE} --anchors none --json {{out}}/draft-dense-train-16.json")),
            lambda docs: "\n".join(report.markdown(docs[name], "gamma-real-size", heading=False) for name in (
                "gamma-real-size-1.json", "gamma-real-size.json", "gamma-real-size-64.json",
                "draft-dense-train-16.json") if name in docs)),
    draft_memory.SECTION,
    draft_split.SECTION,
    Section("grid", "Main grid: every policy, real disk tier",
            "The bundled demo model, greedy, EOS ignored, budget = non-expert bytes + the KV cache reserved for the "
            "run + 30 % of expert bytes; policies interleaved after a warm-up; `auto` plans from the profile "
            "calibrated just before and the speeds earlier runs recorded. The anchors (transformers' `generate`) "
            "run in the same rotation with every weight resident.",
            (Run("grid.json", "specmoe bench --batch-sizes 1,4,16,64 --repeats 3 --policies "
                 "resident,ondemand,overlap,caching,specmoe,auto --json {out}/grid.json --trace-dir {out}/traces",
                 f"specmoe bench --quick --batch-sizes 1,4 {BENCH_SMOKE} --policies "
                 "resident,ondemand,overlap,caching,specmoe,auto --json {out}/grid.json --trace-dir {out}/traces"),),
            _bench("grid.json", _grid_extra)),
    Section("validation", "The performance model against the grid",
            "Every (policy, B) of the grid predicted from the calibrated profile, the model's shape, the workload "
            "seen in the grid's traces (routing fitted to the resident trace, the specmoe trace's acceptance, "
            "overlap's measured recall) and each policy's settings as the bench ran them; nothing is fitted to the "
            "offloaded runs' timings.",
            (Run("validation.json", "python benchmarks/validate_perf.py {out}/grid.json {out}/traces --json "
                 "{out}/validation.json", "python benchmarks/validate_perf.py {out}/grid.json {out}/traces --json "
                 "{out}/validation.json"),),
            lambda docs: validate.markdown(docs["validation.json"])),
    Section("capped", "Capped tier: the paper's transfer-bound regime, emulated",
            "The disk tier's read rate capped (`--offload-bandwidth`) so that one sweep over all experts as the "
            "tier stores them (24 MiB: the checkpoint's bf16) takes about one second: an emulation of a slow "
            "link, not a measurement of one.",
            (Run("capped.json", "specmoe bench --batch-sizes 16 --repeats 3 --policies ondemand,caching,specmoe "
                 "--offload-bandwidth 25MB/s --anchors none --json {out}/capped.json",
                 f"specmoe bench --batch-sizes 2 {BENCH_SMOKE} --policies ondemand,caching,specmoe "
                 "--offload-bandwidth 200MB/s --anchors none --json {out}/capped.json"),),
            _bench("capped.json")),
    Section("quant", "Quantized draft experts against the paper's draft",
            "Same device budget for every draft, capped disk tier; agreement is the share of drafted "
            "tokens equal to the target's argmax at their position. Verification is full precision in every "
            "mode, so the output does not change.",
            (Run("quant.json", "python benchmarks/quant_ablation.py --modes none,int8,int4,int3 --json {out}/quant.json",
                 "python benchmarks/quant_ablation.py --modes none,int8 --num-prompts 4 --batch-size 2 --max-tokens 4 "
                 "--rounds 1 --sweep-s 0.2 --json {out}/quant.json"),),
            lambda docs: tables.quant_ablation(docs["quant.json"])),
    Section("quantized", "Quantized experts: the demo model in bf16, w8a16 and w4a16",
            "`specmoe quantize` writes the demo model's experts as compressed-tensors int8 and int4 (groups of 128, "
            "round to nearest); its peak resident memory is measured over the rewrite. Perplexity: every held-out "
            "paragraph, float32, experts resident. Speeds (the default encoding, gamma 5): the experts move as "
            "stored, and each enters its pool slot as Q8_0 / Q4_0 blocks the block kernels multiply; bf16 in "
            "bfloat16.",
            (Run("quantized.json", "python benchmarks/quantized_models.py --json {out}/quantized.json",
                 "python benchmarks/quantized_models.py --batch-sizes 1 --max-tokens 4 --repeats 1 --ppl-prompts 8 "
                 "--json {out}/quantized.json"),),
            lambda docs: tables.quantized_models(docs["quantized.json"])),
    *gguf_tables.REAL_SIZE_SECTIONS,
    beyond_memory.BEYOND_MEMORY,
    Section("gguf", "GGUF files: the demo model as Q8_0 and Q4_K against its bf16 safetensors",
            "specmoe.tools.gguf_convert writes the demo model as GGUF, laid out as llama.cpp's converter lays it "
            "out (the Q4_K file keeps the experts' 128-wide down projections in Q5_0, as llama.cpp falls back). "
            "Perplexity: every held-out paragraph, float32, experts resident. Speeds (the default encoding, gamma "
            "5): the experts stay in the file's encoding on the disk tier, in every transfer and in the pool, and "
            "are multiplied as stored.",
            (Run("gguf.json", "python benchmarks/gguf_models.py --json {out}/gguf.json",
                 "python benchmarks/gguf_models.py --batch-sizes 1 --max-tokens 4 --repeats 1 --ppl-prompts 8 "
                 "--json {out}/gguf.json"),),
            lambda docs: gguf_tables.gguf_models(docs["gguf.json"])),
    Section("ablations", "Ablations of the paper's draft",
            "The paper's draft (`--draft-quant none`: N full-precision experts per block, the rest substituted) "
            "with each knob varied beside ondemand in one rotation, real disk tier.",
            # the paper's knobs; the later draft ablations are measured in their own sections
            (Run("ablations.json", "specmoe bench --no-grid --ablation draft-set,substitution,draft-experts,gamma,"
                 "draft-quant --json {out}/ablations.json",
                 f"specmoe bench --no-grid --ablation draft-experts --ablation-batch-size 2 {BENCH_SMOKE} "
                 "--json {out}/ablations.json"),),
            _bench("ablations.json")),
    Section("host", "Host tier",
            "Experts in host memory. On a CPU-only machine the host tier is the same memory as the device: moving "
            "an expert is a memory copy, so nothing is transfer-bound and `host` (compute where the expert lives) "
            "is the reference.",
            (Run("host.json", "specmoe bench --offload host --batch-sizes 16 --repeats 3 --anchors none "
                 "--json {out}/host.json",
                 f"specmoe bench --offload host --batch-sizes 2 {BENCH_SMOKE} --anchors none --json {{out}}/host.json"),),
            _bench("host.json")),
    Section("identity", "SpecMoE's output equals resident's on the demo model",
            "Held-out prompts (2 x B), 30 % budget, both tiers: γ = 1, 3, 5, 10 with the default draft, and every "
            "draft set x substitution with the paper's draft at γ = 5.",
            (Run("identity.json", "python benchmarks/spec_identity.py --json {out}/identity.json",
                 "python benchmarks/spec_identity.py --batch-sizes 1 --max-tokens 4 --json {out}/identity.json"),),
            lambda docs: tables.spec_identity(docs["identity.json"])),
    Section("serving", "Serving: concurrent requests on loopback",
            "Streamed greedy completions against `specmoe serve` started by the script; × one at a time is the "
            "throughput against requests sent one at a time first, in the same run.",
            (Run("serving-resident.json", "python benchmarks/load_test.py --requests 200 --concurrency 32 "
                 "--max-tokens 32 --json > {out}/serving-resident.json",
                 "python benchmarks/load_test.py --requests 8 --concurrency 4 --max-tokens 4 --baseline-requests 2 "
                 "--json > {out}/serving-resident.json"),
             Run("serving-specmoe.json", "python benchmarks/load_test.py --requests 96 --concurrency 32 "
                 "--max-tokens 32 --json -- --policy specmoe --offload host --device-memory 300MiB "
                 "> {out}/serving-specmoe.json",
                 "python benchmarks/load_test.py --requests 8 --concurrency 4 --max-tokens 4 --baseline-requests 0 "
                 "--json -- --policy specmoe --offload host --device-memory 300MiB > {out}/serving-specmoe.json")),
            lambda docs: tables.load_tests({"demo model, resident": docs["serving-resident.json"],
                                            "demo model, specmoe (host tier, 300 MiB)": docs["serving-specmoe.json"]})),
    Section("soak", "Soak: the server under a steady mix of requests",
            "`specmoe serve` with SpecMoE on the disk tier (30 % budget) for 20 minutes at concurrency 32: streamed, "
            "plain (completion and chat), cancelled (the client hangs up after the first text) and invalid requests "
            "(each must get its 4xx error object); errors by kind, latency of the served requests, sequences left in "
            "the server afterwards, and the server's resident memory after a 2-minute warm-up and at the end.",
            (Run("soak.json", "python benchmarks/soak.py --duration 1200 --concurrency 32 --json -- --policy specmoe "
                 "--offload disk --device-memory 30% > {out}/soak.json",
                 "python benchmarks/soak.py --duration 20 --concurrency 4 --json -- --policy specmoe "
                 "--offload disk --device-memory 30% > {out}/soak.json"),),
            lambda docs: tables.soak(docs["soak.json"])),
    Section("eval", "Evaluation throughput: an lm-evaluation-harness run's requests",
            "The requests an lm-eval run sends, through the engine, on the held-out Python docs "
            "(`benchmarks/eval_tasks.py`): every choice of 200 multiple-choice questions scored as one prefill-only "
            "request (`max_tokens` 0, prompt log-probabilities), and 50 greedy generations up to a newline; each "
            "offloading policy with the same budget (30 % of expert bytes) on the disk tier, × resident measured in "
            "the same run; results = resident's: the same tokens, log-likelihoods within 1e-4.",
            (Run("eval.json", "python benchmarks/eval_throughput.py --questions 200 --generations 50 --batch-sizes 1,16 "
                 "--device-memory 30% --offload disk --json {out}/eval.json",
                 "python benchmarks/eval_throughput.py --questions 4 --generations 2 --batch-sizes 2 "
                 "--device-memory 30% --offload disk --json {out}/eval.json"),),
            lambda docs: tables.eval_throughput(docs["eval.json"])),
    Section("ui", "The web page's cost to the server",
            "`specmoe serve` (SpecMoE, disk tier, 30 % budget, batches up to 16) under the same concurrent load with "
            "the page closed and open, alternating round by round: open as one client reading the live view's event "
            "stream, and as the page itself in headless Chromium on this machine (which also pays for rendering on "
            "the same 2 cores).",
            (Run("ui-sse.json", "python benchmarks/ui_overhead.py --rounds 3 --requests 64 --concurrency 16 "
                 "--max-tokens 64 --json -- --policy specmoe --offload disk --device-memory 30% --max-batch-size 16 "
                 "> {out}/ui-sse.json",
                 "python benchmarks/ui_overhead.py --rounds 1 --requests 4 --concurrency 2 --max-tokens 4 --json "
                 "-- --policy specmoe --offload disk --device-memory 30% > {out}/ui-sse.json"),
             Run("ui-browser.json", "python benchmarks/ui_overhead.py --browser --rounds 3 --requests 64 "
                 "--concurrency 16 --max-tokens 64 --json -- --policy specmoe --offload disk --device-memory 30% "
                 "--max-batch-size 16 > {out}/ui-browser.json",
                 "python benchmarks/ui_overhead.py --browser --rounds 1 --requests 4 --concurrency 2 --max-tokens 4 "
                 "--json -- --policy specmoe --offload disk --device-memory 30% > {out}/ui-browser.json")),
            lambda docs: tables.ui_overhead({"event stream (1 client)": docs["ui-sse.json"],
                                             "the page in headless Chromium": docs["ui-browser.json"]})),
    Section("projections", "Projections for the paper's models (simulated)",
            "From profiles and shapes that are data (an H100 with PCIe 5, experts in host memory, assumed routing: "
            "Zipf-like hotness, temporal locality 0.2), the paper's draft of N resident experts. NLLB-MoE is "
            "modelled as the encoder-decoder it is (the encoder once per request over a 64-token source, spread "
            "over the request's 64 decoded tokens; decode steps run the decoder with cross-attention) and given "
            "the paper's 7.27 tokens per step at γ = 10. DeepSeek-V3 (256 routed experts, 8 per token) and "
            "GPT-OSS-120B (128, 4 per token) are modelled with bf16 experts, the paper's draft and an assumed "
            "acceptance of 0.7 (no trace of them exists here). For comparison, "
            "the paper reports (measured, not simulated) 4.30x over on-demand fetching for NLLB-MoE at B = 256 with "
            "76.73 % fewer bytes moved, 2.17x for Mixtral-8x7B and 1.42x for Llama-4-Scout.",
            tuple(Run(f"simulate-{name}.json", SIM + args + f" > {{out}}/simulate-{name}.json",
                      SIM + args + f" > {{out}}/simulate-{name}.json")
                  for name, args in {**SIMULATIONS, "mixtral-check": "mixtral-8x7b --batch-sizes 1,16,256"}.items()),
            _projections),
    Section("replicas", "Engine replicas on Ray: offline throughput, measured and projected",
            "`ReplicatedLLM` (`specmoe generate --replicas N`) against one engine, here: this machine's cores are "
            "all the replicas get, so several replicas share the same cores and little or no gain is expected "
            "(what they add is Ray's overhead); replicas pay off with a GPU, or a node, each. Below it, the "
            "performance model's projection for a cluster: replicas are independent engines, so the cluster's "
            "throughput is the sum of theirs, less what the replicas on one node share (the host tier: the "
            "node's DRAM bandwidth, and one copy of the experts per replica in its host memory; the disk tier: "
            "the node's SSD).",
            (Run("replicas.json", "python benchmarks/replicas.py --json {out}/replicas.json",
                 "python benchmarks/replicas.py --num-prompts 8 --max-tokens 4 --batch-size 4 --rounds 1 "
                 "--json {out}/replicas.json"),
             Run("replicas-projection.json", "python benchmarks/replicas.py --project --json "
                 "{out}/replicas-projection.json", "python benchmarks/replicas.py --project --json "
                 "{out}/replicas-projection.json")),
            lambda docs: replicas.measured(docs["replicas.json"]) + "\n"
            + replicas.projection(docs["replicas-projection.json"])),
    Section("anchors", "Resident decoding against the engines users would pick",
            "Batch 1, the held-out prompts, every weight resident, float32, greedy, the same token ids and the same "
            "number of threads for all: specmoe's resident policy, transformers' `generate` and llama.cpp (a float32 "
            "GGUF copy of the demo model; `make anchors` builds llama-cpp-python first, else the row says it was "
            "skipped). × resident is each anchor's decode tokens/s over resident's in the same run; tokens = "
            "resident is the share of its tokens equal to resident's.",
            (Run("anchors.json", "specmoe bench --batch-sizes 1 --policies resident --anchors transformers,llama.cpp "
                 "--repeats 5 --max-tokens 64 --threads 1 --json {out}/anchors.json",
                 f"specmoe bench --batch-sizes 1 --policies resident --anchors transformers,llama.cpp {BENCH_SMOKE} "
                 "--json {out}/anchors.json"),),
            _bench("anchors.json")),
    Section("profile", "Where a decode step's time goes, before and after",
            "A plain decode step (resident), a draft forward and the rest of a speculative step (verify pass, "
            "acceptance, roll-back; SpecMoE on the disk tier, 30 % budget, γ = 5) on the held-out prompts, at "
            "B = 1, 16 and 64, with the code before this work (`--source-rev " + PROFILE_BASE + "`, the same "
            "script) and after. ms: thread CPU time per unit, unprofiled, median of 3 runs (the disk tier's reads "
            "run on another thread). Operators: top-level torch operators per unit; between operators: the share "
            "of profiled time spent outside them (Python; in verify also waiting for the disk tier). Shares: each category's part of operator time, from a "
            "profile with Python stacks (expert matmuls: the projections; expert dispatch: grouping, gathering, "
            "dequantizing and combining).",
            (Run("profile-before.json", f"python benchmarks/profile_passes.py --source-rev {PROFILE_BASE} "
                 "--json {out}/profile-before.json",
                 f"python benchmarks/profile_passes.py --source-rev {PROFILE_BASE} --batch-sizes 1 --max-tokens 4 "
                 "--repeats 1 --json {out}/profile-before.json"),
             Run("profile-after.json", "python benchmarks/profile_passes.py --json {out}/profile-after.json",
                 "python benchmarks/profile_passes.py --batch-sizes 1 --max-tokens 4 --repeats 1 "
                 "--json {out}/profile-after.json")),
            lambda docs: (tables.profile_summary(docs["profile-before.json"], docs["profile-after.json"])
                          + "\nShare of operator time by category, before → after:\n\n"
                          + tables.profile_categories(docs["profile-before.json"], docs["profile-after.json"]))),
    Section("translate", "NLLB-MoE's measurements on the bundled translation model",
            "`specmoe-demo-translate` (NLLB-MoE layout, 16 experts top-2, trained here on Debian's English-French "
            "gettext catalogs) translating held-out UI strings, greedy: ondemand, caching and SpecMoE interleaved "
            "round by round after a warm-up, the median round, every output checked against resident; budget as "
            "in the main grid (30 % of expert bytes). The paper measures NLLB-MoE 54B (128 experts) on an H100 "
            "behind PCIe 5 at B up to 256; here a 13 M-parameter model computes on 2 CPU cores and its experts "
            "come from a disk, so compute weighs far more against transfers, B stops at 64 and a 16-expert block "
            "is covered by fewer tokens; the demo model was trained for about an hour, so its draft agrees with "
            "it less often than a large trained model's.",
            (Run("translate.json", "python benchmarks/translate_bench.py --json {out}/translate.json",
                 "python benchmarks/translate_bench.py --batch-sizes 1,4 --rounds 1 --max-tokens 6 "
                 "--ablation-batch-size 4 --json {out}/translate.json"),),
            lambda docs: translate.translate(docs["translate.json"])),
    Section("quick", "Quick run",
            "`specmoe bench --quick`: every policy at B = 1 and 16, 16 tokens, one repeat, for smoke runs; at one "
            "repeat the ratios are noisy: use the main grid.",
            (Run("quick.json", "specmoe bench --quick --json {out}/quick.json",
                 f"specmoe bench --quick --batch-sizes 1 {BENCH_SMOKE} --anchors none --json {{out}}/quick.json"),),
            _bench("quick.json")),
)


def commands_run(results: Path) -> dict[str, str]:
    path = results / COMMANDS_FILE
    return json.loads(path.read_text()) if path.is_file() else {}


def render(section: Section, results: Path) -> str:
    """The section's body: what it measures, its commands, and its figures (or a note
    that they have not been measured into `results` yet)."""
    ran = commands_run(results)
    commands = [ran.get(run.output, run.command.replace("{out}", str(results))) for run in section.runs]
    out = [f"## {section.title}", "", section.about, "", "```", *commands, "```", ""]
    missing = [run.output for run in section.runs if not (results / run.output).is_file()]
    if missing:
        out.append(f"Not measured yet ({', '.join(missing)} missing): `make bench` runs the commands above.\n")
    else:
        out.append(section.render({run.output: json.loads((results / run.output).read_text())
                                   for run in section.runs}))
    return "\n".join(out).rstrip("\n") + "\n"


def keep_documents(results: Path, kept: Path, names: list[str]) -> list[str]:
    """Copy the documents of these sections (and the commands that wrote them) from
    `results` into `kept`, the directory committed beside BENCHMARKS.md: rendering from it
    reproduces those sections byte for byte. Returns the files copied."""
    kept.mkdir(parents=True, exist_ok=True)
    ran, recorded = commands_run(results), commands_run(kept)
    copied = []
    for section in SECTIONS:
        if section.name not in names:
            continue
        for run in section.runs:
            (kept / run.output).write_bytes((results / run.output).read_bytes())
            if run.output in ran:
                recorded[run.output] = ran[run.output]
            copied.append(run.output)
    (kept / COMMANDS_FILE).write_text(json.dumps(recorded, indent=1) + "\n")
    return copied


def write_report(results: Path, markdown: Path) -> list[str]:
    """Rewrite every section of `markdown` measured in `results` (a section not in the file
    yet is appended, in this module's order, with a note when it has no figures; one
    already in the file whose documents are not in `results` keeps what the file has, so
    re-running a few sections into a fresh results dir loses no other section's figures);
    then the summary at the page's top and README's headline table beside it (summary.py);
    returns the sections rewritten with figures."""
    measured = []
    for section in SECTIONS:
        complete = all((results / run.output).is_file() for run in section.runs)
        if not complete and report.has_section(markdown, section.name):
            continue
        report.update_markdown(markdown, section.name, render(section, results))
        if complete:
            measured.append(section.name)
    # the summary's rows: each section's documents from `results`, else from those committed beside the page
    summary.write_summaries(markdown, SECTIONS, [results, markdown.parent / KEPT])
    return measured
