#!/usr/bin/env bash
# The tiny CPU smoke run: 2 processes on this machine, no GPU needed, under a minute on 2 cores.
#   bash recipes/cpu-tiny/run.sh DATA_PATH [extra train.py flags...]
# = OMP_NUM_THREADS=1 bash run_scripts/run.sh DATA_PATH recipes/cpu-tiny/cpu-tiny.json [extra...]: the run lives
# in runs/cpu-tiny[-$RUN_NAME]/; add --resume to the same command to continue it
USAGE="usage: bash $0 DATA_PATH [extra train.py flags...]
  DATA_PATH   the training TSV; make it with: python -m preprocess.parallel --src data/multi30k/train.fr.gz \\
              --tgt data/multi30k/train.en.gz --output out/data/train.fr_en.tsv
  extra flags go to train.py and override cpu-tiny.json (e.g. --steps 20); environment as run_scripts/run.sh
  (MASTER_PORT, RUNS_DIR, DRY_RUN=1, ...), DSR_ROOT (the repository, for a copy of this folder elsewhere)"
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
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"     # 2 ranks on 2 cores: one thread each
DATA_PATH="$1"
shift
exec bash "$ROOT/run_scripts/run.sh" "$DATA_PATH" "$HERE/cpu-tiny.json" "$@"
