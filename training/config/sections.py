"""train.py's settings as typed, frozen sections, each checked once when it is built. Each field is declared once
(training.config.schema.setting): its flag, the seed's alias, range, default, help and what a checkpoint carries it
as; the flags, recipe keys and checkpoint lists are read from here (docs/settings.md)."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field

from common.cli_args import integer, number
from common.errors import UserError
from model.config import ModelConfig, ParallelConfig
from preprocess.corpus_source import CorpusOptions, add_corpus_flags
from training.config.schema import (
    COMM_TIMEOUT,
    FIXED_ORDER,
    LAYERS,
    LENGTH,
    MAX_LAYERS,
    POSITIVE,
    PROBABILITY,
    SEED,
    SHAPE,
    TOKEN_ORDER,
    TOKENIZER_VOCAB,
    TRAJECTORY,
    as_bool,
    copy_of,
    declarations,
    flag_from,
    setting,
)
from training.core.schedule import SCHEDULES
from training.core.trackers import require

ORDER = (FIXED_ORDER, TOKEN_ORDER)


@dataclass(frozen=True)
class ModelSection:
    """model (a checkpoint carries its shape: a run from it takes these unless given)"""

    vocab_size: int | None = setting(
        None, "model vocabulary (default: the tokenizer's size; must be >= it)", POSITIVE, carried=(SHAPE,)
    )
    d_model: int = setting(128, "hidden size (default 128)", POSITIVE, carried=(SHAPE,))
    num_heads: int = setting(8, "attention heads (default 8, the seed's)", POSITIVE, carried=(SHAPE,))
    ffn_size: int = setting(
        0, "FFN hidden size (default 0 = d_model, the seed's)", integer(0, why="0 = d_model"), carried=(SHAPE,)
    )
    encoder_layer: int = setting(
        1, f"encoder blocks (default 1; at most {MAX_LAYERS})", LAYERS, carried=(SHAPE,), saved_as="encoder_layers"
    )
    decoder_layer: int = setting(
        1, f"decoder blocks (default 1; at most {MAX_LAYERS})", LAYERS, carried=(SHAPE,), saved_as="decoder_layers"
    )
    src_len: int = setting(10, "source length in tokens (default 10, the seed's)", LENGTH, carried=(SHAPE,))
    tgt_len: int = setting(10, "target length in tokens (default 10, the seed's)", LENGTH, carried=(SHAPE,))
    share_embeddings: bool = setting(
        False,
        "0/1: one table for source words, target words and the output projection (a joint vocabulary, as "
        "the BPE tokenizer builds); with --model_parallel > 1 it needs --vocab_emb_dp 0",
        as_bool,
        carried=(SHAPE,),
    )
    dropout: float = setting(0.1, "hidden dropout (default 0.1)", PROBABILITY, carried=(SHAPE,))
    attention_dropout: float | None = setting(
        None, "attention dropout (default = --dropout)", PROBABILITY, carried=(SHAPE,)
    )
    label_smoothing: float = setting(0.0, "label smoothing (default 0)", PROBABILITY, carried=(SHAPE,))
    tokenizer: str | None = setting(
        None, "tokenizer.json; without it a BPE tokenizer is trained on --file_path and cached"
    )
    tokenizer_vocab_size: int = setting(
        8000, "vocabulary of the auto-built BPE tokenizer (default 8000)", TOKENIZER_VOCAB
    )

    def __post_init__(self):
        if self.attention_dropout is None:
            object.__setattr__(self, "attention_dropout", self.dropout)  # frozen: set once, here
        # each field's range is its flag's type's; the dimensions against the layout: model.config.validate_layout

    def model_config(self, vocab_size: int, pad_id: int) -> ModelConfig:
        return ModelConfig(
            vocab_size=vocab_size,
            d_model=self.d_model,
            num_heads=self.num_heads,
            ffn_size=self.ffn_size,
            encoder_layers=self.encoder_layer,
            decoder_layers=self.decoder_layer,
            src_len=self.src_len,
            tgt_len=self.tgt_len,
            dropout=self.dropout,
            attention_dropout=self.attention_dropout,
            label_smoothing=self.label_smoothing,
            pad_id=pad_id,
            share_embeddings=self.share_embeddings,
        )

    def probe(self) -> ModelConfig:
        """The model's shape before the tokenizer is known (layout checks need only the dimensions)."""
        return self.model_config(vocab_size=max(self.vocab_size or 1, 1), pad_id=0)


@dataclass(frozen=True)
class ParallelSection:
    """parallelism and memory (a recipe's "parallel" section: the seed's TransformerOpParallelConfig names)"""

    distribute: str = setting(
        "auto",
        "true: join the launcher's process group; false: one process; auto (default): "
        "true when started by a launcher (WORLD_SIZE set)",
        choices=("true", "false", "auto"),
    )
    world_size: int | None = setting(
        None,
        "the processes the layout is written for (a recipe's parallel.world_size): run.sh and a recipe's "
        "run.sh start that many, plan.py plans for it; train.py runs on the world its launcher gives it and says so "
        "when that differs",
        integer(1, why="the processes the layout is written for"),
    )
    model_parallel: int = setting(1, "model (tensor) parallel size (default 1)", POSITIVE, aliases=("mp",))
    pipeline_stage: int = setting(1, "number of pipeline stages (default 1)", POSITIVE)
    micro_batch_num: int = setting(1, "micro-batches per step = gradient accumulation steps (default 1)", POSITIVE)
    data_parallel: int | None = setting(
        None, "optional check: the dp size you expect (derived from the world size otherwise)", POSITIVE
    )
    optimizer_shard: bool = setting(
        False,
        "0/1: shard optimizer state over data-parallel ranks (ZeRO stage 1)",
        as_bool,
        aliases=("enable_parallel_optimizer",),
    )
    zero_stage: int | None = setting(
        None,
        "ZeRO stage (default: 1 with --optimizer_shard 1, else 0; 2/3 need pipeline_stage 1)",
        int,
        choices=(0, 1, 2, 3),
    )
    gradient_aggregation_group: int = setting(
        4, "gradient reduction buckets per step: bucket = gradient bytes / groups (default 4)", POSITIVE
    )
    recompute: bool = setting(
        False,
        "0/1: activation checkpointing of every block (what the built-in "
        "pipeline_funcs do with it; a custom pipeline_func calls recompute() on the "
        "blocks it picks)",
        as_bool,
    )
    vocab_emb_dp: bool = setting(
        True, "1 (default): replicate the embedding tables; 0: split their rows over model-parallel ranks", as_bool
    )
    interleave_num: int = setting(
        1,
        "the seed's MicroBatchInterleaved: run each micro-batch as N batch parts so that one part's "
        "tensor-parallel all-reduces overlap another part's compute (default 1 = off; N must divide the per-rank "
        "micro-batch; useful with --model_parallel > 1)",
        POSITIVE,
    )
    pipeline_func: str | None = setting(
        None,
        "how blocks are placed on stages, recomputed and fusion-tagged: seed (default: MindSpore's split, "
        "min(i // max(blocks // pp, 1), pp - 1)), even (i · pp // blocks), blocks:N0,N1,... (N0 blocks on stage 0, "
        "N1 on stage 1, ...: what plan.py --search writes), or 'package.module:function' with the seed's signature "
        "(model/pipeline.py)",
    )
    precision: str = setting(
        "fp32",
        "fp32 (default), or mixed precision with fp32 master weights, moments and gradient accumulation: "
        "bf16 (DeepSpeed's BF16_Optimizer) or fp16 (ZeRO optimizer with dynamic loss scaling). Half precision runs "
        "ZeRO stage >= 1 (see training/core/engine.py). Works on CPU where the CPU supports it (avx512_bf16 / "
        "avx512_fp16)",
        choices=("fp32", "fp16", "bf16"),
    )
    deepspeed_config: str | None = setting(
        None, "a DeepSpeed JSON merged over the generated one (batch keys must agree)"
    )
    deepspeed_overrides: dict = field(default_factory=dict)  # a recipe's "deepspeed" section (not a flag)

    def __post_init__(self):
        # against the layout (mp × pipeline_stage must divide it) where a world is chosen: plan.py --check, which
        # run.sh runs at this size before any rank starts; here only what needs no layout (flags may change mp)
        if self.world_size is not None and self.world_size < 1:
            raise UserError(f"--world_size {self.world_size} must be >= 1 (the processes the layout is written for)")

    def world_size_note(self, world: int) -> str | None:
        """The line train.py prints when its launcher started another number of processes than the layout is
        written for (it runs anyway: dp = world // mp // pipeline_stage follows the real world)."""
        if self.world_size is None or self.world_size == world:
            return None
        return (
            f"note: the layout is written for {self.world_size} processes (world_size) but this job has "
            f"{world}; dp follows the job: world // mp // pipeline_stage"
        )

    def parallel_config(self, world_size: int) -> ParallelConfig:
        """The layout at this world size (dp derived as world // mp // pipeline_stage, as in the seed)."""
        cfg = ParallelConfig.for_world(
            world_size,
            model_parallel=self.model_parallel,
            pipeline_stage=self.pipeline_stage,
            micro_batch_num=self.micro_batch_num,
            optimizer_shard=self.optimizer_shard,
            gradient_aggregation_group=self.gradient_aggregation_group,
            recompute=self.recompute,
            vocab_emb_dp=self.vocab_emb_dp,
            zero_stage=self.zero_stage,
            interleave_num=self.interleave_num,
        )
        if self.data_parallel is not None and self.data_parallel != cfg.data_parallel:
            raise UserError(
                f"data_parallel={self.data_parallel} was asked for but world_size {world_size} // mp "
                f"{self.model_parallel} // pipeline_stage {self.pipeline_stage} = {cfg.data_parallel}"
            )
        return cfg


def _corpus_flags(group) -> None:
    """The table-input flags every corpus-reading command shares (preprocess.corpus_source declares them)."""
    add_corpus_flags(
        group,
        split_help="split of --file_path when it is a DatasetDict folder or a Hub dataset "
        "(default: train; a plain Dataset folder or a .jsonl/.json/.csv/.parquet "
        "file is read whole)",
    )


@dataclass(frozen=True)
class DataSection:
    """data and batches (token batches: fairseq's --max-tokens; tables: docs/data.md, Input formats)"""

    file_path: str | None = setting(
        None,
        "training data: a TSV of 'source<TAB>target' pairs (preprocess.parallel); or a datasets save_to_disk "
        "folder, a .jsonl/.json/.csv/.parquet file or a Hub name, with the table-input flags",
    )
    cache_dir: str | None = setting(
        None,
        "where the token store of --file_path/--valid_file (and an auto-built tokenizer) is written and "
        "looked for (default: .tokcache/ beside the TSV); for a read-only or shared data folder",
    )
    batch_size: int = setting(32, "GLOBAL batch size in sentence pairs (default 32)", POSITIVE, carried=(FIXED_ORDER,))
    max_tokens: int = setting(
        0,
        "instead of --batch_size pairs padded to src_len/tgt_len: global batches of pairs of similar length, each "
        "padded only to its own longest pair, pairs × padded length <= N on each side (default 0 = off; "
        "preprocess/token_batches.py). Layout-free like fixed batches",
        integer(0, why="0: fixed batches of --batch_size"),
        carried=(TOKEN_ORDER,),
    )
    batch_multiple: int = setting(
        16,
        "with --max_tokens: pairs per batch are a multiple of this (default 16); data_parallel × "
        "micro_batch_num (× interleave_num) must divide it",
        POSITIVE,
        carried=(TOKEN_ORDER,),
    )
    pad_multiple: int = setting(
        8,
        "with --max_tokens: batch lengths are rounded up to a multiple of this (default 8: few shapes)",
        POSITIVE,
        carried=(TOKEN_ORDER,),
    )
    num_batch_buckets: int = setting(
        0,
        "with --max_tokens: snap each side's lengths to at most N lengths, chosen to add the fewest PAD positions "
        "(fairseq's --num-batch-buckets): batches come in fewer shapes, so pipeline stages exchange fewer tensor "
        "sizes (default 0 = off; the recipes say what they use)",
        integer(0, why="0: no buckets"),
        carried=(TOKEN_ORDER,),
    )
    seed: int = setting(1234, "seed for weights, data order and dropout", SEED, carried=ORDER)
    split: str | None = flag_from(_corpus_flags)  # None: train (--file_path)
    valid_split: str | None = setting(
        None,
        "split of --valid_file when it is a DatasetDict folder or a Hub dataset (default: validation)",
        metavar="SPLIT",
    )
    src_field: str | None = flag_from(_corpus_flags)
    tgt_field: str | None = flag_from(_corpus_flags)
    src_lang: str | None = flag_from(_corpus_flags)
    tgt_lang: str | None = flag_from(_corpus_flags)
    dataset_config: str | None = flag_from(_corpus_flags)
    # batch_size against the layout: model.config.validate_layout (it names the sizes that would fit)

    def corpus(self, valid: bool = False) -> CorpusOptions:
        """How --file_path's (or with `valid` --valid_file's) pairs are taken from a table."""
        return CorpusOptions(
            split=self.valid_split if valid else self.split,
            src_field=self.src_field,
            tgt_field=self.tgt_field,
            src_lang=self.src_lang,
            tgt_lang=self.tgt_lang,
            config=self.dataset_config,
            default_split="validation" if valid else "train",
        )

    @property
    def batch_unit(self) -> tuple[int, str]:
        """What the layout must divide: the global batch_size, or with token batches the batch_multiple every
        batch's size is a multiple of (also the batch DeepSpeed's config counts)."""
        return (self.batch_multiple, "batch_multiple") if self.max_tokens else (self.batch_size, "batch_size")

    @property
    def valid_batch_size(self) -> int:
        """Validation runs fixed batches; with token batches, batch_size rounded to a multiple of batch_multiple."""
        if not self.max_tokens:
            return self.batch_size
        return max(self.batch_multiple, self.batch_size // self.batch_multiple * self.batch_multiple)


@dataclass(frozen=True)
class OptimizationSection:
    """schedule and optimizer (a checkpoint carries the trajectory: a run from it takes these unless given)"""

    lr: float = setting(
        1e-4,
        "peak learning rate (default 1e-4)",
        number(0, why="the peak learning rate; 0 freezes the weights"),
        carried=(TRAJECTORY,),
    )
    lr_schedule: str = setting(
        "constant",
        "learning rate after warmup (training/core/schedule.py): constant (default), inverse_sqrt "
        "(fairseq), cosine or polynomial (the seed's family) decay to --min_lr_ratio × --lr at the last step",
        choices=tuple(SCHEDULES),
        carried=(TRAJECTORY,),
    )
    warmup_steps: int = setting(0, "linear learning-rate warmup steps (default 0)", integer(0), carried=(TRAJECTORY,))
    decay_steps: int | None = setting(
        None,
        "cosine/polynomial: the step at which the decay reaches --min_lr_ratio (default: the run's last "
        "step). A resumed run keeps its checkpoint's, so raising --steps trains on at the final rate; set it to "
        "stretch the schedule",
        integer(1),
        carried=(TRAJECTORY,),
    )
    min_lr_ratio: float = setting(
        0.0,
        "cosine/polynomial: final learning rate as a fraction of --lr (default 0)",
        number(0, 1, why="a fraction of --lr"),
        carried=(TRAJECTORY,),
    )
    lr_power: float = setting(
        1.0, "polynomial decay power (default 1: linear)", number(0, low_open=True), carried=(TRAJECTORY,)
    )
    clip_grad: float = setting(
        0.0,
        "clip the global gradient norm (the serial model's, under any layout) to this value (default 0 = off); "
        "the pre-clip norm is logged as grad_norm",
        number(0, why="0 turns clipping off"),
        carried=(TRAJECTORY,),
    )
    weight_decay: float = setting(0.1, "AdamW weight decay (not on LayerNorm/bias)", number(0), carried=(TRAJECTORY,))
    adam_beta1: float = setting(
        0.9,
        "AdamW beta1 (default 0.9)",
        number(0, 1, high_open=True, why="AdamW's first-moment decay"),
        carried=(TRAJECTORY,),
    )
    adam_beta2: float = setting(
        0.98,
        "AdamW beta2 (default 0.98, as fairseq's Transformer recipes)",
        number(0, 1, high_open=True, why="AdamW's second-moment decay"),
        carried=(TRAJECTORY,),
    )
    adam_eps: float = setting(1e-8, "AdamW epsilon (default 1e-8)", number(0, low_open=True), carried=(TRAJECTORY,))
    steps: int | None = setting(None, "optimizer steps (default: --epochs worth)", integer(0), carried=(TRAJECTORY,))
    epochs: int = setting(1, "epochs when --steps is not given (default 1)", POSITIVE)
    seed: int = copy_of(DataSection, "seed")  # weights and dropout (the data order's is DataSection.seed)
    train: bool = setting(True, "1: train (default); 0: only evaluate the loss", as_bool)

    def horizon(self, total_steps: int) -> int:
        """The step at which a decaying schedule reaches its end (--decay_steps, else the run's last step)."""
        return self.decay_steps or total_steps

    @property
    def betas(self) -> tuple[float, float]:
        return self.adam_beta1, self.adam_beta2


RESUME_LATEST, RESUME_AUTO = "latest", "auto"  # --resume given bare; --resume auto (training.run.start_point)


@dataclass(frozen=True)
class CheckpointSection:
    """checkpoints (docs/checkpoints.md)"""

    output_dir: str = setting("out/train", "metrics.jsonl, TensorBoard, checkpoints")
    save_checkpoint_steps: int = setting(
        0, "save every N steps and at the last step (default 0 = never)", integer(0, why="0: never")
    )
    keep_checkpoint_max: int = setting(
        4, "keep the newest K checkpoints (default 4; 0: all)", integer(0, why="0 keeps every checkpoint")
    )
    resume: str | None = setting(
        None,
        "continue the run in --output_dir from its latest checkpoint (from --ckpt_file while the folder has "
        "none); 'auto': the same, or a fresh start when there is neither; PATH: from that checkpoint (a step_* "
        "folder or a run's output_dir). A run without --resume is refused when --output_dir already holds "
        "checkpoints",
        nargs="?",
        const=RESUME_LATEST,
        metavar=f"{RESUME_AUTO}|PATH",
    )
    ckpt_file: str | None = setting(None, "checkpoint directory to resume from (or to evaluate)")
    verify: bool = setting(
        True,
        "1 (default): check every checkpoint file a resume reads against the sha256 its "
        "writer stored in meta.json, and refuse a damaged one naming the file; 0: load "
        "without checking",
        as_bool,
    )
    save_mode: str = setting(
        "background",
        "background (default): a periodic save copies the state into host memory (pinned, on a GPU) "
        "and training goes on while a thread writes, hashes and commits it — host memory grows by the state being "
        "saved while it is written; sync: training waits for every save (no extra memory). The last step's save, a "
        "save on a stop signal and the best checkpoint are always synchronous. docs/checkpoints.md",
        choices=("background", "sync"),
    )
    train: bool = copy_of(OptimizationSection, "train")  # an evaluation-only run never writes checkpoints

    @property
    def will_touch_checkpoints(self) -> bool:
        return bool(self.save_checkpoint_steps or self.resume or self.ckpt_file)


@dataclass(frozen=True)
class ValidationSection:
    """validation"""

    valid_file: str | None = setting(
        None,
        "validation TSV (source<TAB>target, same tokenizer; or a table, as --file_path): valid_loss is logged "
        "every --valid_interval steps and the best checkpoint kept in OUTPUT_DIR/checkpoints/best",
    )
    valid_interval: int = setting(
        0,
        "steps between validations (default 0 = once per epoch); also after the last step",
        integer(0, why="0: once per epoch"),
    )
    valid_bleu: bool = setting(
        False,
        "0/1: also translate --valid_file greedily at each validation and log its "
        "sacreBLEU (valid_bleu; the best checkpoint is still chosen by valid_loss)",
        as_bool,
    )
    early_stop_patience: int = setting(
        0, "stop after K validations in a row without a new best (default 0 = never)", integer(0, why="0: never")
    )


@dataclass(frozen=True)
class FaultsSection:
    """failures (docs/failures.md)"""

    nan_policy: str = setting(
        "stop",
        "a step whose loss or gradient is not finite never updates the weights; stop (default): the run "
        "then ends with an error naming the step; skip: it goes on, counting such steps as skipped_steps in "
        "metrics.jsonl (the fp16 loss scaler's overflow steps are counted there too)",
        choices=("stop", "skip"),
    )
    nan_skip_limit: int = setting(
        10, "with --nan_policy skip: stop after this many non-finite steps in a row (default 10)", POSITIVE
    )
    comm_timeout: float = setting(
        1800.0,
        "seconds a collective waits for the other ranks before the job is ended with a message (default "
        "1800): a rank that hangs or is paused (SIGSTOP) ends the job instead of hanging it. Raise it if a step or "
        "a save legitimately takes longer (a first-time token store build is not bounded by it)",
        COMM_TIMEOUT,
    )
    save_on_signal: bool = setting(
        True,
        "1 (default): on SIGTERM, SIGUSR1 (a scheduler's preemption notice; SLURM's --signal) or SIGHUP (a "
        "closed terminal) to any rank or to the launcher, every rank finishes its step, a checkpoint of that step "
        "is saved and the job exits non-zero, saying how to resume; 0: stop after the step, no save",
        as_bool,
    )


@dataclass(frozen=True)
class LoggingSection:
    """logging and experiment trackers (training/core/trackers.py; rank 0 logs there)"""

    log_interval: int = setting(1, "print a loss line every N steps (default 1)", POSITIVE)
    tensorboard: bool = setting(True, "0/1: write TensorBoard events", as_bool)
    wandb: str | None = setting(
        None,
        "also log metrics.jsonl's numbers (and run.json as the config) to this Weights "
        "& Biases project; WANDB_MODE=offline writes the run under OUTPUT_DIR/wandb "
        "without a network",
        metavar="PROJECT",
    )
    wandb_entity: str | None = setting(None, "the W&B team or user the project belongs to")
    wandb_run_name: str | None = setting(None, "the run's name in W&B or MLflow (default: theirs)")
    mlflow: str | None = setting(
        None,
        "also log them to this MLflow experiment, at MLFLOW_TRACKING_URI (default: a store in OUTPUT_DIR/mlruns)",
        metavar="EXPERIMENT",
    )

    def __post_init__(self):
        # a tracker's package is checked here, before any process group: one line naming the extra to install
        for package in ("wandb", "mlflow"):
            if getattr(self, package):
                require(package)


SECTIONS = {
    "model": ModelSection,
    "parallel": ParallelSection,
    "optimization": OptimizationSection,
    "data": DataSection,
    "checkpoint": CheckpointSection,
    "validation": ValidationSection,
    "faults": FaultsSection,
    "logging": LoggingSection,
}


def carried(what: str) -> dict[str, str]:
    """{setting: its key in the checkpoint} of those a checkpoint carries as `what` (schema.SHAPE, TRAJECTORY,
    FIXED_ORDER, TOKEN_ORDER), in declaration order."""
    return {name: d.saved_as or name for _, name, d in declarations(SECTIONS) if what in d.carried}


@dataclass(frozen=True)
class TrainConfig:
    model: ModelSection = field(default_factory=ModelSection)
    parallel: ParallelSection = field(default_factory=ParallelSection)
    optimization: OptimizationSection = field(default_factory=OptimizationSection)
    data: DataSection = field(default_factory=DataSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    validation: ValidationSection = field(default_factory=ValidationSection)
    faults: FaultsSection = field(default_factory=FaultsSection)
    logging: LoggingSection = field(default_factory=LoggingSection)
    recipe: str | None = None
    # the flags the user set (command line or recipe): {dest: where, e.g. "--lr" or "recipe R's lr"} — a run that
    # starts from a checkpoint takes the checkpoint's value for every other one (training.checkpoint.carried_settings)
    explicit: dict = field(default_factory=dict, compare=False)

    def __post_init__(self):
        """Checks across sections (each section checked itself when it was built)."""
        p = self.parallel
        if p.precision == "fp16" and p.pipeline_stage > 1 and self.model.share_embeddings:
            # DeepSpeed 0.19.8's PipelineEngine._exec_reduce_tied_grads sums the tied table's gradient from
            # `param.grad` (`_hp_grad` under BF16_Optimizer), but fp16 runs ZeRO-1 with fp32 gradient accumulation,
            # which keeps it in `param.grad_accum` and sets `param.grad = None`: the sum is skipped and stage 0's
            # table and the last stage's replica drift apart without an error
            raise UserError(
                f"--precision fp16 with --pipeline_stage {p.pipeline_stage} and --share_embeddings 1 "
                f"would train the two copies of the shared table apart (DeepSpeed does not sum their "
                f"gradients under its fp16 optimizer); use --precision bf16 or fp32, or "
                f"--share_embeddings 0"
            )

    @classmethod
    def from_flags(cls, args: argparse.Namespace) -> TrainConfig:
        """Each section takes the flags of its fields' names (a copy_of field its own copy); the rest (plan.py's
        --hostfile ...) are the caller's."""
        flags = vars(args)
        sections = {
            name: kind(**{f.name: flags[f.name] for f in dataclasses.fields(kind) if f.name in flags})
            for name, kind in SECTIONS.items()
        }
        return cls(**sections, recipe=flags.get("recipe"), explicit=dict(flags.get("explicit") or {}))

    def to_flags(self) -> argparse.Namespace:
        """The flags that build this configuration again (from_flags' inverse)."""
        flags = {"recipe": self.recipe, "explicit": dict(self.explicit)}
        for name, kind in SECTIONS.items():
            for f in dataclasses.fields(kind):
                flags.setdefault(f.name, getattr(getattr(self, name), f.name))
        return argparse.Namespace(**flags)

    def with_flags(self, **changes) -> TrainConfig:
        """The same configuration with some flags changed, every section checked again."""
        flags = self.to_flags()
        unknown = set(changes) - set(vars(flags))
        if unknown:  # a misspelt name would otherwise change nothing, silently
            raise TypeError(f"with_flags: no setting named {sorted(unknown)}")
        for dest, value in changes.items():
            setattr(flags, dest, value)
        return TrainConfig.from_flags(flags)

    def to_dict(self) -> dict:
        """Every resolved setting, by section (run.json)."""
        settings = dataclasses.asdict(self)
        del settings["explicit"]
        return settings
