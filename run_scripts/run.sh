#!/usr/bin/env bash
# The seed's run.sh (bash run.sh DATA_PATH RANK_SIZE) on DeepSpeed's launcher: RANK_SIZE processes on this node.
#
#   bash run_scripts/run.sh DATA_PATH RANK_SIZE [RECIPE.json] [extra train.py flags...]
#   bash run_scripts/run.sh DATA_PATH RECIPE.json [extra train.py flags...]      # as many as the recipe says
#
#   bash run_scripts/run.sh out/data/train.fr_en.tsv 8                       # recipes/8pcs/8pcs.json (mp 8)
#   bash run_scripts/run.sh out/data/train.fr_en.tsv recipes/8pcs-dp2-mp4/8pcs-dp2-mp4.json --steps 100
#   bash run_scripts/run.sh out/data/train.fr_en.tsv 4                       # no 4pcs recipe: the seed's --mp 4
#   LAUNCHER=openmpi bash run_scripts/run.sh out/data/train.fr_en.tsv 8     # ranks started by mpirun
#
# The number of processes: RANK_SIZE when given (it wins over the recipe's world_size, as a flag wins over a recipe
# key: a note says so); else the recipe's "world_size" (or --world_size among the flags) — what every recipe's
# run.sh uses. What it runs (command.sh in the launch's log folder has the exact line):
#   deepspeed --num_gpus N --master_port $MASTER_PORT --enable_each_rank_log RUN/logs/<time> \
#       run_scripts/train.py --distribute true --file_path DATA_PATH --recipe RECIPE --world_size N \
#       --output_dir RUN/output EXTRA...
# or, with --launcher openmpi / LAUNCHER=openmpi, DeepSpeed's OpenMPI launcher (mpirun -n N on this node; the
# per-rank logs are then RUN/logs/<time>/1/rank.N/stdout, mpirun's --output-filename layout):
#   deepspeed --hostfile RUN/logs/<time>/hostfile --force_multi --no_ssh_check --launcher openmpi \
#       --master_addr 127.0.0.1 --launcher_args "--output-filename ... -x MASTER_ADDR=127.0.0.1 ..." ...
#
# Before any rank starts, the layout is checked with `run_scripts/plan.py --check` (a bad recipe fails in seconds
# with one `error:` line). The run folder is runs/<recipe>[-$RUN_NAME]/, the same for every launch: output/
# (metrics.jsonl, TensorBoard, checkpoints) and logs/<time>/ per launch (command.sh, env.log, layout.txt,
# launcher.log, one log per rank). A stopped run continues with the same command plus --resume; the same command
# without it is refused once the folder holds checkpoints (set RUN_NAME for a second run). Rank 0's log is shown
# while it runs (QUIET=1 hides it). The exit status is the launcher's. Environment: MASTER_PORT (default: a free
# one), RUNS_DIR (runs), RUN_NAME, PYTHON, DEEPSPEED (the launcher command), LAUNCHER_ARGS (extra mpirun
# arguments), DRY_RUN=1 (print the command only), OMP_NUM_THREADS (set it to cores / RANK_SIZE on CPU).
set -uo pipefail

USAGE="usage: bash run_scripts/run.sh DATA_PATH RANK_SIZE [RECIPE.json] [extra train.py flags...]
       bash run_scripts/run.sh DATA_PATH RECIPE.json [extra train.py flags...]
  DATA_PATH   the training TSV (source<TAB>target per line), e.g. from python -m preprocess.parallel; or a
              .jsonl/.json/.csv/.parquet file or a datasets save_to_disk folder (with --src_field/--tgt_field or
              --src_lang/--tgt_lang: docs/data.md, Input formats)
  RANK_SIZE   processes on this node (one per GPU), a positive integer; without it, the recipe's world_size
  RECIPE      default recipes/<RANK_SIZE>pcs/<RANK_SIZE>pcs.json if it exists, else the seed's --mp RANK_SIZE
  extra flags go to train.py and override the recipe (e.g. --steps 20 --d_model 64; --resume continues the run in
  runs/<recipe>[-\$RUN_NAME]); --launcher openmpi (or LAUNCHER=openmpi) starts the ranks with mpirun via
  DeepSpeed's OpenMPI launcher
example: bash run_scripts/run.sh out/data/train.fr_en.tsv 8"

source "$(dirname "${BASH_SOURCE[0]}")/launch_common.sh"
SCRIPT_LINE="run.sh $*"

case "${1:-}" in -h|--help) echo "$USAGE"; exit 0 ;; esac
[ $# -ge 2 ] || die "missing arguments: DATA_PATH and RANK_SIZE (or RECIPE.json) are required"
DATA_PATH="$1"
shift
check_data_path                              # a TSV, a table file or a save_to_disk folder, as train.py reads them

RANK_SIZE=""
RECIPE=""
if [[ "$1" == *.json ]]; then                 # run.sh DATA RECIPE.json: the recipe says how many
    RECIPE="$1"
    shift
else
    RANK_SIZE="$1"
    shift
    [[ "$RANK_SIZE" =~ ^[1-9][0-9]*$ ]] || die "RANK_SIZE '$RANK_SIZE' is not a positive integer"
    if [ $# -gt 0 ] && [[ "$1" != -* ]]; then
        RECIPE="$1"
        shift
    elif [ -f "$REPO_ROOT/recipes/${RANK_SIZE}pcs/${RANK_SIZE}pcs.json" ]; then
        RECIPE="$REPO_ROOT/recipes/${RANK_SIZE}pcs/${RANK_SIZE}pcs.json"
    fi
fi
[ -z "$RECIPE" ] || [ -f "$RECIPE" ] || die "recipe '$RECIPE' is not a file (see recipes/README.md)"
parse_extras "$@"

if [ -n "$RECIPE" ]; then
    RECIPE=$(abspath "$RECIPE")
    MODEL_ARGS=(--recipe "$RECIPE")
    NAME=$(basename "$RECIPE" .json)
else
    MODEL_ARGS=(--mp "$RANK_SIZE")          # the seed: python train.py --distribute=true --mp=${RANK_SIZE}
    NAME="mp$RANK_SIZE"
fi
if [ -z "$RANK_SIZE" ]; then
    RANK_SIZE=$(recipe_world_size "$RECIPE" "${EXTRA[@]}") || exit 2
    [ -n "$RANK_SIZE" ] || refuse "recipe $RECIPE does not say how many processes it is written for: add" \
        "\"world_size\": N to its \"parallel\" section, or give the count: bash run_scripts/run.sh DATA N $RECIPE"
elif [ -n "$FLAG_WORLD_SIZE" ] && [ "$FLAG_WORLD_SIZE" != "$RANK_SIZE" ]; then
    refuse "RANK_SIZE $RANK_SIZE and --world_size $FLAG_WORLD_SIZE disagree: give the number of processes once"
else
    world_size_note "$RANK_SIZE" "RANK_SIZE $RANK_SIZE overrides" "$RECIPE"
fi

preflight --world_size "$RANK_SIZE" "${MODEL_ARGS[@]}" "${EXTRA[@]}"
make_run_dir "$NAME"

TRAIN=("$REPO_ROOT/run_scripts/train.py" --distribute true --file_path "$DATA_PATH" "${MODEL_ARGS[@]}"
       --world_size "$RANK_SIZE" --output_dir "$OUTPUT_DIR" "${EXTRA[@]}")
if [ "$LAUNCHER" = openmpi ]; then
    [ -n "${DRY_RUN:-}" ] || echo "localhost slots=$RANK_SIZE" > "$LOG_DIR/hostfile"
    CMD=("${DS_LAUNCHER[@]}" --hostfile "$LOG_DIR/hostfile" --force_multi --no_ssh_check --launcher openmpi
         --master_addr 127.0.0.1 --master_port "$MASTER_PORT"
         --launcher_args "--output-filename $LOG_DIR -x MASTER_ADDR=127.0.0.1 -x MASTER_PORT=$MASTER_PORT -x DSR_LAUNCH_ID ${LAUNCHER_ARGS:-}"
         "${TRAIN[@]}")
    RANK0="$LOG_DIR/*/rank.0/stdout"          # mpirun --output-filename: DIR/1/rank.N/stdout
else
    CMD=("${DS_LAUNCHER[@]}" --num_gpus "$RANK_SIZE" --master_port "$MASTER_PORT" --enable_each_rank_log "$LOG_DIR"
         "${TRAIN[@]}")
    RANK0="$LOG_DIR/*_rank0.log"
fi
launch "$RANK0" "${CMD[@]}"
