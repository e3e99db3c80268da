#!/usr/bin/env bash
# The seed's run.sh (bash run.sh DATA_PATH RANK_SIZE) on DeepSpeed's launcher: RANK_SIZE processes on this node.
#
#   bash run_scripts/run.sh DATA_PATH RANK_SIZE [RECIPE.json] [extra train.py flags...]
#
#   bash run_scripts/run.sh out/data/train.fr_en.tsv 8                       # recipes/8pcs/8pcs.json (mp 8)
#   bash run_scripts/run.sh out/data/train.fr_en.tsv 8 recipes/8pcs-dp2-mp4/8pcs-dp2-mp4.json --steps 100
#   bash run_scripts/run.sh out/data/train.fr_en.tsv 4                       # no 4pcs recipe: the seed's --mp 4
#   LAUNCHER=openmpi bash run_scripts/run.sh out/data/train.fr_en.tsv 8     # ranks started by mpirun
#
# What it runs (command.sh in the run folder has the exact line):
#   deepspeed --num_gpus RANK_SIZE --master_port $MASTER_PORT --enable_each_rank_log RUN/logs \
#       run_scripts/train.py --distribute true --file_path DATA_PATH --recipe RECIPE --output_dir RUN/output EXTRA...
# or, with --launcher openmpi / LAUNCHER=openmpi, DeepSpeed's OpenMPI launcher (mpirun -n RANK_SIZE on this node;
# the per-rank logs are then RUN/logs/1/rank.N/stdout, mpirun's --output-filename layout):
#   deepspeed --hostfile RUN/hostfile --force_multi --no_ssh_check --launcher openmpi --master_addr 127.0.0.1 \
#       --launcher_args "--output-filename RUN/logs -x MASTER_ADDR=127.0.0.1 -x MASTER_PORT=... $LAUNCHER_ARGS" ...
#
# Before any rank starts, the layout is checked with `run_scripts/plan.py --check` (a bad recipe fails in seconds
# with one `error:` line). Every run gets runs/<recipe>-<timestamp>/ with command.sh, env.log, layout.txt,
# launcher.log, logs/ (one log per rank) and output/ (metrics.jsonl, TensorBoard). Rank 0's log is shown while
# it runs (QUIET=1 hides it). The exit status is the launcher's. Environment: MASTER_PORT (default: a free one), RUNS_DIR (runs),
# RUN_NAME, PYTHON, DEEPSPEED (the launcher command), LAUNCHER_ARGS (extra mpirun arguments), DRY_RUN=1 (print the
# command only), OMP_NUM_THREADS (set it to cores / RANK_SIZE on CPU).
set -uo pipefail

USAGE="usage: bash run_scripts/run.sh DATA_PATH RANK_SIZE [RECIPE.json] [extra train.py flags...]
  DATA_PATH   the training TSV (source<TAB>target per line), e.g. from python -m preprocess.parallel
  RANK_SIZE   processes on this node (one per GPU), a positive integer
  RECIPE      default recipes/<RANK_SIZE>pcs/<RANK_SIZE>pcs.json if it exists, else the seed's --mp RANK_SIZE
  extra flags go to train.py and override the recipe (e.g. --steps 20 --d_model 64);
  --launcher openmpi (or LAUNCHER=openmpi) starts the ranks with mpirun via DeepSpeed's OpenMPI launcher
example: bash run_scripts/run.sh out/data/train.fr_en.tsv 8"

source "$(dirname "${BASH_SOURCE[0]}")/launch_common.sh"
SCRIPT_LINE="run.sh $*"

case "${1:-}" in -h|--help) echo "$USAGE"; exit 0 ;; esac
[ $# -ge 2 ] || die "missing arguments: DATA_PATH and RANK_SIZE are required"
DATA_PATH="$1"
RANK_SIZE="$2"
shift 2
[ -f "$DATA_PATH" ] || die "DATA_PATH '$DATA_PATH' is not a file (make the TSV with python -m preprocess.parallel)"
[[ "$RANK_SIZE" =~ ^[1-9][0-9]*$ ]] || die "RANK_SIZE '$RANK_SIZE' is not a positive integer"
DATA_PATH=$(abspath "$DATA_PATH")

RECIPE=""
if [ $# -gt 0 ] && [[ "$1" != -* ]]; then
    RECIPE="$1"
    shift
    [ -f "$RECIPE" ] || die "recipe '$RECIPE' is not a file (see recipes/README.md)"
elif [ -f "$REPO_ROOT/recipes/${RANK_SIZE}pcs/${RANK_SIZE}pcs.json" ]; then
    RECIPE="$REPO_ROOT/recipes/${RANK_SIZE}pcs/${RANK_SIZE}pcs.json"
fi
parse_extras "$@"

if [ -n "$RECIPE" ]; then
    RECIPE=$(abspath "$RECIPE")
    MODEL_ARGS=(--recipe "$RECIPE")
    NAME=$(basename "$RECIPE" .json)
else
    MODEL_ARGS=(--mp "$RANK_SIZE")          # the seed: python train.py --distribute=true --mp=${RANK_SIZE}
    NAME="mp$RANK_SIZE"
fi

preflight --world_size "$RANK_SIZE" "${MODEL_ARGS[@]}" "${EXTRA[@]}"
make_run_dir "$NAME"

TRAIN=("$REPO_ROOT/run_scripts/train.py" --distribute true --file_path "$DATA_PATH" "${MODEL_ARGS[@]}"
       --output_dir "$OUTPUT_DIR" "${EXTRA[@]}")
if [ "$LAUNCHER" = openmpi ]; then
    [ -n "${DRY_RUN:-}" ] || echo "localhost slots=$RANK_SIZE" > "$RUN_DIR/hostfile"
    CMD=("${DS_LAUNCHER[@]}" --hostfile "$RUN_DIR/hostfile" --force_multi --no_ssh_check --launcher openmpi
         --master_addr 127.0.0.1 --master_port "$MASTER_PORT"
         --launcher_args "--output-filename $LOG_DIR -x MASTER_ADDR=127.0.0.1 -x MASTER_PORT=$MASTER_PORT ${LAUNCHER_ARGS:-}"
         "${TRAIN[@]}")
    RANK0="$LOG_DIR/*/rank.0/stdout"          # mpirun --output-filename: DIR/1/rank.N/stdout
else
    CMD=("${DS_LAUNCHER[@]}" --num_gpus "$RANK_SIZE" --master_port "$MASTER_PORT" --enable_each_rank_log "$LOG_DIR"
         "${TRAIN[@]}")
    RANK0="$LOG_DIR/*_rank0.log"
fi
launch "$RANK0" "${CMD[@]}"
