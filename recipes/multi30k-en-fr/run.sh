#!/usr/bin/env bash
# The Multi30k English → French recipe end to end on this machine (CPU or GPU): data → joint BPE (6,000 tokens,
# punctuation split) → training with validation → the last 5 checkpoints averaged → beam 5 on val,
# test_2016_flickr and test_2017_flickr → OUT_DIR/results.md (cased detokenized sacreBLEU with its signature, chrF).
#   bash recipes/multi30k-en-fr/run.sh [OUT_DIR] [extra train.py flags...]      (default OUT_DIR: out/multi30k-en-fr)
# = VOCAB=6000 SPLIT_PUNCTUATION=1 bash run_scripts/translation_recipe.sh en fr recipes/multi30k-en-fr/multi30k-en-fr.json OUT_DIR
# A stopped run continues where it stopped when started again. NPROC=N trains on N processes (deepspeed launcher).
USAGE="usage: bash $0 [OUT_DIR] [extra train.py flags...]
  OUT_DIR     where data, tokenizer, checkpoints and results go (default out/multi30k-en-fr, relative to where you are)
  extra flags go to train.py and override multi30k-en-fr.json; environment: NPROC (processes), VOCAB, BEAM, LIMIT, SETS,
  ... (see run_scripts/translation_recipe.sh), DSR_ROOT (the repository, for a copy of this folder elsewhere)"
case "${1:-}" in -h|--help) echo "$USAGE"; exit 0 ;; esac
# The repository (so a copy of this folder runs from anywhere): $DSR_ROOT, else the checkout this folder sits in,
# else the one the installed package comes from — common/repository.py says which, or why none
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT=$(PYTHONPATH="${DSR_ROOT:-$HERE/../..}${PYTHONPATH:+:$PYTHONPATH}" "${PYTHON:-python3}" -m common.repository) || {
    # status 2: common/repository.py said why (one error: line); else python found no package to ask
    [ $? -eq 2 ] || echo "error: no repository found for $HERE: set DSR_ROOT=/path/to/the/checkout" >&2
    exit 2
}
OUT="${1:-out/multi30k-en-fr}"
[ $# -gt 0 ] && shift
export VOCAB="${VOCAB:-6000}" SPLIT_PUNCTUATION="${SPLIT_PUNCTUATION:-1}"
exec bash "$ROOT/run_scripts/translation_recipe.sh" en fr "$HERE/multi30k-en-fr.json" "$OUT" "$@"
