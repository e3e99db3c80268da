#!/usr/bin/env bash
# Launch the 8pcs recipe on this node: 8 processes, one per GPU.
#   bash recipes/8pcs/run.sh DATA_PATH [extra train.py flags...]     e.g. --steps 100, --launcher openmpi
# = bash run_scripts/run.sh DATA_PATH recipes/8pcs/8pcs.json [extra...] (its world_size: 8); the run lives in
# runs/8pcs[-$RUN_NAME]/, and the same command plus --resume continues it; see recipes/README.md.
USAGE="usage: bash $0 DATA_PATH [extra train.py flags...]
  DATA_PATH   the training TSV (source<TAB>target per line), e.g. from python -m preprocess.parallel
  extra flags go to train.py and override 8pcs.json (e.g. --steps 100); --launcher openmpi starts the ranks
  with mpirun; environment as run_scripts/run.sh (MASTER_PORT, RUNS_DIR, DRY_RUN=1, ...), DSR_ROOT (the repository)"
case "${1:-}" in -h|--help) echo "$USAGE"; exit 0 ;; esac
# The repository (so a copy of this folder runs from anywhere): $DSR_ROOT, else the checkout this folder sits in,
# else the one the installed package comes from — common/repository.py says which, or why none
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT=$(PYTHONPATH="${DSR_ROOT:-$HERE/../..}${PYTHONPATH:+:$PYTHONPATH}" "${PYTHON:-python3}" -m common.repository) || {
    # status 2: common/repository.py said why (one error: line); else python found no package to ask
    [ $? -eq 2 ] || echo "error: no repository found for $HERE: set DSR_ROOT=/path/to/the/checkout" >&2
    exit 2
}
if [ $# -lt 1 ] || [[ "$1" == -* ]]; then
    echo "$USAGE" >&2
    exit 2
fi
DATA_PATH="$1"
shift
exec bash "$ROOT/run_scripts/run.sh" "$DATA_PATH" "$HERE/8pcs.json" "$@"
