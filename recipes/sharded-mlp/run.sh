#!/usr/bin/env bash
# The seed's quickstart (003): Net(32, 16, 16) = MatMul → ReLU → MatMul, a strategy on the first MatMul only
# (((2, 4), (4, 1)) on a (2, 4) device mesh), the rest propagated, MSE + Momentum(0.2, 0.1), 5 epochs of 4 steps,
# on 8 CPU processes of this machine (gloo; the network is tiny, DTensor runs it on CPU).
#
#   bash recipes/sharded-mlp/run.sh [--launcher openmpi] [extra run_scripts/sharded_mlp.py flags...]
#
#   bash recipes/sharded-mlp/run.sh                                   # DeepSpeed's launcher, 8 ranks
#   bash recipes/sharded-mlp/run.sh --launcher openmpi                # mpirun -n 8 (the seed's run_with_mpi.sh)
#   bash recipes/sharded-mlp/run.sh --mesh 2,2 --strategy "((2, 2), (2, 1))"     # 4 ranks
#
# Every rank prints the seed's loss line (epoch: 3 step: 2, loss is ...); the run folder runs/sharded-mlp[-$RUN_NAME]/
# gets logs/<time>/ for each launch (command.sh, env.log, one log per rank) and output/, which each launch rewrites:
# metrics.jsonl and rank_R/step_parallel_begin.txt (every op's strategy) and rank_R/execute.txt (the local shapes
# and collectives that ran on rank R). The strategies are checked in one process before any rank starts.
# Environment as run_scripts/run.sh (MASTER_PORT, RUNS_DIR, RUN_NAME, PYTHON, DEEPSPEED, LAUNCHER_ARGS, DRY_RUN=1,
# QUIET=1); as root, mpirun gets --allow-run-as-root.
set -uo pipefail

USAGE="usage: bash $0 [--launcher openmpi] [extra sharded_mlp.py flags...]
  flags: --mesh 2,4 --strategy \"((2, 4), (4, 1))\" --epochs 5 --steps_per_epoch 4 --batch_size 2 --lr 0.2
         --momentum 0.1 (python run_scripts/sharded_mlp.py --help)"

case "${1:-}" in -h|--help) echo "$USAGE"; exit 0 ;; esac
# The repository (so a copy of this folder runs from anywhere): $DSR_ROOT, else the checkout this folder sits in,
# else the one the installed package comes from — common/repository.py says which, or why none
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT=$(PYTHONPATH="${DSR_ROOT:-$HERE/../..}${PYTHONPATH:+:$PYTHONPATH}" "${PYTHON:-python3}" -m common.repository) || {
    # status 2: common/repository.py said why (one error: line); else python found no package to ask
    [ $? -eq 2 ] || echo "error: no repository found for $HERE: set DSR_ROOT=/path/to/the/checkout" >&2
    exit 2
}
source "$ROOT/run_scripts/launch_common.sh"
SCRIPT_LINE="recipes/sharded-mlp/run.sh $*"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
parse_extras "$@"

# ranks = the product of --mesh (default 2,4)
MESH="2,4"
for ((i = 0; i < ${#EXTRA[@]}; i++)); do
    case "${EXTRA[$i]}" in
        --mesh) MESH="${EXTRA[$((i + 1))]:-}" ;;
        --mesh=*) MESH="${EXTRA[$i]#--mesh=}" ;;
    esac
done
RANK_SIZE=1
IFS=', ' read -r -a DIMS <<< "${MESH//x/,}"
for d in "${DIMS[@]}"; do
    [[ "$d" =~ ^[1-9][0-9]*$ ]] || die "--mesh '$MESH': give positive integers, e.g. 2,4"
    RANK_SIZE=$((RANK_SIZE * d))
done

SCRIPT="$REPO_ROOT/run_scripts/sharded_mlp.py"
errfile=$(mktemp)
LAYOUT=$("$PYTHON" "$SCRIPT" --check "${EXTRA[@]}" 2> "$errfile") || { cat "$errfile" >&2; rm -f "$errfile"; exit 2; }
rm -f "$errfile"
make_run_dir sharded-mlp

RUN=("$SCRIPT" --output_dir "$OUTPUT_DIR" "${EXTRA[@]}")
if [ "$LAUNCHER" = openmpi ]; then
    ROOT_ARG=""
    [ "$(id -u)" = 0 ] && ROOT_ARG="--allow-run-as-root"
    [ -n "${DRY_RUN:-}" ] || echo "localhost slots=$RANK_SIZE" > "$LOG_DIR/hostfile"
    # one node: gloo talks over loopback (DeepSpeed's default for OpenMPI is btl_tcp_if_include eth0)
    CMD=("${DS_LAUNCHER[@]}" --hostfile "$LOG_DIR/hostfile" --force_multi --no_ssh_check --launcher openmpi
         --master_addr 127.0.0.1 --master_port "$MASTER_PORT"
         --launcher_args "--output-filename $LOG_DIR --mca btl_tcp_if_include lo $ROOT_ARG -x MASTER_ADDR=127.0.0.1 -x MASTER_PORT=$MASTER_PORT -x OMP_NUM_THREADS ${LAUNCHER_ARGS:-}"
         "${RUN[@]}")
    RANK0="$LOG_DIR/*/rank.0/stdout"
else
    CMD=("${DS_LAUNCHER[@]}" --num_gpus "$RANK_SIZE" --master_port "$MASTER_PORT" --enable_each_rank_log "$LOG_DIR"
         "${RUN[@]}")
    RANK0="$LOG_DIR/*_rank0.log"
fi
launch "$RANK0" "${CMD[@]}"
