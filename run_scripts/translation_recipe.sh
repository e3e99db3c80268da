#!/usr/bin/env bash
# A whole translation recipe on the bundled Multi30k: data → tokenizer → training (with validation) → checkpoint
# averaging → beam search on val and both test sets → a results table.
#
#   bash run_scripts/translation_recipe.sh SRC TGT RECIPE.json OUT_DIR [extra train.py flags...]
#   bash run_scripts/translation_recipe.sh en fr recipes/multi30k-en-fr/multi30k-en-fr.json out/multi30k-en-fr
#
# Steps (data and tokenizer are made once; training resumes a stopped run and is a no-op once complete):
#   OUT/data/{train,val}.tsv          data/multi30k/{train,val}.SRC.gz + .TGT.gz (python -m preprocess.parallel)
#   OUT/data/bpe/tokenizer.json       joint BPE over train, VOCAB tokens (SPLIT_PUNCTUATION=1: --split_punctuation)
#   OUT/train/                        run_scripts/train.py --recipe RECIPE (valid_loss every epoch, checkpoints)
#   OUT/avg.pt                        the mean of the last AVERAGE checkpoints (run_scripts/average_checkpoints.py)
#   OUT/results.md, OUT/<set>.json    BEAM-wide beam search (length penalty LENPEN), cased sacreBLEU + chrF on
#                                     val, test_2016_flickr and test_2017_flickr, with the decode time
# Environment: VOCAB (8000), SPLIT_PUNCTUATION (1), AVERAGE (5), BEAM (5), LENPEN (1.0), NPROC (processes; default 1,
# more go through the deepspeed launcher, on MASTER_PORT or else a free port), OMP_NUM_THREADS (default: all cores
# for one process), PYTHON (python),
# LIMIT (score only the first LIMIT sentences of each set: a quick check of the pipeline, not a result),
# SETS (the sets to decode and score, default "val test_2016_flickr test_2017_flickr"; SETS=val while tuning).
# On a GPU machine the same command trains and decodes on the GPU (DeepSpeed's accelerator).
set -euo pipefail
USAGE="usage: bash run_scripts/translation_recipe.sh SRC TGT RECIPE.json OUT_DIR [extra train.py flags...]"
case "${1:-}" in -h|--help) echo "$USAGE"; exit 0 ;; esac
if [ $# -lt 4 ]; then echo "error: $USAGE" >&2; exit 2; fi
SRC=$1 TGT=$2 RECIPE=$3 OUT=$4; shift 4
# the user's paths are relative to where they are; the bundled data's to the repository, where we go next
case "$RECIPE" in /*) ;; *) RECIPE="$PWD/$RECIPE" ;; esac
case "$OUT" in /*) ;; *) OUT="$PWD/$OUT" ;; esac
cd "$(dirname "$0")/.."
# this checkout's code for every script below, as launch_common.sh gives the ranks (common/script_entry.py)
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-python}
for lang in "$SRC" "$TGT"; do
    [ -f "data/multi30k/train.$lang.gz" ] || { echo "error: no data/multi30k/train.$lang.gz (languages: en, fr)" >&2; exit 2; }
done
[ -f "$RECIPE" ] || { echo "error: recipe $RECIPE not found" >&2; exit 2; }
VOCAB=${VOCAB:-8000} SPLIT_PUNCTUATION=${SPLIT_PUNCTUATION:-1} AVERAGE=${AVERAGE:-5} BEAM=${BEAM:-5}
LENPEN=${LENPEN:-1.0} NPROC=${NPROC:-1}
EVAL_SETS="val test_2016_flickr test_2017_flickr"
SETS=${SETS:-$EVAL_SETS}
for set in $SETS; do
    [ -f "data/multi30k/$set.$SRC.gz" ] || {
        echo "error: SETS names $set, but there is no data/multi30k/$set.$SRC.gz (sets: $EVAL_SETS)" >&2; exit 2; }
done
limit=(); [ -n "${LIMIT:-}" ] && limit=(--limit "$LIMIT")
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( $(nproc) / NPROC > 0 ? $(nproc) / NPROC : 1 ))}
DATA=$OUT/data
mkdir -p "$DATA"

for split in train val; do
    [ -f "$DATA/$split.tsv" ] || $PY -m preprocess.parallel --src "data/multi30k/$split.$SRC.gz" \
        --tgt "data/multi30k/$split.$TGT.gz" --output "$DATA/$split.tsv"
done
if [ ! -f "$DATA/bpe/tokenizer.json" ]; then
    punct=(); [ "$SPLIT_PUNCTUATION" = 1 ] && punct=(--split_punctuation)
    $PY -m preprocess.tokenizer --input "$DATA/train.tsv" --output "$DATA/bpe" --vocab_size "$VOCAB" "${punct[@]}"
fi

# --resume auto: a fresh run, or the continuation of a stopped one ("nothing to train" once it is complete)
if [ "$NPROC" = 1 ]; then
    launch=($PY)
else
    source run_scripts/launch_common.sh              # the master port: a free one unless MASTER_PORT is given
    check_master_port
    launch=("${DS_LAUNCHER[@]}" --num_gpus "$NPROC" --master_port "$MASTER_PORT")
fi
start=$(date +%s)
"${launch[@]}" run_scripts/train.py --recipe "$RECIPE" --file_path "$DATA/train.tsv" \
    --tokenizer "$DATA/bpe/tokenizer.json" --valid_file "$DATA/val.tsv" --output_dir "$OUT/train" --resume auto "$@"
echo "training wall-clock this time: $(( $(date +%s) - start )) s" | tee -a "$OUT/train_time.txt"

$PY run_scripts/average_checkpoints.py "$OUT/train" --last "$AVERAGE" --output "$OUT/avg.pt"
for set in $SETS; do
    $PY run_scripts/evaluate.py --ckpt_file "$OUT/avg.pt" --tokenizer "$DATA/bpe/tokenizer.json" \
        --src "data/multi30k/$set.$SRC.gz" --ref "data/multi30k/$set.$TGT.gz" --beam "$BEAM" --lenpen "$LENPEN" \
        --output "$OUT/$set.hyp.$TGT" --no_progress "${limit[@]}" | tail -1 > "$OUT/$set.json"
done
$PY - "$OUT" "$SRC" "$TGT" "$BEAM" "$AVERAGE" $SETS <<'EOF'
import json, sys
out, src, tgt, beam, average, *sets = sys.argv[1:]
rows = []
for name in sets:
    r = json.load(open(f"{out}/{name}.json"))
    rows.append(f"| {name} | {r['bleu']:.2f} | {r['chrf']:.2f} | {r['sentences']} | {r['decode_seconds']:.1f} s |")
    sig = r["bleu_signature"]
table = "\n".join([f"Multi30k {src}→{tgt}: the mean of the last {average} checkpoints, beam {beam}, cased detokenized "
                   f"sacreBLEU ({sig}) and chrF", "",
                   "| set | BLEU | chrF | sentences | decode time |", "|---|---|---|---|---|", *rows])
open(f"{out}/results.md", "w").write(table + "\n")
print(table)
EOF
