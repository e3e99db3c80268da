#!/usr/bin/env bash
# What a lent GPU machine runs for this project inside one device call, in priority order, each stage under the time
# left of BUDGET_S: the machine and its packages (first, always), transformer-big's step (bf16, ours — written at
# once — then a profile of the same warm engine, then `transformers` on the same batches), the GPU tier's quick
# tests, torch.compile of every block. By default that fits ~300 s, so a first call leaves device time to rerun.
# Named stages add the CUDA-graph upper bound, the precision × recompute × token-batch grid and the GPU tier's
# train-save-resume runs. OUT gets seven files at most (the device tool brings back eight): session.log (every
# stage's output, streamed as it comes), headline.json, compile.json, graphs.json, grid.json and
# profile/{profile.json,trace.json.gz}; data, tokenizer and runs go to WORK.
#
#   bash benchmarks/gpu_wheels.sh                       # here, once: the packages the GPU image lacks → .whl/
#   device tool: run(command="bash benchmarks/gpu_session.sh", carry=[".whl"], timeout_s=600)
#   bash benchmarks/gpu_session.sh graphs grid tier_full  # a second call: only these stages
#
# Stages: env headline tier_quick compile (the default), graphs grid tier_full. `env` runs first whatever is named.
# Each stage imports only what it needs (torch, deepspeed, pydantic; `transformers` only for the headline's
# reference, whose failure is that row's hf_error); a stage whose packages are missing is skipped with their names.
# Environment: OUT (default out/gpu_session; the device tool sets it), WORK (default /tmp/gpu_session_work),
# BUDGET_S (default 300), SIZE (big; tiny runs the plumbing on a CPU), TOKENS (the headline's --max_tokens, default
# 25000), STEPS (default 10), PRECISION (default bf16; fp32 for a CPU without bf16), WHEELS (default .whl). Record the figures in
# GPU_RESULTS.md.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-out/gpu_session}
WORK=${WORK:-/tmp/gpu_session_work}
BUDGET_S=${BUDGET_S:-300}
SIZE=${SIZE:-big}
TOKENS=${TOKENS:-25000}
STEPS=${STEPS:-10}
PRECISION=${PRECISION:-bf16}
WHEELS=${WHEELS:-.whl}
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$OUT" "$WORK"
DEADLINE=$(( $(date +%s) + BUDGET_S ))
STAGES=("$@")
KNOWN=" env headline tier_quick compile graphs grid tier_full "
[ ${#STAGES[@]} -gt 0 ] || STAGES=(headline tier_quick compile)
for s in "${STAGES[@]}"; do        # every name checked before any stage spends the budget
    [[ $KNOWN == *" $s "* ]] || { echo "unknown stage $s (one of:$KNOWN)" >&2; exit 2; }
done

left() { echo $(( DEADLINE - $(date +%s) )); }
LOG="$OUT/session.log"
say() { echo "$*" | tee -a "$LOG"; }
missing() {     # the names among "$@" that do not import
    local m out=()
    for m in "$@"; do python3 -c "import $m" >/dev/null 2>&1 || out+=("$m"); done
    echo "${out[*]}"
}

# env: first, before anything can fail — the machine, and each package's version or "missing"
{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "no nvidia-smi"
    python3 - <<'EOF'
import importlib, importlib.metadata, sys
print("python", sys.version.split()[0])
for name in ("torch", "deepspeed", "transformers", "datasets", "pydantic", "typing_extensions", "pyarrow", "triton"):
    try:
        module = importlib.import_module(name)
        extra = f" cuda {module.version.cuda} available {module.cuda.is_available()}" if name == "torch" else ""
        version = getattr(module, "__version__", None) or importlib.metadata.version(name.replace("_", "-"))
        print(f"{name} {version}{extra}")
    except Exception as e:
        print(f"{name} missing ({type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else '-'})")
EOF
} 2>&1 | grep -v "^\[" | sed 's/^/env: /' | tee -a "$LOG"

# the packages the GPU image lacks, from the carried wheels (installed only where one of them does not import)
if [ -n "$(missing deepspeed pydantic datasets)" ] && ls "$WHEELS"/*.whl >/dev/null 2>&1; then
    say "env: installing the carried wheels for: $(missing deepspeed pydantic datasets)"
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        "$WHEELS"/*.whl 2>&1 | tee -a "$LOG"
    export PYTHONPATH="$PYTHONPATH:/tmp/site"
    say "env: after the wheels, still missing: $(missing deepspeed pydantic datasets)"
fi

RESULT_LINES="^(tiny|big) |transformers on|profile|device busy|launches|  host|passed|failed|error|GPU |greedy"
RESULT_LINES+="|one training step"
# stage NAME CAP_S COMMAND...: run with the smaller of CAP_S and the time left, when torch, deepspeed and pydantic
# import; its output streams into session.log, its result lines to standard output too (what the device tool shows)
stage() {
    local name=$1 cap=$2; shift 2
    local t; t=$(left)
    [ "$t" -gt "$cap" ] && t=$cap
    if [ "$t" -lt 20 ]; then say "== $name: skipped, ${t}s left of BUDGET_S"; return; fi
    local lacking; lacking=$(missing torch deepspeed pydantic)
    if [ -n "$lacking" ]; then say "== $name: skipped, missing $lacking (carry .whl from benchmarks/gpu_wheels.sh)"
        return; fi
    say "== $name (at most ${t}s): $*"
    local start=$SECONDS part="$WORK/$name.log"
    timeout --kill-after=10 "$t" "$@" 2>&1 | tee -a "$LOG" > "$part"
    local rc=${PIPESTATUS[0]}
    say "== $name: exit $rc after $(( SECONDS - start ))s"
    grep -E "$RESULT_LINES" "$part" | tail -40
}

STEP=(python3 benchmarks/gpu_step.py --size "$SIZE" --steps "$STEPS" --warmup 3 --workdir "$WORK")
for s in "${STAGES[@]}"; do
    case $s in
        headline) stage headline 180 "${STEP[@]}" --precision "$PRECISION" --recompute 0 --max_tokens "$TOKENS" \
                      --hf --profile "$OUT/profile" --json "$OUT/headline.json"
                  [ -f "$OUT/profile/trace.json" ] && gzip -f "$OUT/profile/trace.json" ;;
        tier_quick) stage tier_quick 90 python3 -m pytest -q -s -p no:cacheprovider tests/test_gpu.py \
                        -k "syncs or pinned or greedy" ;;
        compile) stage compile 150 "${STEP[@]}" --precision "$PRECISION" --recompute 0 --max_tokens "$TOKENS" \
                     --compile default --json "$OUT/compile.json" ;;
        graphs) stage graphs 240 "${STEP[@]}" --precision "$PRECISION" --recompute 0 --max_tokens "$TOKENS" \
                    --compile default reduce-overhead --repeat_batches 4 --warmup 8 --json "$OUT/graphs.json" ;;
        grid) stage grid 400 "${STEP[@]}" --precision bf16 fp32 --recompute 0 1 --json "$OUT/grid.json" ;;
        tier_full) stage tier_full 400 python3 -m pytest -q -s -p no:cacheprovider tests/test_gpu.py \
                       -k "not (syncs or pinned or greedy)" ;;
        env) ;;     # already written, first
    esac
done
say "== done, $(left)s of BUDGET_S left; files in $OUT"
