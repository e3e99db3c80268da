#!/usr/bin/env bash
# Launch the 16pcs recipe on a cluster: 2 nodes × 8 GPUs described by a DeepSpeed hostfile.
#   bash recipes/16pcs/run.sh DATA_PATH HOSTFILE [extra train.py flags...]     e.g. --launcher openmpi
# = bash run_scripts/run_cluster.sh DATA_PATH HOSTFILE recipes/16pcs/16pcs.json [extra...]
# HOSTFILE: run_scripts/hostfiles/hostfile_2nodes (edit the hosts), or from the seed's rank table:
#   python run_scripts/rank_table_to_hostfile.py run_scripts/rank_tables/rank_table_16pcs.json -o hostfile
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
if [ $# -lt 2 ] || [[ "$1" == -* ]] || [[ "$2" == -* ]]; then
    echo "usage: bash recipes/16pcs/run.sh DATA_PATH HOSTFILE [extra train.py flags...]" >&2
    exit 2
fi
DATA_PATH="$1"
HOSTFILE="$2"
shift 2
exec bash "$HERE/../../run_scripts/run_cluster.sh" "$DATA_PATH" "$HOSTFILE" "$HERE/16pcs.json" "$@"
