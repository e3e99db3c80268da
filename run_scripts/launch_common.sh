# Shared by run_scripts/run.sh and run_scripts/run_cluster.sh (sourced, not run).
#
# A launch script sets USAGE, then calls, in order:
#   check_data_path          → DATA_PATH as train.py takes it (absolute; a Hub dataset's name as it is), or train.py's
#                              own error line for it: a TSV, a .jsonl/.json/.csv/.parquet file, a save_to_disk folder
#   parse_extras "$@"        → EXTRA (flags for train.py), LAUNCHER (deepspeed|pdsh|openmpi), USER_OUTPUT_DIR,
#                              RESUME (train.py's --resume value: latest, auto, a path; empty without it),
#                              FLAG_WORLD_SIZE (a --world_size among the flags)
#   recipe_world_size RECIPE [FLAGS...] → prints the processes the recipe is written for (its parallel.world_size,
#                              or --world_size among FLAGS), nothing when neither says
#   preflight PLAN_ARGS...   → checks the layout with plan.py --check before any rank starts; exit 2 on error
#   make_run_dir NAME        → RUN_DIR = $RUNS_DIR/NAME[-$RUN_NAME] (absolute; the same for every launch, so that
#                              --resume finds the run), OUTPUT_DIR = RUN_DIR/output, LOG_DIR = RUN_DIR/logs/<time>
#                              (this launch's command.sh, env.log, layout.txt, launcher.log and rank logs); a
#                              launch without --resume into a RUN_DIR that holds checkpoints stops here (one line)
#   launch RANK0_LOG_GLOB CMD...  → records command.sh / env.log, runs CMD (its console output also in
#                              launcher.log), shows rank 0's log while it runs, reports where everything is,
#                              exits with the launcher's status. CMD runs in a process group of its own: SIGTERM,
#                              SIGINT, SIGHUP or SIGUSR1 to this script stop the launcher and every rank, each
#                              rank saving its step (DeepSpeed's runner does not pass signals on to a local launch,
#                              so its ranks would go on alone)
#
# Environment: PYTHON (python3), DEEPSPEED (deepspeed, else "$PYTHON -m deepspeed.launcher.runner"),
# MASTER_PORT (default: a port free on this machine, chosen when sourced; a given one that is busy here stops
# make_run_dir with one line), RUNS_DIR (./runs), RUN_NAME (a second run of the same recipe beside the first:
# letters, digits, . _ -), LAUNCHER, LAUNCHER_ARGS, DRY_RUN=1, QUIET=1. Sets and exports DSR_LAUNCH_ID (below).
#
# Scripts that launch DeepSpeed themselves (quickstart.sh, the seed's run_parallel_*.sh, recipes' run.sh) source this
# file for the master port only: choose_master_port has run, and they call check_master_port before launching.

if [ "${BASH_SOURCE[0]}" = "$0" ]; then             # run, not sourced: say what it is
    echo "usage: source run_scripts/launch_common.sh   (from a launch script: run.sh and run_cluster.sh use it; it"
    echo "  starts nothing itself — see the comments at its top for the functions it defines)"
    case "${1:-}" in -h|--help) exit 0 ;; *) exit 2 ;; esac
fi

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# The ranks run this checkout's code, the code every check here runs (_repo_python): a script started by its path has
# only its own folder on sys.path, so without this the installed package would run, and where that is another
# clone's, train.py stops in one line (common/script_entry.py). DeepSpeed's runners pass PYTHON* on to other nodes.
export PYTHONPATH="$REPO_ROOT${PYTHONPATH:+:$PYTHONPATH}"

die() {
    echo "error: $*" >&2
    echo "$USAGE" >&2
    exit 2
}

abspath() {  # an existing file or folder, or a path to create, as an absolute path
    case "$1" in
        /*) printf '%s\n' "$1" ;;
        *) printf '%s\n' "$PWD/$1" ;;
    esac
}

if [ -z "${PYTHON:-}" ]; then
    PYTHON=$(command -v python3 || command -v python || echo python3)
fi
if [ -n "${DEEPSPEED:-}" ]; then
    read -r -a DS_LAUNCHER <<< "$DEEPSPEED"
elif command -v deepspeed > /dev/null 2>&1; then
    DS_LAUNCHER=(deepspeed)
else
    DS_LAUNCHER=("$PYTHON" -m deepspeed.launcher.runner)
fi

# ----------------------------------------------------------------------------------------- the master port
# A fixed default (29500) made a second job on the same machine fail at the rendezvous, long after launch: now a
# port nobody listens on is chosen when MASTER_PORT is not given, and a given one is checked before anything starts.

free_port() {  # a TCP port nobody listens on now, as the kernel hands them out
    "$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("", 0)); print(s.getsockname()[1])'
}

port_in_use() {  # PORT: true when a socket on this machine listens on it (torch's rendezvous store could not bind)
    ! "$PYTHON" - "$1" <<'PY'
import socket, sys
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)      # as the store binds: TIME_WAIT leftovers are no obstacle
try:
    s.bind(("", int(sys.argv[1])))
except OSError:
    sys.exit(1)
PY
}

is_this_machine() {  # ADDRESS: true when it names this machine (the launching node is then the master)
    local addr="$1" mine
    case "$addr" in 127.*|localhost|::1|"") return 0 ;; esac
    mine=" $(hostname 2>/dev/null) $(hostname -s 2>/dev/null) $(hostname -f 2>/dev/null) $(hostname -I 2>/dev/null) "
    [[ "$mine" == *" $addr "* ]]
}

choose_master_port() {  # sets MASTER_PORT (a free one unless given) and MASTER_PORT_GIVEN
    if [ -n "${MASTER_PORT:-}" ]; then
        MASTER_PORT_GIVEN=1
    else
        MASTER_PORT_GIVEN=""
        # no fallback to DeepSpeed's 29500: another job on this machine may hold it, and that fails only at the rendezvous
        MASTER_PORT=$(free_port) || {
            echo "error: could not pick a free master port ($PYTHON could not bind a TCP socket); set MASTER_PORT to" \
                 "a port free on this machine" >&2
            exit 2
        }
    fi
}

check_master_port() {  # [MASTER ADDRESS]: a given MASTER_PORT that is not a port, or is busy on this machine: one line
    if ! [[ "$MASTER_PORT" =~ ^[0-9]+$ ]] || [ "$MASTER_PORT" -lt 1 ] || [ "$MASTER_PORT" -gt 65535 ]; then
        echo "error: MASTER_PORT '$MASTER_PORT' is not a port number (1-65535); leave it unset to get a free one" >&2
        exit 2
    fi
    if [ -n "$MASTER_PORT_GIVEN" ] && is_this_machine "${1:-127.0.0.1}" && port_in_use "$MASTER_PORT"; then
        echo "error: MASTER_PORT $MASTER_PORT is in use on this machine (another job's rendezvous?); leave" \
             "MASTER_PORT unset to get a free port, or choose another" >&2
        exit 2
    fi
}

choose_master_port

# One id for every rank of this launch, known before the rendezvous (common/ranks.py launch_id_from_env): a rank that
# fails before it has joined its job may then still tell its own job's store from another's, and report there
# (docs/failures.md#jobs-sharing-a-node). Inherited on this node; run_cluster.sh puts it in the launch payload.
DSR_LAUNCH_ID="$(hostname 2>/dev/null || echo host)-$$-$(date +%s%N)"
export DSR_LAUNCH_ID

parse_extras() {
    EXTRA=()
    USER_OUTPUT_DIR=""
    RESUME=""
    FLAG_WORLD_SIZE=""
    LAUNCHER="${LAUNCHER:-}"
    while [ $# -gt 0 ]; do
        case "$1" in
            --launcher) [ $# -ge 2 ] || die "--launcher needs a value: openmpi (or pdsh / deepspeed, the default)"
                        LAUNCHER="$2"; shift 2; continue ;;
            --launcher=*) LAUNCHER="${1#--launcher=}"; shift; continue ;;
            --output_dir) USER_OUTPUT_DIR="${2:-}" ;;
            --output_dir=*) USER_OUTPUT_DIR="${1#--output_dir=}" ;;
            # as train.py's argparse reads it: a value unless the next word is a flag (or there is none)
            --resume) if [ $# -ge 2 ] && [[ "$2" != -* ]]; then RESUME="$2"; else RESUME=latest; fi ;;
            --resume=*) RESUME="${1#--resume=}" ;;
            --world_size) FLAG_WORLD_SIZE="${2:-}" ;;
            --world_size=*) FLAG_WORLD_SIZE="${1#--world_size=}" ;;
        esac
        EXTRA+=("$1")
        shift
    done
    case "${LAUNCHER:-deepspeed}" in
        deepspeed|pdsh) LAUNCHER=deepspeed ;;
        openmpi|OpenMPI|mpirun) LAUNCHER=openmpi ;;
        *) die "unknown launcher '$LAUNCHER': use openmpi, or leave it out for DeepSpeed's own (pdsh across nodes)" ;;
    esac
}

_repo_python() {  # MODULE ARGS...: a module of this repository, whatever the current folder
    PYTHONPATH="$REPO_ROOT${PYTHONPATH:+:$PYTHONPATH}" "$PYTHON" -m "$@"
}

check_data_path() {  # DATA_PATH as train.py's --file_path takes it, decided by the code train.py reads it with (a
    # datasets save_to_disk folder was refused here as "not a file"); exit 2 with its error line and the usage
    local checked
    checked=$(_repo_python training.run.launch_check data_path "$DATA_PATH" 2>&1) || die "${checked#error: }"
    DATA_PATH="$checked"
}

recipe_world_size() {  # RECIPE [FLAGS...]: the processes the layout is written for, as train.py reads the recipe
    # and the flags (one place for every launcher, so a copied recipe edited to 2 ranks launches 2); fails with the
    # recipe's own error line when it cannot be read: RANK_SIZE=$(recipe_world_size ...) || exit 2
    _repo_python training.run.launch_check world_size --recipe "$@"
}

world_size_note() {  # COUNT WHO RECIPE: say when an explicit count (RANK_SIZE, a hostfile's slots) overrides the
    # recipe's world_size; the count wins, as a flag wins over a recipe key, and the layout line shows what runs
    local count="$1" who="$2" recipe="$3" own
    [ -n "$recipe" ] || return 0
    own=$(recipe_world_size "$recipe" 2> /dev/null) || return 0   # (preflight reports what is wrong with it)
    if [ -n "$own" ] && [ "$own" != "$count" ]; then
        echo "note: $who the world_size $own of $recipe: $count processes" >&2
    fi
}

preflight() {  # plan.py --check with the same recipe and flags train.py will get: one clear error, before launching
    local errfile rc
    errfile=$(mktemp)
    LAYOUT=$("$PYTHON" "$REPO_ROOT/run_scripts/plan.py" --check "$@" 2> "$errfile")
    rc=$?
    if [ $rc -ne 0 ]; then
        cat "$errfile" >&2
        rm -f "$errfile"
        exit 2
    fi
    rm -f "$errfile"
}

refuse() {  # a launch that must not start: one line, no usage (the command was well formed)
    echo "error: $*" >&2
    exit 2
}

make_run_dir() {  # NAME: the run folder of NAME (and RUN_NAME), this launch's log folder, and whether it may start
    local name="$1" base stamp
    check_master_port "${MASTER_ADDR:-127.0.0.1}"
    if [ -n "${RUN_NAME:-}" ]; then
        [[ "$RUN_NAME" =~ ^[A-Za-z0-9._][A-Za-z0-9._-]*$ ]] || refuse "RUN_NAME '$RUN_NAME' must be a plain name" \
            "(letters, digits, . _ -): it becomes part of the run folder's name, $name-RUN_NAME"
        name="$name-$RUN_NAME"
    fi
    base=$(abspath "${RUNS_DIR:-runs}")
    RUN_DIR="$base/$name"
    OUTPUT_DIR="$RUN_DIR/output"
    stamp=$(date +%Y%m%d-%H%M%S)
    LOG_DIR="$RUN_DIR/logs/$stamp"
    local n=2
    while [ -e "$LOG_DIR" ]; do LOG_DIR="$RUN_DIR/logs/$stamp-$n"; n=$((n + 1)); done
    if [ -z "${USER_OUTPUT_DIR:-}" ]; then    # (a given --output_dir: train.py's own rules, naming it)
        # earlier launches made RUNS_DIR/NAME-<time>: --resume must not miss a run left there
        _repo_python training.run.launch_check run_folder "$RUN_DIR" ${RESUME:+--resume "$RESUME"} \
            --earlier "$base/${RUN_NAME:-$1}" || exit 2
    fi
    if [ -z "${DRY_RUN:-}" ]; then
        mkdir -p "$LOG_DIR" || die "cannot create the run folder $RUN_DIR (set RUNS_DIR to a writable folder)"
    fi
}

_follow() {  # print rank 0's log while it grows (started in the background)
    local glob="$1" f
    for _ in $(seq 1 2400); do
        f=$(compgen -G "$glob" | head -n 1)
        if [ -n "$f" ]; then exec tail -n +1 -f "$f"; fi
        sleep 0.25
    done
}

PASS_ON="HUP USR1"   # stop signals sent on unchanged (run_cluster.sh: none, its other nodes hear only TERM)

_stop_job() {  # a signal to this script stops the whole job: the launcher, every rank and their children
    local sig="$1"
    [ -n "${JOB_PGID:-}" ] || exit $((128 + $(kill -l "$sig")))
    if [ -z "${JOB_STOPPING:-}" ]; then
        echo "$(basename "$0"): got SIG$sig: stopping the launcher and every rank (process group $JOB_PGID)" >&2
    fi
    JOB_STOPPING="$sig"
    # The signals in PASS_ON go on as they came, so that the ranks' line names the signal the job was sent (every
    # rank is in the group and saves on them; DeepSpeed's runner and launch.py die of them at once, and the ranks'
    # save outlives them). The rest become TERM: the launcher and the ranks end quietly on it (an INT makes Python
    # print tracebacks), and it is the one DeepSpeed's runner passes on to other nodes.
    case " $PASS_ON " in *" $sig "*) ;; *) sig=TERM ;; esac
    kill -s "$sig" -- "-$JOB_PGID" 2>/dev/null
}

_run_job() {  # CMD...: run the launcher in a process group of its own (its console output also in launcher.log)
    JOB_STOPPING=""
    set -m                        # job control: the background job below gets its own process group
    # (stdin from /dev/null: a background group reading the terminal would be stopped; mpirun forwards stdin)
    "$@" < /dev/null > >(tee "$LOG_DIR/launcher.log") 2>&1 &
    local pid=$!
    set +m
    JOB_PGID=$pid
    trap '_stop_job TERM' TERM
    trap '_stop_job INT' INT
    trap '_stop_job HUP' HUP
    trap '_stop_job USR1' USR1
    while true; do
        wait "$pid"
        JOB_RC=$?
        kill -0 "$pid" 2>/dev/null || break         # a trapped signal interrupted the wait: wait again
    done
    if [ -n "$JOB_STOPPING" ]; then
        # the launcher is gone; give the ranks it was stopping the time DeepSpeed's launcher gives them (30 s)
        local n
        for n in $(seq 1 40); do
            kill -0 -- "-$JOB_PGID" 2>/dev/null || break
            sleep 1
        done
        kill -s KILL -- "-$JOB_PGID" 2>/dev/null
        JOB_RC=$((128 + $(kill -l "$JOB_STOPPING")))
    fi
    trap - TERM INT HUP USR1
    JOB_PGID=""
}

launch() {
    local rank0_glob="$1"
    shift
    local cmd=("$@")
    local final_out="${USER_OUTPUT_DIR:-$OUTPUT_DIR}"
    if [ -n "${DRY_RUN:-}" ]; then
        echo "run folder would be: $RUN_DIR"
        echo "$LAYOUT"
        printf '%q ' "${cmd[@]}"
        echo
        [ -z "${TRAIN_LINE:-}" ] || echo "$TRAIN_LINE"
        exit 0
    fi
    {
        echo "#!/usr/bin/env bash"
        echo "# $(date -Iseconds) on $(hostname): $SCRIPT_LINE"
        echo "cd $(printf '%q' "$PWD")"
        local var
        for var in $(compgen -e | grep -E '^(OMP_NUM_THREADS|CUDA_VISIBLE_DEVICES|NCCL_[A-Z_]+|MASTER_ADDR)$'); do
            echo "export $var=$(printf '%q' "${!var}")"
        done
        [ -z "${TRAIN_LINE:-}" ] || echo "# each rank runs (sent as --launch_payload): $TRAIN_LINE"
        printf '%q ' "${cmd[@]}"
        echo
    } > "$LOG_DIR/command.sh"
    env | sort > "$LOG_DIR/env.log"
    echo "$LAYOUT" > "$LOG_DIR/layout.txt"
    echo "$LAYOUT"
    echo "run folder:    $RUN_DIR  (the same for every launch of this recipe and RUN_NAME: add --resume to continue)"
    echo "this launch:   $LOG_DIR  (command.sh, env.log, launcher.log, layout.txt)"
    echo "per-rank logs: $LOG_DIR"
    echo "output:        $final_out  (metrics.jsonl, tensorboard/)"

    FOLLOW_PID=""
    if [ -z "${QUIET:-}" ]; then
        _follow "$rank0_glob" &
        FOLLOW_PID=$!
        trap '[ -n "$FOLLOW_PID" ] && kill "$FOLLOW_PID" 2>/dev/null' EXIT
        echo "---- rank 0 ($rank0_glob) ----"
    fi
    _run_job "${cmd[@]}"
    local rc=$JOB_RC
    if [ -n "$FOLLOW_PID" ]; then
        sleep 1
        kill "$FOLLOW_PID" 2>/dev/null
        wait "$FOLLOW_PID" 2>/dev/null
        FOLLOW_PID=""
        echo "----"
    fi
    if [ -n "$JOB_STOPPING" ]; then
        grep -rh "^stopped by " "$LOG_DIR" 2>/dev/null | sort -u >&2      # what the ranks saved
        echo "training stopped by SIG$JOB_STOPPING; no rank is left running. Run folder: $RUN_DIR" >&2
        exit "$rc"
    fi
    if [ $rc -eq 0 ]; then
        echo "training finished. metrics: $final_out/metrics.jsonl; per-rank logs: $LOG_DIR; run folder: $RUN_DIR"
        exit 0
    fi
    local stops
    stops=$(grep -rh "^stopped by " "$LOG_DIR" 2>/dev/null | sort -u)
    if [ -n "$stops" ]; then                # a stop request (SIGTERM, SIGUSR1, the launcher's end) was honoured
        echo "$stops" >&2
        echo "training stopped (launcher exit status $rc). Run folder: $RUN_DIR" >&2
        exit "$rc"
    fi
    echo "training failed (launcher exit status $rc). Run folder: $RUN_DIR" >&2
    local errors
    errors=$(grep -rh "^error: " "$LOG_DIR" 2>/dev/null | sort -u)
    if [ -n "$errors" ]; then
        echo "$errors" >&2
    else
        local f
        f=$(compgen -G "$rank0_glob" | head -n 1)
        if [ -n "$f" ]; then
            echo "last lines of $f:" >&2
            tail -n 20 "$f" >&2
        fi
    fi
    echo "per-rank logs: $LOG_DIR" >&2
    exit "$rc"
}
