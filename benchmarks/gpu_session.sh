#!/usr/bin/env bash
# What a lent GPU machine runs for this project, in priority order, inside one device call: the GPU tier's quick
# tests, transformer-big's step (bf16, ours against transformers on the same batches), the torch.compile / CUDA-graph
# variants with a profile of the fastest, the rest of the precision × recompute × token-batch grid, and the GPU tier's
# train-save-resume runs. Each stage gets at most the time left of BUDGET_S. OUT gets seven files at most (the device
# tool brings back eight): session.log (every stage's output), headline.json, compile.json, graphs.json, grid.json
# and profile/{profile.json,trace.json.gz}; data, tokenizer and runs go to WORK.
#
#   bash benchmarks/gpu_wheels.sh                       # here, once: the packages the GPU image lacks → .whl/
#   device tool: run(command="bash benchmarks/gpu_session.sh", carry=[".whl"], timeout_s=600)
#   bash benchmarks/gpu_session.sh headline compile     # only these stages
#
# Stages: env tier_quick headline compile graphs grid tier_full (all, in this order, by default). `compile` runs
# eager and torch.compile side by side (the profile takes the faster); `graphs` runs CUDA graphs over 4 repeated
# batches — packed token batches rarely repeat a shape, so this is what graphs could give at best.
# Environment: OUT (default out/gpu_session; the device tool sets it), WORK (default /tmp/gpu_session_work),
# BUDGET_S (default 540), SIZE (big; tiny runs the plumbing on a CPU), TOKENS (the headline's --max_tokens, default
# 25000), STEPS (default 10). Record what it printed in GPU_RESULTS.md.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-out/gpu_session}
WORK=${WORK:-/tmp/gpu_session_work}
BUDGET_S=${BUDGET_S:-540}
SIZE=${SIZE:-big}
TOKENS=${TOKENS:-25000}
STEPS=${STEPS:-10}
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$OUT" "$WORK"
DEADLINE=$(( $(date +%s) + BUDGET_S ))
STAGES=("$@")
KNOWN=" env tier_quick headline compile graphs grid tier_full "
[ ${#STAGES[@]} -gt 0 ] || read -r -a STAGES <<< "$KNOWN"
for s in "${STAGES[@]}"; do        # every name checked before any stage spends the budget
    [[ $KNOWN == *" $s "* ]] || { echo "unknown stage $s (one of:$KNOWN)" >&2; exit 2; }
done

left() { echo $(( DEADLINE - $(date +%s) )); }

LOG="$OUT/session.log"
RESULT_LINES="^(tiny|big) |transformers on|profile|device busy|launches|  host|passed|failed|error|GPU |greedy"
RESULT_LINES+="|one training step"
# stage NAME CAP_S COMMAND...: run with the smaller of CAP_S and the time left; its whole output goes to session.log,
# its result lines to standard output too (what the device tool shows of a call)
stage() {
    local name=$1 cap=$2; shift 2
    local t; t=$(left)
    [ "$t" -gt "$cap" ] && t=$cap
    if [ "$t" -lt 20 ]; then echo "== $name: skipped, ${t}s left of BUDGET_S" | tee -a "$LOG"; return; fi
    echo "== $name (at most ${t}s): $*" | tee -a "$LOG"
    local start=$SECONDS part="$WORK/$name.log"
    timeout --kill-after=10 "$t" "$@" > "$part" 2>&1
    local rc=$?
    cat "$part" >> "$LOG"
    echo "== $name: exit $rc after $(( SECONDS - start ))s" | tee -a "$LOG"
    grep -E "$RESULT_LINES" "$part" | tail -40
}

# the packages the GPU image lacks, from the carried wheels (installed only where an import fails)
if ! python3 -c "import deepspeed, datasets, pydantic" >/dev/null 2>&1; then
    if ls .whl/*.whl >/dev/null 2>&1; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
            .whl/*.whl && export PYTHONPATH="$PYTHONPATH:/tmp/site"
        python3 -c "import deepspeed, datasets, pydantic" >/dev/null 2>&1 \
            || { echo "the carried wheels did not install (see pip's output above)" >&2; exit 2; }
    else
        echo "deepspeed/datasets/pydantic missing and no .whl/: run benchmarks/gpu_wheels.sh here and carry .whl" >&2
        exit 2
    fi
fi

STEP=(python3 benchmarks/gpu_step.py --size "$SIZE" --steps "$STEPS" --warmup 3 --workdir "$WORK")
for s in "${STAGES[@]}"; do
    case $s in
        env) { nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "no nvidia-smi"
               python3 -c "import sys, torch, deepspeed, transformers; print(sys.version.split()[0], 'torch',
torch.__version__, 'cuda', torch.version.cuda, torch.cuda.is_available(), 'deepspeed', deepspeed.__version__,
'transformers', transformers.__version__)"
               python3 -m pip list 2>/dev/null | grep -iE "^(typing.extensions|pyarrow|fsspec|triton) "
             } 2>&1 | grep -v "^\[" | tee -a "$LOG" ;;
        tier_quick) stage tier_quick 120 python3 -m pytest -q -s -p no:cacheprovider tests/test_gpu.py \
                        -k "syncs or pinned or greedy" ;;
        headline) stage headline 200 "${STEP[@]}" --precision bf16 --recompute 0 --max_tokens "$TOKENS" --hf \
                      --json "$OUT/headline.json" ;;
        compile) stage compile 240 "${STEP[@]}" --precision bf16 --recompute 0 --max_tokens "$TOKENS" \
                     --compile none default --profile "$OUT/profile" --json "$OUT/compile.json"
                 [ -f "$OUT/profile/trace.json" ] && gzip -f "$OUT/profile/trace.json" ;;
        graphs) stage graphs 240 "${STEP[@]}" --precision bf16 --recompute 0 --max_tokens "$TOKENS" \
                    --compile default reduce-overhead --repeat_batches 4 --warmup 8 --json "$OUT/graphs.json" ;;
        grid) stage grid 400 "${STEP[@]}" --precision bf16 fp32 --recompute 0 1 --json "$OUT/grid.json" ;;
        tier_full) stage tier_full 400 python3 -m pytest -q -s -p no:cacheprovider tests/test_gpu.py \
                       -k "not (syncs or pinned or greedy)" ;;
    esac
done
echo "== done, $(left)s of BUDGET_S left; files in $OUT" | tee -a "$LOG"
