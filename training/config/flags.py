"""train.py's flags (the seed's names kept) and recipe files, parsed into a Namespace and then into typed sections
(training.config.sections.TrainConfig).

Precedence: built-in defaults < recipe JSON (`--recipe`) < command-line flags. A recipe is JSON with sections
{"model", "parallel", "training", "deepspeed"}; keys starting with "_" are comments (recipes explain their batch
arithmetic in them). Parallel keys use the seed's `TransformerOpParallelConfig` names.
"""
from __future__ import annotations

import argparse
import json

from common.cli_args import Number, OutOfRange, Parser, integer, number
from common.errors import UserError
from model.config import MAX_POSITIONS
from preprocess.corpus_source import add_corpus_flags
from preprocess.textio import read_json
from preprocess.tokenizer import BPE_SPECIALS
from training.config.sections import TrainConfig
from training.core.deepspeed_check import check_deepspeed_config, strip_comments
from training.core.schedule import SCHEDULES

# recipe "parallel" key (seed name) → flag dest
PARALLEL_KEYS = {"model_parallel": "mp", "pipeline_stage": "pipeline_stage", "micro_batch_num": "micro_batch_num",
                 "optimizer_shard": "enable_parallel_optimizer", "gradient_aggregation_group":
                 "gradient_aggregation_group", "recompute": "recompute", "vocab_emb_dp": "vocab_emb_dp",
                 "zero_stage": "zero_stage", "pipeline_func": "pipeline_func", "data_parallel": "data_parallel",
                 "interleave_num": "interleave_num", "world_size": "world_size"}

# What each numeric flag accepts (common.cli_args): the command line and a recipe's values are checked by the same
# type. Ranges that depend on other flags or on the world size are model.config.validate_layout's.
POSITIVE = integer(1)
LENGTH = integer(2, MAX_POSITIONS, why=f"at least one token plus BOS/EOS; at most {MAX_POSITIONS} positions: "
                 f"attention keeps length² scores per head and sequence, 1 GiB at {MAX_POSITIONS}. Longer sentences "
                 f"are cut to the length, so choose one that covers most of yours, e.g. 128")
PROBABILITY = number(0, 1, high_open=True)
# the seed feeds numpy's generators (any integer >= 0; -1 failed at the first epoch) and torch.manual_seed (up to
# 2**64 - 1, with room kept for the stream offsets model.parallel.random adds): [0, 2**32 - 1], numpy's classic range
SEED = integer(0, 2 ** 32 - 1)
# blocks per stack: DeepNet, the deepest Transformer published, has 1,000 layers in all; the bound keeps a typo
# (100000) from building and planning 10⁵ blocks for minutes before anything is said
MAX_LAYERS = 1000
LAYERS = integer(1, MAX_LAYERS, why="blocks of this stack; DeepNet, the deepest published Transformer, has 1000 in all")
TOKENIZER_VOCAB = integer(len(BPE_SPECIALS) + 1, why=f"more than the {len(BPE_SPECIALS)} special tokens")
# torch counts a collective's deadline in 64-bit nanoseconds from now: 1e9 s (31 years) stays far inside it
COMM_TIMEOUT = number(0, 1e9, low_open=True, why="seconds")

EXAMPLES = """\
examples (CPU, bundled Multi30k; see README):
  python run_scripts/train.py --file_path out/data/train.fr_en.tsv --steps 20 --output_dir out/serial
  deepspeed --num_gpus 2 run_scripts/train.py --distribute true --file_path out/data/train.fr_en.tsv \\
      --mp 2 --steps 20 --output_dir out/tp2
  deepspeed --num_gpus 8 run_scripts/train.py --recipe recipes/8pcs/8pcs.json --file_path DATA.tsv
  deepspeed --hostfile hostfile run_scripts/train.py --recipe recipes/16pcs/16pcs.json --file_path DATA.tsv

The data-parallel size is derived as world_size // mp // pipeline_stage, as in the seed.
"""


def _bool(v) -> bool:
    if isinstance(v, bool):
        return v
    s = str(v).strip().lower()
    if s in ("1", "true", "yes", "on"):
        return True
    if s in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true/false or 1/0, got {v!r}")


def build_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="train.py", description="Train the encoder-decoder Transformer with tensor (mp), pipeline and data "
        "parallelism on DeepSpeed. Launch with `deepspeed --num_gpus N`, `deepspeed --hostfile H`, torchrun, or "
        "plain python for one process.", epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("the seed's flags")
    g.add_argument("--distribute", default="auto", choices=["true", "false", "auto"],
                   help="true: join the launcher's process group; false: one process; auto (default): true when "
                        "started by a launcher (WORLD_SIZE set)")
    g.add_argument("--file_path", help="training data: a TSV of 'source<TAB>target' pairs (preprocess.parallel); or a "
                   "datasets save_to_disk folder, a .jsonl/.json/.csv/.parquet file or a Hub name, with the "
                   "'table input' flags")
    g.add_argument("--mp", type=POSITIVE, default=1, help="model (tensor) parallel size (default 1)")
    g.add_argument("--pipeline_stage", type=POSITIVE, default=1, help="number of pipeline stages (default 1)")
    g.add_argument("--micro_batch_num", type=POSITIVE, default=1,
                   help="micro-batches per step = gradient accumulation steps (default 1)")
    g.add_argument("--batch_size", type=POSITIVE, default=32, help="GLOBAL batch size in sentence pairs (default 32)")
    g.add_argument("--src_len", type=LENGTH, default=10, help="source length in tokens (default 10, the seed's)")
    g.add_argument("--tgt_len", type=LENGTH, default=10, help="target length in tokens (default 10, the seed's)")
    g.add_argument("--vocab_size", type=POSITIVE, default=None,
                   help="model vocabulary (default: the tokenizer's size; must be >= it)")
    g.add_argument("--d_model", type=POSITIVE, default=128, help="hidden size (default 128)")
    g.add_argument("--encoder_layer", type=LAYERS, default=1, help=f"encoder blocks (default 1; at most {MAX_LAYERS})")
    g.add_argument("--decoder_layer", type=LAYERS, default=1, help=f"decoder blocks (default 1; at most {MAX_LAYERS})")
    g.add_argument("--lr", type=number(0, why="the peak learning rate; 0 freezes the weights"), default=1e-4,
                   help="peak learning rate (default 1e-4)")
    g.add_argument("--enable_parallel_optimizer", type=_bool, default=False,
                   help="0/1: shard optimizer state over data-parallel ranks (ZeRO stage 1)")
    g.add_argument("--ckpt_file", default=None, help="checkpoint directory to resume from (or to evaluate)")
    g.add_argument("--train", type=_bool, default=True, help="1: train (default); 0: only evaluate the loss")

    g = p.add_argument_group("model")
    g.add_argument("--num_heads", type=POSITIVE, default=8, help="attention heads (default 8, the seed's)")
    g.add_argument("--ffn_size", type=integer(0, why="0 = d_model"), default=0,
                   help="FFN hidden size (default 0 = d_model, the seed's)")
    g.add_argument("--dropout", type=PROBABILITY, default=0.1, help="hidden dropout (default 0.1)")
    g.add_argument("--attention_dropout", type=PROBABILITY, default=None,
                   help="attention dropout (default = --dropout)")
    g.add_argument("--label_smoothing", type=PROBABILITY, default=0.0, help="label smoothing (default 0)")
    g.add_argument("--share_embeddings", type=_bool, default=False,
                   help="0/1: one table for source words, target words and the output projection (a joint "
                        "vocabulary, as the BPE tokenizer builds); with --mp > 1 it needs --vocab_emb_dp 0")
    g.add_argument("--tokenizer", default=None,
                   help="tokenizer.json; without it a BPE tokenizer is trained on --file_path and cached")
    g.add_argument("--tokenizer_vocab_size", type=TOKENIZER_VOCAB, default=8000,
                   help="vocabulary of the auto-built BPE tokenizer (default 8000)")
    g.add_argument("--cache_dir", default=None,
                   help="where the token store of --file_path/--valid_file (and an auto-built tokenizer) is written "
                        "and looked for (default: .tokcache/ beside the TSV); for a read-only or shared data folder")

    g = p.add_argument_group("table input (--file_path/--valid_file not a TSV; docs/data.md, Input formats)")
    add_corpus_flags(g, split_help="split of --file_path when it is a DatasetDict folder or a Hub dataset (default: "
                                   "train; a plain Dataset folder or a .jsonl/.json/.csv/.parquet file is read whole)")
    g.add_argument("--valid_split", default=None, metavar="SPLIT",
                   help="split of --valid_file when it is a DatasetDict folder or a Hub dataset (default: validation)")

    g = p.add_argument_group("parallelism and memory")
    g.add_argument("--world_size", type=integer(1, why="the processes the layout is written for"), default=None,
                   help="the processes the layout is written for (a recipe's parallel.world_size): run.sh and a "
                        "recipe's run.sh start that many, plan.py plans for it; train.py runs on the world its "
                        "launcher gives it and says so when that differs")
    g.add_argument("--data_parallel", type=POSITIVE, default=None,
                   help="optional check: the dp size you expect (derived from the world size otherwise)")
    g.add_argument("--zero_stage", type=int, default=None, choices=[0, 1, 2, 3],
                   help="ZeRO stage (default: 1 with --enable_parallel_optimizer 1, else 0; 2/3 need "
                        "pipeline_stage 1)")
    g.add_argument("--gradient_aggregation_group", type=POSITIVE, default=4,
                   help="gradient reduction buckets per step: bucket = gradient bytes / groups (default 4)")
    g.add_argument("--recompute", type=_bool, default=False,
                   help="0/1: activation checkpointing of every block (what the built-in pipeline_funcs do with it; "
                        "a custom pipeline_func calls recompute() on the blocks it picks)")
    g.add_argument("--vocab_emb_dp", type=_bool, default=True,
                   help="1 (default): replicate the embedding tables; 0: split their rows over mp ranks")
    g.add_argument("--interleave_num", type=POSITIVE, default=1,
                   help="the seed's MicroBatchInterleaved: run each micro-batch as N batch parts so that one part's "
                        "tensor-parallel all-reduces overlap another part's compute (default 1 = off; N must "
                        "divide the per-rank micro-batch; useful with --mp > 1)")
    g.add_argument("--pipeline_func", default=None,
                   help="how blocks are placed on stages, recomputed and fusion-tagged: seed (default: MindSpore's "
                        "split, min(i // max(blocks // pp, 1), pp - 1)), even (i · pp // blocks), blocks:N0,N1,... "
                        "(N0 blocks on stage 0, N1 on stage 1, ...: what plan.py --search writes), or "
                        "'package.module:function' with the seed's signature (model/pipeline.py)")
    g.add_argument("--precision", default="fp32", choices=["fp32", "fp16", "bf16"],
                   help="fp32 (default), or mixed precision with fp32 master weights, moments and gradient "
                        "accumulation: bf16 (DeepSpeed's BF16_Optimizer) or fp16 (ZeRO optimizer with dynamic loss "
                        "scaling). Half precision runs ZeRO stage >= 1 (see training/core/engine.py). Works on CPU "
                        "where the CPU supports it (avx512_bf16 / avx512_fp16)")
    g.add_argument("--deepspeed_config", default=None,
                   help="a DeepSpeed JSON merged over the generated one (batch keys must agree)")

    g = p.add_argument_group("token batches (fairseq's --max-tokens)")
    g.add_argument("--max_tokens", type=integer(0, why="0: fixed batches of --batch_size"), default=0,
                   help="instead of --batch_size pairs padded to src_len/tgt_len: global batches of pairs of similar "
                        "length, each padded only to its own longest pair, pairs × padded length <= N on each side "
                        "(default 0 = off; preprocess/token_batches.py). Layout-free like fixed batches")
    g.add_argument("--batch_multiple", type=POSITIVE, default=16,
                   help="with --max_tokens: pairs per batch are a multiple of this (default 16); "
                        "data_parallel × micro_batch_num (× interleave_num) must divide it")
    g.add_argument("--pad_multiple", type=POSITIVE, default=8,
                   help="with --max_tokens: batch lengths are rounded up to a multiple of this (default 8: few shapes)")
    g.add_argument("--num_batch_buckets", type=integer(0, why="0: no buckets"), default=0,
                   help="with --max_tokens: snap each side's lengths to at most N lengths, chosen to add the fewest "
                        "PAD positions (fairseq's --num-batch-buckets): batches come in fewer shapes, so pipeline "
                        "stages exchange fewer tensor sizes (default 0 = off; the recipes say what they use)")

    g = p.add_argument_group("schedule and logging")
    g.add_argument("--steps", type=integer(0), default=None, help="optimizer steps (default: --epochs worth)")
    g.add_argument("--epochs", type=POSITIVE, default=1, help="epochs when --steps is not given (default 1)")
    g.add_argument("--seed", type=SEED, default=1234, help="seed for weights, data order and dropout")
    g.add_argument("--weight_decay", type=number(0), default=0.1, help="AdamW weight decay (not on LayerNorm/bias)")
    g.add_argument("--lr_schedule", default="constant", choices=list(SCHEDULES),
                   help="learning rate after warmup (training/core/schedule.py): constant (default), inverse_sqrt "
                        "(fairseq), cosine or polynomial (the seed's family) decay to --min_lr_ratio × --lr at the "
                        "last step")
    g.add_argument("--warmup_steps", type=integer(0), default=0,
                   help="linear learning-rate warmup steps (default 0)")
    g.add_argument("--min_lr_ratio", type=number(0, 1, why="a fraction of --lr"), default=0.0,
                   help="cosine/polynomial: final learning rate as a fraction of --lr (default 0)")
    g.add_argument("--lr_power", type=number(0, low_open=True), default=1.0,
                   help="polynomial decay power (default 1: linear)")
    g.add_argument("--decay_steps", type=integer(1), default=None,
                   help="cosine/polynomial: the step at which the decay reaches --min_lr_ratio (default: the run's "
                        "last step). A resumed run keeps its checkpoint's, so raising --steps trains on at the "
                        "final rate; set it to stretch the schedule")
    g.add_argument("--adam_beta1", type=number(0, 1, high_open=True, why="AdamW's first-moment decay"), default=0.9,
                   help="AdamW beta1 (default 0.9)")
    g.add_argument("--adam_beta2", type=number(0, 1, high_open=True, why="AdamW's second-moment decay"),
                   default=0.98, help="AdamW beta2 (default 0.98, as fairseq's Transformer recipes)")
    g.add_argument("--adam_eps", type=number(0, low_open=True), default=1e-8, help="AdamW epsilon (default 1e-8)")
    g.add_argument("--clip_grad", type=number(0, why="0 turns clipping off"), default=0.0,
                   help="clip the global gradient norm (the serial model's, under any layout) to this value "
                        "(default 0 = off); the pre-clip norm is logged as grad_norm")
    g.add_argument("--output_dir", default="out/train", help="metrics.jsonl, TensorBoard, checkpoints")
    g.add_argument("--log_interval", type=POSITIVE, default=1, help="print a loss line every N steps (default 1)")
    g.add_argument("--tensorboard", type=_bool, default=True, help="0/1: write TensorBoard events")
    # experiment trackers (training/core/trackers.py; pip install -e '.[wandb]' / -e '.[mlflow]'): rank 0 logs there
    g.add_argument("--wandb", default=None, metavar="PROJECT",
                   help="also log metrics.jsonl's numbers (and run.json as the config) to this Weights & Biases "
                        "project; WANDB_MODE=offline writes the run under OUTPUT_DIR/wandb without a network")
    g.add_argument("--wandb_entity", default=None, help="the W&B team or user the project belongs to")
    g.add_argument("--wandb_run_name", default=None, help="the run's name in W&B or MLflow (default: theirs)")
    g.add_argument("--mlflow", default=None, metavar="EXPERIMENT",
                   help="also log them to this MLflow experiment, at MLFLOW_TRACKING_URI (default: a store in "
                        "OUTPUT_DIR/mlruns)")

    g = p.add_argument_group("validation")
    g.add_argument("--valid_file", default=None,
                   help="validation TSV (source<TAB>target, same tokenizer; or a table, as --file_path): valid_loss "
                        "is logged every --valid_interval steps and the best checkpoint kept in "
                        "OUTPUT_DIR/checkpoints/best")
    g.add_argument("--valid_interval", type=integer(0, why="0: once per epoch"), default=0,
                   help="steps between validations (default 0 = once per epoch); also after the last step")
    g.add_argument("--valid_bleu", type=_bool, default=False,
                   help="0/1: also translate --valid_file greedily at each validation and log its sacreBLEU "
                        "(valid_bleu; the best checkpoint is still chosen by valid_loss)")
    g.add_argument("--early_stop_patience", type=integer(0, why="0: never"), default=0,
                   help="stop after K validations in a row without a new best (default 0 = never)")

    g = p.add_argument_group("checkpoints")
    g.add_argument("--save_checkpoint_steps", type=integer(0, why="0: never"), default=0,
                   help="save every N steps and at the last step (default 0 = never)")
    g.add_argument("--keep_checkpoint_max", type=integer(0, why="0 keeps every checkpoint"), default=4,
                   help="keep the newest K checkpoints (default 4; 0: all)")
    g.add_argument("--verify", type=_bool, default=True,
                   help="1 (default): check every checkpoint file a resume reads against the sha256 its writer "
                        "stored in meta.json, and refuse a damaged one naming the file; 0: load without checking")
    g.add_argument("--save_mode", default="background", choices=["background", "sync"],
                   help="background (default): a periodic save copies the state into host memory (pinned, on a "
                        "GPU) and training goes on while a thread writes, hashes and commits it — host memory grows "
                        "by the state being saved while it is written; sync: training waits for every save (no "
                        "extra memory). The last step's save, a save on a stop signal and the best checkpoint are "
                        "always synchronous. docs/checkpoints.md")
    g.add_argument("--resume", nargs="?", const="latest", default=None, metavar="auto|PATH",
                   help="continue the run in --output_dir from its latest checkpoint (from --ckpt_file while the "
                        "folder has none); 'auto': the same, or a fresh start when there is neither; PATH: from that "
                        "checkpoint (a step_* folder or a run's output_dir). A run without --resume is refused when "
                        "--output_dir already holds checkpoints")

    g = p.add_argument_group("failures")
    g.add_argument("--nan_policy", default="stop", choices=["stop", "skip"],
                   help="a step whose loss or gradient is not finite never updates the weights; stop (default): "
                        "the run then ends with an error naming the step; skip: it goes on, counting such steps as "
                        "skipped_steps in metrics.jsonl (the fp16 loss scaler's overflow steps are counted there too)")
    g.add_argument("--nan_skip_limit", type=POSITIVE, default=10,
                   help="with --nan_policy skip: stop after this many non-finite steps in a row (default 10)")
    g.add_argument("--comm_timeout", type=COMM_TIMEOUT, default=1800.0,
                   help="seconds a collective waits for the other ranks before the job is ended with a message "
                        "(default 1800): a rank that hangs or is paused (SIGSTOP) ends the job instead of "
                        "hanging it. Raise it if a step or a save legitimately takes longer (a first-time token "
                        "store build is not bounded by it)")
    g.add_argument("--save_on_signal", type=_bool, default=True,
                   help="1 (default): on SIGTERM, SIGUSR1 (a scheduler's preemption notice; SLURM's --signal) or "
                        "SIGHUP (a closed terminal) to any rank or to the launcher, every rank finishes its step, a "
                        "checkpoint of that step is saved and the job exits non-zero, saying how to resume; 0: stop "
                        "after the step, no save")

    p.add_argument("--recipe", default=None, help="JSON recipe (recipes/*/*.json); flags given here override it")
    p.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)
    return p


def _recipe_value(action: argparse.Action, value, where: str):
    """A recipe value checked like the flag it stands for: its numeric type's range, or the type JSON gives."""
    if value is None:
        return None
    kind = action.type
    if isinstance(kind, Number):
        try:
            return kind(value)
        except OutOfRange as exc:
            raise UserError(f"{where} is {json.dumps(value)}; it {exc.problem}") from None
    try:
        if kind is int:
            if isinstance(value, bool) or not isinstance(value, (int, str)):
                raise ValueError
            value = int(value)
        elif kind is _bool:
            value = _bool(value)
        elif not isinstance(value, str):           # paths, names, choices: strings
            raise ValueError
    except (ValueError, argparse.ArgumentTypeError):
        want = {int: "an integer", _bool: "true or false"}.get(kind, "a string")
        raise UserError(f"{where} is {json.dumps(value)}; it must be {want}") from None
    if action.choices is not None and value not in action.choices:
        raise UserError(f"{where} is {json.dumps(value)}; it must be one of {list(action.choices)}")
    return value


def load_recipe(path: str) -> dict:
    """Flatten a recipe's sections into flag defaults; the 'deepspeed' section is kept as a dict."""
    data = read_json(path, "recipe")
    if not isinstance(data, dict):
        raise UserError(f"recipe {path}: expected a JSON object with sections model, parallel, training, deepspeed")
    flat: dict = {}
    actions = {a.dest: a for a in build_parser()._actions}
    for section, values in data.items():
        if section.startswith("_"):
            continue
        if section not in ("model", "parallel", "training", "deepspeed"):
            raise UserError(f"recipe {path}: unknown section {section!r} (model, parallel, training, deepspeed)")
        if not isinstance(values, dict):
            raise UserError(f"recipe {path}: section {section!r} must be a JSON object of settings")
        if section == "deepspeed":
            flat["deepspeed_overrides"] = strip_comments(values)        # "_" keys are comments at any depth
            continue
        for key, value in values.items():
            if key.startswith("_"):
                continue
            dest = PARALLEL_KEYS.get(key, key) if section == "parallel" else key
            if dest not in actions or dest in ("recipe", "local_rank", "help"):
                raise UserError(f"recipe {path}: unknown key {section}.{key}")
            flat[dest] = _recipe_value(actions[dest], value, f"recipe {path}: {section}.{key}")
    return flat


def parse_args(argv: list | None = None, parser: argparse.ArgumentParser | None = None) -> argparse.Namespace:
    """Flags over recipe over defaults. `parser`: build_parser() with extra arguments (plan.py adds its own)."""
    parser = parser or build_parser()
    first, _ = parser.parse_known_args(argv)
    recipe = load_recipe(first.recipe) if first.recipe else {}
    overrides = recipe.pop("deepspeed_overrides", {})
    parser.set_defaults(**recipe)
    args = parser.parse_args(argv)
    args.deepspeed_overrides = overrides
    # DeepSpeed settings of the wrong type fail here, in seconds, not after the model is built
    if overrides:
        check_deepspeed_config(overrides, f"recipe {first.recipe}: deepspeed", args.precision)
    if args.deepspeed_config:
        check_deepspeed_config(read_json(args.deepspeed_config, "--deepspeed_config"),
                               f"--deepspeed_config {args.deepspeed_config}", args.precision)
    return args


def given_flags(parser: argparse.ArgumentParser, argv: list | None) -> set[str]:
    """The dests of the flags on the command line itself, not their defaults (`parser`: a fresh build_parser())."""
    for action in parser._actions:
        action.default = argparse.SUPPRESS
    found, _ = parser.parse_known_args(argv)
    return set(vars(found))


def parse_config(argv: list | None = None) -> TrainConfig:
    """train.py's command line → the typed, checked configuration the trainer runs. It remembers which flags the
    user set (command line, then recipe): a run that starts from a checkpoint takes the checkpoint's value for every
    other setting it carries (training.run.start_point, once the start point is decided)."""
    args = parse_args(argv)
    explicit = {dest: f"--{dest}" for dest in given_flags(build_parser(), argv)}
    if args.recipe:
        for dest in load_recipe(args.recipe):
            explicit.setdefault(dest, f"recipe {args.recipe}'s {dest}")
    args.explicit = explicit
    return TrainConfig.from_flags(args)
