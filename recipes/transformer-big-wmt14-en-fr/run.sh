#!/usr/bin/env bash
# transformer-big on WMT14 English → French (bf16, ~25k tokens per side per GPU): 1 GPU, one node of 8, or 2 nodes.
#   bash recipes/transformer-big-wmt14-en-fr/run.sh DATA_PATH [extra train.py flags...]             1 GPU
#   LAYOUT=8 bash recipes/transformer-big-wmt14-en-fr/run.sh DATA_PATH [extra...]                    8 GPUs, one node
#   LAYOUT=16 bash recipes/transformer-big-wmt14-en-fr/run.sh DATA_PATH HOSTFILE [extra...]          2 nodes × 8
# = bash run_scripts/run.sh DATA_PATH transformer-big-wmt14-en-fr[-8gpu].json, or run_cluster.sh with -16gpu.json.
# The data step, the seed's WMT14 preprocessing (test-full.tgz from statmt.org, not bundled), English<TAB>French:
#   python -m preprocess.wmt14 --input test-full.tgz --output out/wmt14        # → out/wmt14/wmt14.en_fr.txt
# That is the seed's data (newstest2014, 3,003 pairs): it exercises the pipeline, it does not train a big model.
# The paper's 36 M pairs: any aligned English and French files → python -m preprocess.parallel --src X.en --tgt
# X.fr --output out/wmt14/train.en_fr.tsv. train.py builds the shared 32k joint BPE from DATA_PATH (--tokenizer to
# bring one: python -m preprocess.tokenizer --vocab_size 32000 --sample_size 1000000).
USAGE="usage: [LAYOUT=1|8|16] bash $0 DATA_PATH [HOSTFILE] [extra flags...]
  DATA_PATH   the training TSV (english<TAB>french per line): see this script's header for the data step
  HOSTFILE    (LAYOUT=16 only) DeepSpeed hostfile of 2 nodes × 8 slots
  LAYOUT      1 (default): transformer-big-wmt14-en-fr.json; 8: -8gpu.json; 16: -16gpu.json
  extra flags go to train.py and override the recipe (e.g. --steps 100); environment as run_scripts/run.sh
  (MASTER_PORT, RUNS_DIR, DRY_RUN=1, ...), DSR_ROOT (the repository)"
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
DATA_PATH="$1"
shift
case "${LAYOUT:-1}" in
    1) exec bash "$ROOT/run_scripts/run.sh" "$DATA_PATH" "$HERE/transformer-big-wmt14-en-fr.json" "$@" ;;
    8) exec bash "$ROOT/run_scripts/run.sh" "$DATA_PATH" "$HERE/transformer-big-wmt14-en-fr-8gpu.json" "$@" ;;
    16) if [ $# -lt 1 ] || [[ "$1" == -* ]]; then
            echo "error: LAYOUT=16 needs a HOSTFILE after DATA_PATH (2 nodes × 8 slots, e.g." \
                 "run_scripts/hostfiles/hostfile_2nodes)" >&2
            exit 2
        fi
        HOSTFILE="$1"
        shift
        exec bash "$ROOT/run_scripts/run_cluster.sh" "$DATA_PATH" "$HOSTFILE" \
            "$HERE/transformer-big-wmt14-en-fr-16gpu.json" "$@" ;;
    *) echo "error: LAYOUT=${LAYOUT} is not one of 1, 8, 16 (the recipe's layouts)" >&2
       exit 2 ;;
esac
