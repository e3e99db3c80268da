#!/usr/bin/env bash
# Run a command while other 2-rank training jobs train beside it on this machine, as on a shared node:
#
#   bash tests/load/jobs_beside.sh bash .ci/run            # the suite, with two jobs beside it
#   JOBS=4 ROUNDS=2 bash tests/load/jobs_beside.sh bash .ci/run   # four jobs, twice in a row; stops at a failure
#
# The jobs (JOBS, default 2): recipes/cpu-tiny (tp 2, 2 ranks each) on the bundled Multi30k data through
# run_scripts/run.sh and the `deepspeed` launcher, the first on DeepSpeed's default master port 29500 and the
# others on 29501, 29502, ..., each restarted (with
# --resume) whenever it ends, at normal priority, so they take their share of the cores for the whole command.
# Everything they write goes to a temporary folder, removed with the jobs when the command ends (or is
# interrupted). Exit status: the command's (of the first failed round).
set -uo pipefail
[ $# -ge 1 ] || { echo "usage: bash tests/load/jobs_beside.sh COMMAND [ARGS...]" >&2; exit 2; }
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
PYTHON="${PYTHON:-python}"
WORK="$(mktemp -d /tmp/jobs-beside.XXXXXX)"
PIDS=()

stop_jobs() {
    for pid in "${PIDS[@]}"; do
        kill -TERM -- "-$pid" 2>/dev/null
    done
    sleep 5
    for pid in "${PIDS[@]}"; do
        kill -KILL -- "-$pid" 2>/dev/null
    done
    pkill -KILL -f "$WORK" 2>/dev/null
    rm -rf "$WORK"
}
COMMAND=
trap stop_jobs EXIT
trap '[ -n "$COMMAND" ] && kill -TERM -- "-$COMMAND" 2>/dev/null; wait "$COMMAND"; exit 130' INT TERM

"$PYTHON" -c "import sys; sys.path.insert(0, '$ROOT'); from preprocess.parallel import make_tsv; \
make_tsv('$ROOT/data/multi30k/train.fr.gz', '$ROOT/data/multi30k/train.en.gz', '$WORK/train.fr_en.tsv')" || exit 1

JOBS=${JOBS:-2}
PORTS=()
for ((j = 0; j < JOBS; j++)); do PORTS+=($((29500 + j))); done
for port in "${PORTS[@]}"; do
    # each job in a process group of its own (setsid), so stop_jobs ends the launcher and its ranks together
    setsid bash -c "
        cd '$ROOT'
        while true; do
            RUNS_DIR='$WORK/runs' RUN_NAME=beside-$port MASTER_PORT=$port QUIET=1 \
                bash recipes/cpu-tiny/run.sh '$WORK/train.fr_en.tsv' --steps 100000000 --save_checkpoint_steps 500 \
                --resume auto >> '$WORK/job-$port.log' 2>&1
            sleep 2
        done" &
    PIDS+=($!)
done
echo "jobs beside: $JOBS 2-rank runs of recipes/cpu-tiny on ports ${PORTS[*]} (logs in $WORK)" >&2

rounds="${ROUNDS:-1}"
for ((round = 1; round <= rounds; round++)); do
    start=$(date +%s)
    setsid "$@" &           # its own process group, in the background: a signal to this script stops it at once
    COMMAND=$!
    wait "$COMMAND"
    status=$?
    COMMAND=
    echo "jobs beside: round $round of $rounds: exit $status in $(( $(date +%s) - start )) s" >&2
    [ "$status" -eq 0 ] || exit "$status"
done
