#!/usr/bin/env bash
# The main job on a CPU, with the bundled data: Multi30k fr→en → TSV → BPE tokenizer → 2-process tensor-parallel
# training (the seed's 2-card run: mp 2) through DeepSpeed's launcher, checkpointing as it goes.
#   bash run_scripts/quickstart.sh [OUTPUT_DIR] [extra train.py flags...]     (default OUTPUT_DIR: out/quickstart)
# Afterwards: OUTPUT_DIR/metrics.jsonl (one line per step), OUTPUT_DIR/tensorboard, OUTPUT_DIR/checkpoints.
set -euo pipefail
USAGE="usage: bash run_scripts/quickstart.sh [OUTPUT_DIR] [extra train.py flags...]
  Multi30k fr→en → out/data/train.fr_en.tsv → out/data/bpe8k (made once) → 300 steps of mp 2 on 2 processes
  OUTPUT_DIR  default out/quickstart (relative to where you are): metrics.jsonl, tensorboard/, checkpoints/
  extra flags go to train.py (e.g. --steps 50); environment: MASTER_PORT (default: a free one), OMP_NUM_THREADS (1)"
case "${1:-}" in -h|--help) echo "$USAGE"; exit 0 ;; -*) echo "error: OUTPUT_DIR comes first (got '$1')" >&2
    echo "$USAGE" >&2; exit 2 ;; esac
OUT=${1:-out/quickstart}; shift || true
case "$OUT" in /*) ;; *) OUT="$PWD/$OUT" ;; esac      # where the user is, not the repository we cd to
cd "$(dirname "$0")/.."
source run_scripts/launch_common.sh                   # the master port: a free one unless MASTER_PORT is given
check_master_port
DATA=out/data
if [ ! -f "$DATA/train.fr_en.tsv" ]; then
  python -m preprocess.parallel --src data/multi30k/train.fr.gz --tgt data/multi30k/train.en.gz \
      --output "$DATA/train.fr_en.tsv"
fi
if [ ! -f "$DATA/bpe8k/tokenizer.json" ]; then
  python -m preprocess.tokenizer --input "$DATA/train.fr_en.tsv" --output "$DATA/bpe8k" --vocab_size 8000
fi
# micro 32 × accum 1 × dp 1 = global 32 sentence pairs per step; mp 2 splits heads, FFN and vocab over 2 processes
exec env OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} "${DS_LAUNCHER[@]}" --num_gpus 2 --master_port "$MASTER_PORT" \
    run_scripts/train.py --distribute true \
    --file_path "$DATA/train.fr_en.tsv" --tokenizer "$DATA/bpe8k/tokenizer.json" \
    --mp 2 --d_model 128 --num_heads 8 --encoder_layer 2 --decoder_layer 2 --src_len 24 --tgt_len 24 \
    --batch_size 32 --lr 5e-4 --warmup_steps 50 --dropout 0.1 --steps 300 --log_interval 25 \
    --save_checkpoint_steps 100 --keep_checkpoint_max 2 --output_dir "$OUT" "$@"
