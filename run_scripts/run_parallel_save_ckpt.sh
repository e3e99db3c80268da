#!/usr/bin/env bash
# The seed's run_parallel_save_ckpt.sh: train on RANK_SIZE local processes, saving a checkpoint every step.
#   bash run_scripts/run_parallel_save_ckpt.sh DATA_PATH RANK_SIZE OUTPUT_DIR [extra train.py flags...]
#   e.g. bash run_scripts/run_parallel_save_ckpt.sh out/data/train.fr_en.tsv 2 out/save --mp 2 --steps 10
set -euo pipefail
USAGE="usage: bash run_scripts/run_parallel_save_ckpt.sh DATA_PATH RANK_SIZE OUTPUT_DIR [extra train.py flags...]
  RANK_SIZE processes on this node through DeepSpeed's launcher; extra flags go to the training script
  environment: MASTER_PORT (default: a free one)"
usage() { echo "$USAGE" >&2; exit 2; }
case "${1:-}" in -h|--help) echo "$USAGE"; exit 0 ;; esac
[ $# -ge 3 ] || usage
DATA_PATH=$1; RANK_SIZE=$2; OUTPUT_DIR=$3; shift 3
[[ "$RANK_SIZE" =~ ^[1-9][0-9]*$ ]] || { echo "error: RANK_SIZE must be a positive integer, got '$RANK_SIZE'" >&2; usage; }
HERE=$(cd "$(dirname "$0")" && pwd)
source "$HERE/launch_common.sh"      # the master port: a free one unless MASTER_PORT is given
check_data_path                      # a TSV, a table file or a save_to_disk folder, as train.py reads them
check_master_port
exec "${DS_LAUNCHER[@]}" --num_gpus "$RANK_SIZE" --master_port "$MASTER_PORT" "$HERE/parallel_save_ckpt_train.py" \
    --distribute true --file_path "$DATA_PATH" --output_dir "$OUTPUT_DIR" "$@"
