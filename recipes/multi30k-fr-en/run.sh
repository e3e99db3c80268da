#!/usr/bin/env bash
# The Multi30k French → English recipe end to end on this machine (CPU or GPU): data → joint BPE (6,000 tokens,
# punctuation split) → training with validation → the last 5 checkpoints averaged → beam 5 on val,
# test_2016_flickr and test_2017_flickr → OUT_DIR/results.md (cased detokenized sacreBLEU with its signature, chrF).
#   bash recipes/multi30k-fr-en/run.sh [OUT_DIR] [extra train.py flags...]      (default OUT_DIR: out/multi30k-fr-en)
# = VOCAB=6000 SPLIT_PUNCTUATION=1 bash run_scripts/translation_recipe.sh fr en recipes/multi30k-fr-en/multi30k-fr-en.json OUT_DIR
# A stopped run continues where it stopped when started again. NPROC=N trains on N processes (deepspeed launcher).
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
OUT="${1:-out/multi30k-fr-en}"
[ $# -gt 0 ] && shift
export VOCAB="${VOCAB:-6000}" SPLIT_PUNCTUATION="${SPLIT_PUNCTUATION:-1}"
exec bash "$HERE/../../run_scripts/translation_recipe.sh" fr en "$HERE/multi30k-fr-en.json" "$OUT" "$@"
