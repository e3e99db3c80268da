#!/usr/bin/env bash
# The seed's run_cluster.sh on DeepSpeed's multi-node launcher: one process per slot of a DeepSpeed hostfile.
#
#   bash run_scripts/run_cluster.sh DATA_PATH HOSTFILE [RECIPE.json] [extra train.py flags...]
#
#   bash run_scripts/run_cluster.sh /shared/wmt14.fr_en.tsv run_scripts/hostfiles/hostfile_2nodes   # 16pcs recipe
#   python run_scripts/rank_table_to_hostfile.py rank_table_16pcs.json -o hostfile                  # from the seed
#   bash run_scripts/run_cluster.sh /shared/wmt14.fr_en.tsv hostfile --launcher openmpi             # via mpirun
#
# HOSTFILE has one `HOST slots=N` line per node (run_scripts/hostfiles/); ranks are numbered node after node in its
# order (a byte-order mark, CRLF, tabs and comments are fine: the launchers get a clean copy, LOGS/hostfile). The
# hostfile's slots are the world size: they win over the recipe's world_size (a note says so when they differ).
# RECIPE defaults to recipes/16pcs/16pcs.json. The run folder RUN is runs/<recipe>[-$RUN_NAME]/ as with run.sh:
# RUN/output, and LOGS = RUN/logs/<time> for each launch. What it runs (LOGS/command.sh has the exact line):
#   pdsh (DeepSpeed's default): python -m training.run.launcher --hostfile LOGS/hostfile --master_addr \
#       $MASTER_ADDR --master_port $MASTER_PORT run_scripts/train.py --launch_payload TOKEN
#     needs passwordless ssh from this node to every host, and pdsh. training.run.launcher is DeepSpeed's runner
#     (`deepspeed`), except that stopping it ends this job's launchers on each node and no other job's (DeepSpeed's
#     pkill pattern matches every DeepSpeed launch on the nodes); DEEPSPEED=deepspeed runs DeepSpeed's own.
#   openmpi (--launcher openmpi or LAUNCHER=openmpi): deepspeed --hostfile LOGS/hostfile --force_multi --launcher
#       openmpi --launcher_args "-x MASTER_ADDR=... -x MASTER_PORT=... $LAUNCHER_ARGS" run_scripts/train.py ...
#     mpirun starts every rank (it must work across the hosts: ssh, same OpenMPI everywhere). DeepSpeed adds
#     `--mca btl_tcp_if_include eth0` unless LAUNCHER_ARGS sets btl_tcp_if_include; add --allow-run-as-root there
#     if you launch as root.
# TOKEN carries train.py's arguments (--distribute true --file_path DATA_PATH --recipe RECIPE --world_size SLOTS
# --output_dir ... and yours), this folder, OMP_NUM_THREADS and the log folder, encoded (common/launch_payload.py):
# the pdsh runner hands each node's command to that node's shell, which would otherwise re-read any `$(...)`,
# backtick or quote in a path.
# command.sh shows the arguments decoded. Every rank writes its log to LOGS/HOST_rankR.log.
# With a single host in HOSTFILE the launcher runs locally (no ssh check). MASTER_ADDR defaults to the first host;
# the repository (at a plain path: letters, digits, _ . / - + @ % = : ,), DATA_PATH and RUNS_DIR must be at the same
# paths on every node (a shared file system): before the first step every rank checks it sees the output folder
# rank 0 sees. The layout is checked with plan.py --check against the hostfile before anything starts. Environment
# as run.sh: MASTER_ADDR, MASTER_PORT (default a free port), RUNS_DIR (runs), RUN_NAME, PYTHON, DEEPSPEED,
# LAUNCHER_ARGS, EXPORT_VARS (more variables every rank gets), DRY_RUN=1, QUIET=1.
set -uo pipefail

USAGE="usage: bash run_scripts/run_cluster.sh DATA_PATH HOSTFILE [RECIPE.json] [extra train.py flags...]
  DATA_PATH   the training TSV, at the same path on every node (or a table file or datasets save_to_disk folder:
              docs/data.md, Input formats)
  HOSTFILE    DeepSpeed hostfile, one 'HOST slots=N' line per node (see run_scripts/hostfiles/, or convert the
              seed's rank table: python run_scripts/rank_table_to_hostfile.py rank_table_16pcs.json -o hostfile)
  RECIPE      default recipes/16pcs/16pcs.json
  extra flags go to train.py and override the recipe;
  --launcher openmpi (or LAUNCHER=openmpi) starts the ranks with mpirun instead of pdsh
example: bash run_scripts/run_cluster.sh /shared/data/train.fr_en.tsv run_scripts/hostfiles/hostfile_2nodes"

source "$(dirname "${BASH_SOURCE[0]}")/launch_common.sh"
if [ -z "${DEEPSPEED:-}" ]; then
    DS_LAUNCHER=("$PYTHON" -m training.run.launcher)       # DeepSpeed's runner, stopping only this job (above)
fi
# Every stop signal reaches the launcher as SIGTERM: on other nodes the ranks hear only what DeepSpeed's runner
# passes on through pdsh (its kill command runs on SIGTERM and SIGINT; a SIGHUP would kill the runner without it)
PASS_ON=""

require_plain_path() {  # PATH WHAT: refuse a path the remote shell would re-read (it is sent unquoted)
    [[ "$1" =~ ^[A-Za-z0-9_./@%+=:,-]+$ ]] || die "$2 ($1) holds characters a remote shell would re-read (spaces, quotes, \$, backticks...): DeepSpeed sends it unquoted to every node, so clone or move it to a plain path (letters, digits, _ . / - + @ % = : ,)"
}

launch_payload() {  # LOG_DIR ARG...: train.py's arguments, this folder, the log folder, OMP_NUM_THREADS and
    # DSR_LAUNCH_ID (plus the variables named in EXPORT_VARS) as one shell-safe token (common/launch_payload.py)
    local log_dir="$1" var
    shift
    local env_args=()
    for var in OMP_NUM_THREADS DSR_LAUNCH_ID ${EXPORT_VARS:-}; do
        [ -n "${!var+x}" ] && env_args+=(--env "$var=${!var}")
    done
    PYTHONPATH="$REPO_ROOT${PYTHONPATH:+:$PYTHONPATH}" "$PYTHON" -m common.launch_payload encode --cwd "$PWD" \
        --log_dir "$log_dir" "${env_args[@]}" -- "$@"
}
SCRIPT_LINE="run_cluster.sh $*"

case "${1:-}" in -h|--help) echo "$USAGE"; exit 0 ;; esac
[ $# -ge 2 ] || die "missing arguments: DATA_PATH and HOSTFILE are required"
DATA_PATH="$1"
HOSTFILE="$2"
shift 2
check_data_path                              # a TSV, a table file or a save_to_disk folder, as train.py reads them
[ -f "$HOSTFILE" ] || die "HOSTFILE '$HOSTFILE' not found (one 'HOST slots=N' line per node, see run_scripts/hostfiles/)"
HOSTFILE=$(abspath "$HOSTFILE")

RECIPE="$REPO_ROOT/recipes/16pcs/16pcs.json"
if [ $# -gt 0 ] && [[ "$1" != -* ]]; then
    RECIPE="$1"
    shift
    [ -f "$RECIPE" ] || die "recipe '$RECIPE' is not a file (see recipes/README.md)"
fi
RECIPE=$(abspath "$RECIPE")
parse_extras "$@"

# plan.py reads the hostfile (world size = its slots) and rejects one DeepSpeed would reject; it writes the copy the
# launchers read (a byte-order mark, CRLF, tabs and comments dropped)
CLEAN_HOSTFILE=$(mktemp)
preflight --hostfile "$HOSTFILE" --write_hostfile "$CLEAN_HOSTFILE" --recipe "$RECIPE" "${EXTRA[@]}"
HOSTS=($(awk '{print $1}' "$CLEAN_HOSTFILE"))
# the world is the hostfile's slots (the copy holds "HOST slots=N" lines only); they win over the recipe's world_size
SLOTS=$(awk '{sub("slots=", "", $2); n += $2} END {print n}' "$CLEAN_HOSTFILE")
world_size_note "$SLOTS" "the hostfile's $SLOTS slots override" "$RECIPE"
MASTER_ADDR="${MASTER_ADDR:-${HOSTS[0]}}"
make_run_dir "$(basename "$RECIPE" .json)"
LAUNCH_HOSTFILE="$HOSTFILE"
if [ -z "${DRY_RUN:-}" ]; then
    LAUNCH_HOSTFILE="$LOG_DIR/hostfile"
    mv "$CLEAN_HOSTFILE" "$LAUNCH_HOSTFILE"
else
    rm -f "$CLEAN_HOSTFILE"
fi

# Across nodes the launchers hand the rank's command to each node's shell, which would re-read any `$(...)`,
# backtick or quote in a path: train.py's arguments, this folder and the log folder travel as one token instead
# (common/launch_payload.py), and the launcher runs from the repository, whose path must be plain.
require_plain_path "$REPO_ROOT" "the repository's path"
TRAIN_ARGS=(--distribute true --file_path "$DATA_PATH" --recipe "$RECIPE" --world_size "$SLOTS"
            --output_dir "$OUTPUT_DIR" "${EXTRA[@]}")
PAYLOAD=$(launch_payload "$LOG_DIR" "${TRAIN_ARGS[@]}") || die "could not encode the launch payload"
TRAIN=("$REPO_ROOT/run_scripts/train.py" --launch_payload "$PAYLOAD")
TRAIN_LINE="train.py $(printf '%q ' "${TRAIN_ARGS[@]}")(cwd $(printf '%q' "$PWD"); logs $(printf '%q' "$LOG_DIR"))"
COMMON=(--hostfile "$LAUNCH_HOSTFILE" --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT")
if [ "${#HOSTS[@]}" -eq 1 ]; then
    COMMON+=(--no_ssh_check)                 # one host: DeepSpeed launches locally
fi
if [ "$LAUNCHER" = openmpi ]; then
    CMD=("${DS_LAUNCHER[@]}" "${COMMON[@]}" --force_multi --launcher openmpi
         --launcher_args "-x MASTER_ADDR=$MASTER_ADDR -x MASTER_PORT=$MASTER_PORT ${LAUNCHER_ARGS:-}"
         "${TRAIN[@]}")
else
    CMD=("${DS_LAUNCHER[@]}" "${COMMON[@]}" "${TRAIN[@]}")
    if [ -n "${LAUNCHER_ARGS:-}" ]; then
        CMD=("${DS_LAUNCHER[@]}" "${COMMON[@]}" --launcher_args "$LAUNCHER_ARGS" "${TRAIN[@]}")
    fi
fi
RANK0="$LOG_DIR/*_rank0.log"                 # every rank writes LOG_DIR/HOST_rankR.log (the payload says where)
cd "$REPO_ROOT" || die "cannot enter $REPO_ROOT"
launch "$RANK0" "${CMD[@]}"
