#!/usr/bin/env bash
# The seed's MicroBatchInterleaved example (multiple_copy/run.sh): its MLP classifier, tensor-parallel over 2
# processes, each batch of 32 run as interleave_num 2 halves, SGD lr 1e-2, 10 epochs — on scikit-learn's bundled
# handwritten digits resized to the seed's 28×28 (offline). CPU or GPU; about a minute on 2 CPU cores.
#   bash recipes/interleaved-mlp/run.sh [extra train_mlp.py flags...]      e.g. --interleave_num 1 to compare
# Environment: NPROC (default 2 = mp 2), MASTER_PORT (default: a free one), PYTHON, DEEPSPEED (the launcher command),
# OUTPUT_DIR (default out/interleaved-mlp). Loss lines: "epoch: E step: S, loss is L" every 100 steps.
set -uo pipefail
USAGE="usage: bash $0 [extra train_mlp.py flags...]
  flags: --interleave_num 1 (to compare), --epochs, --lr, ... (python run_scripts/train_mlp.py --help)
  environment: NPROC (2), MASTER_PORT (default: a free one), PYTHON, DEEPSPEED, OUTPUT_DIR, DSR_ROOT (the repository)"
case "${1:-}" in -h|--help) echo "$USAGE"; exit 0 ;; esac
# The repository (so a copy of this folder runs from anywhere): $DSR_ROOT, else the checkout this folder sits in,
# else the one the installed package comes from — common/repository.py says which, or why none
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT=$(PYTHONPATH="${DSR_ROOT:-$HERE/../..}${PYTHONPATH:+:$PYTHONPATH}" "${PYTHON:-python3}" -m common.repository) || {
    # status 2: common/repository.py said why (one error: line); else python found no package to ask
    [ $? -eq 2 ] || echo "error: no repository found for $HERE: set DSR_ROOT=/path/to/the/checkout" >&2
    exit 2
}
source "$ROOT/run_scripts/launch_common.sh"           # the master port: a free one unless MASTER_PORT is given
check_master_port
NPROC="${NPROC:-2}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"     # 2 ranks on 2 cores: one thread each
exec "${DS_LAUNCHER[@]}" --num_gpus "$NPROC" --master_port "$MASTER_PORT" "$ROOT/run_scripts/train_mlp.py" \
    --distribute true --mp 2 --interleave_num 2 --batch_size 32 --lr 1e-2 --epochs 10 --log_interval 100 \
    --output_dir "${OUTPUT_DIR:-out/interleaved-mlp}" "$@"
