#!/usr/bin/env bash
# Launch the 8pcs recipe on this node: 8 processes, one per GPU.
#   bash recipes/8pcs/run.sh DATA_PATH [extra train.py flags...]     e.g. --steps 100, --launcher openmpi
# = bash run_scripts/run.sh DATA_PATH 8 recipes/8pcs/8pcs.json [extra...]; see recipes/README.md.
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
if [ $# -lt 1 ] || [[ "$1" == -* ]]; then
    echo "usage: bash recipes/8pcs/run.sh DATA_PATH [extra train.py flags...]" >&2
    exit 2
fi
DATA_PATH="$1"
shift
exec bash "$HERE/../../run_scripts/run.sh" "$DATA_PATH" 8 "$HERE/8pcs.json" "$@"
