#!/usr/bin/env bash
# Launch the 16pcs recipe on a cluster: 2 nodes × 8 GPUs described by a DeepSpeed hostfile.
#   bash recipes/16pcs/run.sh DATA_PATH HOSTFILE [extra train.py flags...]     e.g. --launcher openmpi
# = bash run_scripts/run_cluster.sh DATA_PATH HOSTFILE recipes/16pcs/16pcs.json [extra...]
# HOSTFILE: run_scripts/hostfiles/hostfile_2nodes (edit the hosts), or from the seed's rank table:
#   python run_scripts/rank_table_to_hostfile.py run_scripts/rank_tables/rank_table_16pcs.json -o hostfile
USAGE="usage: bash $0 DATA_PATH HOSTFILE [extra train.py flags...]
  DATA_PATH   the training TSV, at the same path on every node
  HOSTFILE    DeepSpeed hostfile, one 'HOST slots=N' line per node (run_scripts/hostfiles/hostfile_2nodes)
  extra flags go to train.py and override 16pcs.json; --launcher openmpi starts the ranks with mpirun;
  environment as run_scripts/run_cluster.sh (MASTER_ADDR, MASTER_PORT, RUNS_DIR, DRY_RUN=1, ...), DSR_ROOT"
case "${1:-}" in -h|--help) echo "$USAGE"; exit 0 ;; esac
# The repository (so a copy of this folder runs from anywhere): $DSR_ROOT, else the checkout this folder sits in,
# else the one the installed package comes from — common/repository.py says which, or why none
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT=$(PYTHONPATH="${DSR_ROOT:-$HERE/../..}${PYTHONPATH:+:$PYTHONPATH}" "${PYTHON:-python3}" -m common.repository) || {
    # status 2: common/repository.py said why (one error: line); else python found no package to ask
    [ $? -eq 2 ] || echo "error: no repository found for $HERE: set DSR_ROOT=/path/to/the/checkout" >&2
    exit 2
}
if [ $# -lt 2 ] || [[ "$1" == -* ]] || [[ "$2" == -* ]]; then
    echo "$USAGE" >&2
    exit 2
fi
DATA_PATH="$1"
HOSTFILE="$2"
shift 2
exec bash "$ROOT/run_scripts/run_cluster.sh" "$DATA_PATH" "$HOSTFILE" "$HERE/16pcs.json" "$@"
