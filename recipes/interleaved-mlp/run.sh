#!/usr/bin/env bash
# The seed's MicroBatchInterleaved example (multiple_copy/run.sh): its MLP classifier, tensor-parallel over 2
# processes, each batch of 32 run as interleave_num 2 halves, SGD lr 1e-2, 10 epochs — on scikit-learn's bundled
# handwritten digits resized to the seed's 28×28 (offline). CPU or GPU; about a minute on 2 CPU cores.
#   bash recipes/interleaved-mlp/run.sh [extra train_mlp.py flags...]      e.g. --interleave_num 1 to compare
# Environment: NPROC (default 2 = mp 2), MASTER_PORT (29500), PYTHON, DEEPSPEED (the launcher command),
# OUTPUT_DIR (default out/interleaved-mlp). Loss lines: "epoch: E step: S, loss is L" every 100 steps.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PYTHON="${PYTHON:-python}"
DEEPSPEED="${DEEPSPEED:-deepspeed}"
NPROC="${NPROC:-2}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"     # 2 ranks on 2 cores: one thread each
# shellcheck disable=SC2086  # DEEPSPEED may be a command with arguments ("python -m deepspeed.launcher.runner")
exec $DEEPSPEED --num_gpus "$NPROC" --master_port "${MASTER_PORT:-29500}" "$ROOT/run_scripts/train_mlp.py" \
    --distribute true --mp 2 --interleave_num 2 --batch_size 32 --lr 1e-2 --epochs 10 --log_interval 100 \
    --output_dir "${OUTPUT_DIR:-out/interleaved-mlp}" "$@"
