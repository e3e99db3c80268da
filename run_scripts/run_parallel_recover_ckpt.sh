#!/usr/bin/env bash
# The seed's run_parallel_recover_ckpt.sh: continue from CKPT on RANK_SIZE local processes — any layout that fits
# the model, not only the one it was saved with.
#   bash run_scripts/run_parallel_recover_ckpt.sh DATA_PATH RANK_SIZE CKPT OUTPUT_DIR [extra train.py flags...]
#   e.g. bash run_scripts/run_parallel_recover_ckpt.sh out/data/train.fr_en.tsv 2 out/save out/recover \
#            --pipeline_stage 2 --micro_batch_num 2 --steps 20
set -euo pipefail
usage() { echo "usage: bash $0 DATA_PATH RANK_SIZE CKPT OUTPUT_DIR [extra train.py flags...]" >&2; exit 2; }
[ $# -ge 4 ] || usage
DATA_PATH=$1; RANK_SIZE=$2; CKPT=$3; OUTPUT_DIR=$4; shift 4
[ -f "$DATA_PATH" ] || { echo "error: DATA_PATH $DATA_PATH is not a file" >&2; usage; }
[[ "$RANK_SIZE" =~ ^[1-9][0-9]*$ ]] || { echo "error: RANK_SIZE must be a positive integer, got '$RANK_SIZE'" >&2; usage; }
[ -e "$CKPT" ] || { echo "error: checkpoint $CKPT not found" >&2; usage; }
HERE=$(cd "$(dirname "$0")" && pwd)
exec deepspeed --num_gpus "$RANK_SIZE" --master_port "${MASTER_PORT:-29500}" "$HERE/parallel_recover_train.py" \
    --distribute true --file_path "$DATA_PATH" --ckpt_file "$CKPT" --output_dir "$OUTPUT_DIR" "$@"
