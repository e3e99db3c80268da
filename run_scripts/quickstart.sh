#!/usr/bin/env bash
# The main job on a CPU, with the bundled data: Multi30k fr→en → TSV → BPE tokenizer → 2-process tensor-parallel
# training (the seed's 2-card run: mp 2) through DeepSpeed's launcher, checkpointing as it goes.
#   bash run_scripts/quickstart.sh [OUTPUT_DIR] [extra train.py flags...]     (default OUTPUT_DIR: out/quickstart)
# Afterwards: OUTPUT_DIR/metrics.jsonl (one line per step), OUTPUT_DIR/tensorboard, OUTPUT_DIR/checkpoints.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-out/quickstart}; shift || true
DATA=out/data
if [ ! -f "$DATA/train.fr_en.tsv" ]; then
  python -m preprocess.parallel --src data/multi30k/train.fr.gz --tgt data/multi30k/train.en.gz \
      --output "$DATA/train.fr_en.tsv"
fi
if [ ! -f "$DATA/bpe8k/tokenizer.json" ]; then
  python -m preprocess.tokenizer --input "$DATA/train.fr_en.tsv" --output "$DATA/bpe8k" --vocab_size 8000
fi
# micro 32 × accum 1 × dp 1 = global 32 sentence pairs per step; mp 2 splits heads, FFN and vocab over 2 processes
exec env OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} deepspeed --num_gpus 2 --master_port "${MASTER_PORT:-29500}" \
    run_scripts/train.py --distribute true \
    --file_path "$DATA/train.fr_en.tsv" --tokenizer "$DATA/bpe8k/tokenizer.json" \
    --mp 2 --d_model 128 --num_heads 8 --encoder_layer 2 --decoder_layer 2 --src_len 24 --tgt_len 24 \
    --batch_size 32 --lr 5e-4 --warmup_steps 50 --dropout 0.1 --steps 300 --log_interval 25 \
    --save_checkpoint_steps 100 --keep_checkpoint_max 2 --output_dir "$OUT" "$@"
