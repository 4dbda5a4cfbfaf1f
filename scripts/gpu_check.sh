#!/usr/bin/env bash
# The GPU check (issue 9), one run of at most 8 minutes on one CUDA GPU:
#
#   1. the GPU (nvidia-smi, torch)          5. engine traces at batch 1, 16, 64, 256 on the demo
#   2. pytest tests/test_cuda.py               model (specmoe; ondemand too while time allows)
#   3. specmoe calibrate --json             6. specmoe replay at Mixtral-8x7B layer shape:
#   4. specmoe bench --offload host            ondemand, overlap, caching, specmoe x those batches
#      (demo model, batch 1, 16, 64)        7. a short table, last
#
#   scripts/gpu_check.sh [OUTDIR]      (default: $OUT, else ./gpu_out)
#
# Writes under OUTDIR: gpu_check.log (everything), calibrate.json, bench.json, replay.json,
# replay.txt, traces.tgz, summary.txt. Each stage has its own timeout, cut so that the stages
# after it keep their share of the 8 minutes; a failed or skipped stage is reported and the
# script goes on. Python: $PYTHON, else python3 (the one that has CUDA torch); the package is
# used from src/ when it is not installed (nothing is downloaded).
# Knobs: GPU_CHECK_BUDGET_S (470), REPLAY_LAYERS (2), REPLAY_STEPS (4), TRACE_TOKENS (32),
# GPU_CHECK_BATCHES ("1 16 64 256"), GPU_CHECK_SKIP (stage names to skip, e.g. "bench cuda-tests"),
# and for a dry run without a GPU: REPLAY_DEVICE (cuda), REPLAY_SCALE (1), GPU_CHECK_TIME_SCALE (1:
# multiplies every stage's time, with GPU_CHECK_BUDGET_S raised to match).

set -u

OUTDIR=${1:-${OUT:-./gpu_out}}
mkdir -p "$OUTDIR" && OUTDIR=$(cd "$OUTDIR" && pwd)
REPO=$(cd "$(dirname "$0")/.." && pwd)
cd "$REPO" || exit 2
WORK=${GPU_CHECK_WORK:-${TMPDIR:-/tmp}/specmoe-gpu-check}
rm -rf "$WORK/traces" "$WORK/cache" "$WORK/calibrate" && mkdir -p "$WORK/traces" "$WORK/cache"
LOG=$OUTDIR/gpu_check.log
: >"$LOG"
export OUTDIR WORK PYTHONUNBUFFERED=1 SPECMOE_CACHE=$WORK/cache SPECMOE_CACHE_DIR=$WORK/cache
export PY=${PYTHON:-python3}
export SPECMOE="$PY -m specmoe.cli"
BUDGET=${GPU_CHECK_BUDGET_S:-470}
LAYERS=${REPLAY_LAYERS:-2}
STEPS=${REPLAY_STEPS:-4}
TOKENS=${TRACE_TOKENS:-32}
BATCHES=${GPU_CHECK_BATCHES:-1 16 64 256}
SKIP=" ${GPU_CHECK_SKIP:-} "
TSCALE=${GPU_CHECK_TIME_SCALE:-1}
START=$SECONDS
FAILED=()

log() { echo "[gpu_check +$((SECONDS - START))s] $*" | tee -a "$LOG"; }
left() { echo $((BUDGET - (SECONDS - START))); }

# stage NAME WANT_S RESERVE_S 'COMMAND': run COMMAND (bash -c; stdout and stderr to the log
# unless it redirects them) with a timeout of WANT_S, cut to leave RESERVE_S for later stages.
stage() {
    local name=$1 want=$2 reserve=$3 cmd=$4 t rc
    if [[ $SKIP == *" $name "* ]]; then
        log "SKIP  $name (GPU_CHECK_SKIP)"
        return 1
    fi
    want=$((want * TSCALE)) reserve=$((reserve * TSCALE))
    t=$(($(left) - reserve))
    ((t > want)) && t=$want
    if ((t < 10)); then
        log "SKIP  $name: $(left)s left, $reserve s kept for later stages"
        FAILED+=("$name (skipped: no time)")
        return 1
    fi
    log "START $name (timeout ${t}s): $cmd"
    timeout -k 5 "$t" bash -c "$cmd" >>"$LOG" 2>&1
    rc=$?
    if ((rc == 0)); then
        log "OK    $name"
    else
        ((rc == 124 || rc == 137)) && log "FAIL  $name: timed out after ${t}s" || log "FAIL  $name: exit $rc"
        FAILED+=("$name (exit $rc)")
    fi
    return $rc
}

# ---- 1. the GPU and python ----------------------------------------------------------------------
log "repo $REPO, out $OUTDIR, work $WORK, budget ${BUDGET}s"
if command -v nvidia-smi >/dev/null; then
    timeout 20 nvidia-smi 2>&1 | tee -a "$LOG"
    timeout 20 nvidia-smi --query-gpu=name,memory.total,driver_version,pcie.link.gen.max,pcie.link.width.max \
        --format=csv 2>&1 | tee -a "$LOG"
else
    log "nvidia-smi not found"
fi
if ! timeout 60 $PY -c "import specmoe" >/dev/null 2>&1; then
    export PYTHONPATH=$REPO/src${PYTHONPATH:+:$PYTHONPATH}
    if timeout 60 $PY -c "import specmoe" >>"$LOG" 2>&1; then
        log "specmoe used from $REPO/src (PYTHONPATH)"
    else
        stage install 120 300 '$PY -m pip install -q --no-deps --no-build-isolation -e .'
    fi
fi
timeout 60 $PY -c "
import sys, torch, specmoe
print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda,
      'available', torch.cuda.is_available())
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print('gpu', p.name, round(p.total_memory / 2**30, 1), 'GiB,', p.multi_processor_count, 'SMs')
" 2>&1 | tee -a "$LOG"

# Reserves: what the stages after each one need at least (replay 150 s, traces 60 s).
# ---- 2. CUDA tests -------------------------------------------------------------------------------
stage cuda-tests 100 240 '$PY -m pytest tests/test_cuda.py -q -rs -p no:cacheprovider'

# ---- 3. calibrate --------------------------------------------------------------------------------
HW_ARG=""
stage calibrate 60 220 '$SPECMOE calibrate --json --name gpucheck --size 256MiB --dir "$WORK/calibrate" \
        > "$OUTDIR/calibrate.json"'
[[ -s $SPECMOE_CACHE_DIR/profiles/gpucheck.json ]] && HW_ARG="--hardware gpucheck"  # saved, even if exit was slow

# ---- 4. bench grid on the demo model (experts in host memory) -------------------------------------
if timeout 60 $SPECMOE bench --help >"$WORK/bench-help.txt" 2>&1; then
    TRACE_DIR_ARG=""
    grep -q -- "--trace-dir" "$WORK/bench-help.txt" && TRACE_DIR_ARG="--trace-dir \"$WORK/traces\""
    ANCHORS_ARG=""
    grep -q -- "--anchors" "$WORK/bench-help.txt" && ANCHORS_ARG="--anchors none"
    stage bench 120 220 "\$SPECMOE bench --offload host --batch-sizes 1,16,64 --repeats 1 --max-tokens 32 \
        $ANCHORS_ARG $TRACE_DIR_ARG --json \"\$OUTDIR/bench.json\""
else
    log "SKIP  bench: 'specmoe bench --help' failed (not in this build?)"
    FAILED+=("bench (not available)")
fi

# ---- 5. traces -----------------------------------------------------------------------------------
# a bench stopped by its timeout may leave a trace cut mid-line: keep only traces that read
timeout 60 $PY - "$WORK"/traces/*.jsonl >>"$LOG" 2>&1 <<'EOF'
import os, sys
from specmoe.base.trace import read_trace
for f in sys.argv[1:]:
    if not os.path.isfile(f):
        continue
    try:
        read_trace(f)
    except ValueError as e:
        print(f"dropping unreadable trace {f}: {e}")
        os.remove(f)
EOF
PROMPTS=benchmarks/prompts/heldout.jsonl
n=$(grep -c . "$PROMPTS" 2>/dev/null || echo 0)
if ((n < 256)); then  # repeat the file's prompts to 256
    : >"$WORK/prompts.jsonl"
    while (($(grep -c . "$WORK/prompts.jsonl") < 256)) && ((n > 0)); do cat "$PROMPTS" >>"$WORK/prompts.jsonl"; done
    PROMPTS=$WORK/prompts.jsonl
fi
export PROMPTS TOKENS
record() {  # record POLICY B: a trace unless the bench already wrote one
    local policy=$1 b=$2 f="$WORK/traces/$1-b$2.jsonl"
    if [[ -s $f ]]; then
        log "trace $policy-b$b.jsonl from the bench run"
        return 0
    fi
    stage "trace-$policy-b$b" 60 "$3" "\$SPECMOE generate --prompts-file \"\$PROMPTS\" --num-prompts $b --batch-size $b \
        --max-tokens \$TOKENS --ignore-eos --policy $policy --offload host --trace \"$f\" --json > /dev/null"
}
for b in $BATCHES; do record specmoe "$b" 150; done
# exact decode routing for the baselines where time allows (else replay derives it from specmoe's)
for b in $(echo $BATCHES | tr ' ' '\n' | sort -rn); do record ondemand "$b" 170; done

# ---- 6. replay at Mixtral-8x7B layer shape --------------------------------------------------------
TRACE_ARGS=""
RBATCHES=""
for f in "$WORK"/traces/{specmoe,ondemand,overlap,caching}-b*.jsonl; do
    [[ -s $f ]] || continue
    base=$(basename "$f" .jsonl)
    TRACE_ARGS+=" --trace ${base%%-b*}=$f"
    [[ $base == specmoe-b* ]] && RBATCHES+="${RBATCHES:+,}${base#specmoe-b}"
done
if [[ -n $RBATCHES ]]; then
    RBATCHES=$(echo "$RBATCHES" | tr ',' '\n' | sort -n | paste -sd, -)
    stage replay 200 15 "\$SPECMOE replay $TRACE_ARGS --model-shape mixtral-8x7b --layers $LAYERS --dtype bfloat16 \
        --device ${REPLAY_DEVICE:-cuda} --scale ${REPLAY_SCALE:-1} --offload host $HW_ARG --policies ondemand,overlap,caching,specmoe --batch-sizes $RBATCHES \
        --max-steps $STEPS --output \"\$OUTDIR/replay.json\" > \"\$OUTDIR/replay.txt\""
    cat "$OUTDIR/replay.txt" >>"$LOG" 2>/dev/null
else
    log "SKIP  replay: no specmoe trace was recorded"
    FAILED+=("replay (no traces)")
fi
(cd "$WORK" && tar czf "$OUTDIR/traces.tgz" traces 2>/dev/null)

# ---- 7. summary ----------------------------------------------------------------------------------
export FAILED_LIST="${FAILED[*]:-}"
timeout 30 $PY - >"$OUTDIR/summary.txt" 2>&1 <<'EOF'
import json, os
from pathlib import Path

out = Path(os.environ["OUTDIR"])
def load(name):
    try:
        return json.loads((out / name).read_text())
    except (OSError, ValueError):
        return None

print("=" * 100)
cal = load("calibrate.json")
if cal:
    m = cal.get("measurements", {})
    if "h2d_pinned_bw" in m:
        print(f"GPU {m.get('cuda_device')}: host->device pinned {m['h2d_pinned_bw'] / 1e9:.1f} GB/s, pageable "
              f"{m['h2d_pageable_bw'] / 1e9:.1f} GB/s, per-copy latency {m['h2d_latency_s'] * 1e6:.1f} us, "
              f"bf16 matmul {m['gpu_matmul_flops_bf16'] / 1e12:.0f} TFLOP/s, HBM {m['gpu_mem_bw'] / 1e12:.2f} TB/s")
    else:
        print("calibrate ran without CUDA measurements")
else:
    print("calibrate: no result")
bench = load("bench.json")
if bench and isinstance(bench.get("records"), list):
    rows = {}
    for r in bench["records"]:
        if isinstance(r, dict) and "policy" in r and "batch_size" in r:
            v = r.get("decode_tokens_per_s") or r.get("decode_tokens_per_s_median")
            if isinstance(v, (int, float)):
                rows.setdefault(r["policy"], {})[r["batch_size"]] = v
    sizes = sorted({b for v in rows.values() for b in v})
    print("bench (demo model, experts in host memory), decode tok/s:  B = " + "  ".join(f"{b:>8}" for b in sizes))
    for p, v in rows.items():
        print(f"  {p:10}" + " " * 40 + "  ".join(f"{v.get(b, float('nan')):8.1f}" for b in sizes))
else:
    print("bench: no result")
rep = out / "replay.txt"
print(rep.read_text().rstrip() if rep.is_file() and rep.stat().st_size else "replay: no result")
failed = os.environ.get("FAILED_LIST", "").strip()
print("stages failed or skipped: " + (failed or "none"))
EOF
log "done in $((SECONDS - START))s"
cat "$OUTDIR/summary.txt" | tee -a "$LOG"
