#!/usr/bin/env bash
# Launch the 2pcs recipe on this node: 2 processes, one per GPU.
#   bash recipes/2pcs/run.sh DATA_PATH [extra train.py flags...]     e.g. --steps 100, --launcher openmpi
# = bash run_scripts/run.sh DATA_PATH 2 recipes/2pcs/2pcs.json [extra...]; see recipes/README.md.
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
if [ $# -lt 1 ] || [[ "$1" == -* ]]; then
    echo "usage: bash recipes/2pcs/run.sh DATA_PATH [extra train.py flags...]" >&2
    exit 2
fi
DATA_PATH="$1"
shift
exec bash "$HERE/../../run_scripts/run.sh" "$DATA_PATH" 2 "$HERE/2pcs.json" "$@"
