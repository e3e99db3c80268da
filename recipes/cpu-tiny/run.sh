#!/usr/bin/env bash
# The tiny CPU smoke run: 2 processes on this machine, no GPU needed, under a minute on 2 cores.
#   bash recipes/cpu-tiny/run.sh DATA_PATH [extra train.py flags...]
# = OMP_NUM_THREADS=1 bash run_scripts/run.sh DATA_PATH 2 recipes/cpu-tiny/cpu-tiny.json [extra...]
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
if [ $# -lt 1 ] || [[ "$1" == -* ]]; then
    echo "usage: bash recipes/cpu-tiny/run.sh DATA_PATH [extra train.py flags...]" >&2
    echo "make DATA_PATH with: python -m preprocess.parallel --src data/multi30k/train.fr.gz --tgt data/multi30k/train.en.gz --output out/data/train.fr_en.tsv" >&2
    exit 2
fi
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"     # 2 ranks on 2 cores: one thread each
DATA_PATH="$1"
shift
exec bash "$HERE/../../run_scripts/run.sh" "$DATA_PATH" 2 "$HERE/cpu-tiny.json" "$@"
