"""train.py's settings as typed, frozen sections, each checked once when it is built.

The flags (training.config.flags: defaults < recipe < command line) end here: `TrainConfig.from_flags(namespace)`
turns the parsed Namespace into one section per concern, and library code takes the section it needs — the
checkpoint code `CheckpointSection`, the data code `DataSection`, the failure handling `FaultsSection` — never the
Namespace. A field keeps its flag's name (`--batch_size` → `DataSection.batch_size`), so a flag, a recipe key and a
field are one thing under one name; the seed's `--enable_parallel_optimizer` is `ParallelSection.optimizer_shard`,
the recipe key it already had.

A single setting's range (a positive size, a finite non-negative clip, a seed numpy and torch take) belongs to its
flag's type (training.config.flags), which checks the command line and a recipe alike, so a field here holds an
accepted value. What a section checks is what spans settings and can be checked from them alone, before any process
group, data or model exists; checks that need more (the world size: `model.config.validate_layout`; the
accelerator: the precision it supports) run once in training.trainer.Trainer.
"""
from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field

from common.errors import UserError
from model.config import ModelConfig, ParallelConfig
from preprocess.corpus_source import CorpusOptions
from training.core.trackers import require


@dataclass(frozen=True)
class ModelSection:
    d_model: int = 128
    num_heads: int = 8
    ffn_size: int = 0
    encoder_layer: int = 1
    decoder_layer: int = 1
    src_len: int = 10
    tgt_len: int = 10
    vocab_size: int | None = None          # None: the tokenizer's
    dropout: float = 0.1
    attention_dropout: float | None = None  # None: = dropout
    label_smoothing: float = 0.0
    share_embeddings: bool = False
    tokenizer: str | None = None
    tokenizer_vocab_size: int = 8000

    def __post_init__(self):
        if self.attention_dropout is None:
            object.__setattr__(self, "attention_dropout", self.dropout)     # frozen: set once, here
        # each field's range is its flag's type's; the dimensions against the layout: model.config.validate_layout

    def model_config(self, vocab_size: int, pad_id: int) -> ModelConfig:
        return ModelConfig(vocab_size=vocab_size, d_model=self.d_model, num_heads=self.num_heads,
                           ffn_size=self.ffn_size, encoder_layers=self.encoder_layer,
                           decoder_layers=self.decoder_layer, src_len=self.src_len, tgt_len=self.tgt_len,
                           dropout=self.dropout, attention_dropout=self.attention_dropout,
                           label_smoothing=self.label_smoothing, pad_id=pad_id,
                           share_embeddings=self.share_embeddings)

    def probe(self) -> ModelConfig:
        """The model's shape before the tokenizer is known (layout checks need only the dimensions)."""
        return self.model_config(vocab_size=max(self.vocab_size or 1, 1), pad_id=0)


@dataclass(frozen=True)
class ParallelSection:
    distribute: str = "auto"                  # true | false | auto
    world_size: int | None = None          # the processes the layout is written for (launchers start that many)
    mp: int = 1
    pipeline_stage: int = 1
    micro_batch_num: int = 1
    data_parallel: int | None = None       # an optional check of the derived dp size
    optimizer_shard: bool = False             # the seed's --enable_parallel_optimizer
    zero_stage: int | None = None
    gradient_aggregation_group: int = 4
    recompute: bool = False
    vocab_emb_dp: bool = True
    interleave_num: int = 1
    pipeline_func: str | None = None
    precision: str = "fp32"
    deepspeed_config: str | None = None    # a DeepSpeed JSON file merged over the generated config
    deepspeed_overrides: dict = field(default_factory=dict)   # a recipe's "deepspeed" section

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
        return (f"note: the layout is written for {self.world_size} processes (world_size) but this job has "
                f"{world}; dp follows the job: world // mp // pipeline_stage")

    def parallel_config(self, world_size: int) -> ParallelConfig:
        """The layout at this world size (dp derived as world // mp // pipeline_stage, as in the seed)."""
        cfg = ParallelConfig.for_world(world_size, model_parallel=self.mp, pipeline_stage=self.pipeline_stage,
                                       micro_batch_num=self.micro_batch_num, optimizer_shard=self.optimizer_shard,
                                       gradient_aggregation_group=self.gradient_aggregation_group,
                                       recompute=self.recompute, vocab_emb_dp=self.vocab_emb_dp,
                                       zero_stage=self.zero_stage, interleave_num=self.interleave_num)
        if self.data_parallel is not None and self.data_parallel != cfg.data_parallel:
            raise UserError(f"data_parallel={self.data_parallel} was asked for but world_size {world_size} // mp "
                            f"{self.mp} // pipeline_stage {self.pipeline_stage} = {cfg.data_parallel}")
        return cfg


@dataclass(frozen=True)
class OptimizationSection:
    lr: float = 1e-4
    weight_decay: float = 0.1
    lr_schedule: str = "constant"
    warmup_steps: int = 0
    min_lr_ratio: float = 0.0
    lr_power: float = 1.0
    clip_grad: float = 0.0
    decay_steps: int | None = None         # the schedule's horizon; None: the run's steps
    adam_beta1: float = 0.9
    adam_beta2: float = 0.98
    adam_eps: float = 1e-8
    steps: int | None = None               # None: epochs worth
    epochs: int = 1
    seed: int = 1234                          # weights and dropout (the data order's seed is DataSection.seed)
    train: bool = True                        # False: only evaluate the loss

    def horizon(self, total_steps: int) -> int:
        """The step at which a decaying schedule reaches its end (--decay_steps, else the run's last step)."""
        return self.decay_steps or total_steps

    @property
    def betas(self) -> tuple[float, float]:
        return self.adam_beta1, self.adam_beta2

@dataclass(frozen=True)
class DataSection:
    file_path: str | None = None
    cache_dir: str | None = None           # the token stores (default: <TSV dir>/.tokcache)
    batch_size: int = 32                      # global, in pairs
    max_tokens: int = 0                       # > 0: token batches
    batch_multiple: int = 16
    pad_multiple: int = 8
    num_batch_buckets: int = 0
    seed: int = 1234
    # a table's pairs (not a TSV's): preprocess.corpus_source
    split: str | None = None               # None: train (--file_path), validation (--valid_file)
    valid_split: str | None = None
    src_field: str | None = None
    tgt_field: str | None = None
    src_lang: str | None = None
    tgt_lang: str | None = None
    dataset_config: str | None = None
    # batch_size against the layout: model.config.validate_layout (it names the sizes that would fit)

    def corpus(self, valid: bool = False) -> CorpusOptions:
        """How --file_path's (or with `valid` --valid_file's) pairs are taken from a table."""
        return CorpusOptions(split=self.valid_split if valid else self.split, src_field=self.src_field,
                             tgt_field=self.tgt_field, src_lang=self.src_lang, tgt_lang=self.tgt_lang,
                             config=self.dataset_config, default_split="validation" if valid else "train")

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
class CheckpointSection:
    output_dir: str = "out/train"
    save_checkpoint_steps: int = 0
    keep_checkpoint_max: int = 4
    resume: str | None = None              # None | "latest" | "auto" | PATH
    ckpt_file: str | None = None
    verify: bool = True                       # check a loaded checkpoint's files against their saved sha256
    save_mode: str = "background"             # "sync": every save stalls the step loop until committed
    train: bool = True                        # an evaluation-only run never writes checkpoints

    @property
    def will_touch_checkpoints(self) -> bool:
        return bool(self.save_checkpoint_steps or self.resume or self.ckpt_file)


@dataclass(frozen=True)
class ValidationSection:
    valid_file: str | None = None
    valid_interval: int = 0                   # 0: once per epoch
    valid_bleu: bool = False
    early_stop_patience: int = 0


@dataclass(frozen=True)
class FaultsSection:
    nan_policy: str = "stop"
    nan_skip_limit: int = 10
    comm_timeout: float = 1800.0
    save_on_signal: bool = True               # SIGTERM / SIGUSR1 / SIGHUP / the launcher's end: save, then stop


@dataclass(frozen=True)
class LoggingSection:
    log_interval: int = 1
    tensorboard: bool = True
    # experiment trackers (training/core/trackers.py): a W&B project, an MLflow experiment; the run name is both's
    wandb: str | None = None
    wandb_entity: str | None = None
    wandb_run_name: str | None = None
    mlflow: str | None = None

    def __post_init__(self):
        # a tracker's package is checked here, before any process group: one line naming the extra to install
        for package in ("wandb", "mlflow"):
            if getattr(self, package):
                require(package)


# flag dest → (section, field) where the two names differ
RENAMED = {"enable_parallel_optimizer": ("parallel", "optimizer_shard")}
# flags read by more than one section (each gets its own copy)
SHARED = {"seed": ("optimization", "data"), "train": ("optimization", "checkpoint")}
SECTIONS = {"model": ModelSection, "parallel": ParallelSection, "optimization": OptimizationSection,
            "data": DataSection, "checkpoint": CheckpointSection, "validation": ValidationSection,
            "faults": FaultsSection, "logging": LoggingSection}


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
    # the flags the user set (command line or recipe): {dest: where, e.g. "--lr" or "recipe R's lr"} — a run
    # that starts from a checkpoint takes the checkpoint's value for every other one (training.run.start_point)
    explicit: dict = field(default_factory=dict, compare=False)

    def __post_init__(self):
        """Checks across sections (each section checked itself when it was built)."""
        p = self.parallel
        if p.precision == "fp16" and p.pipeline_stage > 1 and self.model.share_embeddings:
            # DeepSpeed 0.19.8's PipelineEngine._exec_reduce_tied_grads sums the tied table's gradient from
            # `param.grad` (`_hp_grad` under BF16_Optimizer), but fp16 runs ZeRO-1 with fp32 gradient accumulation,
            # which keeps it in `param.grad_accum` and sets `param.grad = None`: the sum is skipped and stage 0's
            # table and the last stage's replica drift apart without an error
            raise UserError(f"--precision fp16 with --pipeline_stage {p.pipeline_stage} and --share_embeddings 1 "
                            f"would train the two copies of the shared table apart (DeepSpeed does not sum their "
                            f"gradients under its fp16 optimizer); use --precision bf16 or fp32, or "
                            f"--share_embeddings 0")

    @classmethod
    def from_flags(cls, args: argparse.Namespace) -> TrainConfig:
        """Every train.py flag lands in exactly one section (two in SHARED); a flag no section knows is a bug."""
        values = {name: {} for name in SECTIONS}
        owners = {f.name: name for name, kind in SECTIONS.items() for f in dataclasses.fields(kind)}
        for dest, value in vars(args).items():
            if dest in ("recipe", "local_rank", "explicit"):
                continue
            if dest in SHARED:
                for name in SHARED[dest]:
                    values[name][dest] = value
                continue
            section, name = RENAMED.get(dest, (owners.get(dest), dest))
            if section is None:
                continue                         # a caller's own extra flags (plan.py's --hostfile ...)
            values[section][name] = value
        return cls(**{name: SECTIONS[name](**kw) for name, kw in values.items()}, recipe=getattr(args, "recipe", None),
                   explicit=dict(getattr(args, "explicit", None) or {}))

    def to_flags(self) -> argparse.Namespace:
        """The flags that build this configuration again (from_flags' inverse)."""
        dest_of = {where: dest for dest, where in RENAMED.items()}
        flags = {"recipe": self.recipe, "explicit": dict(self.explicit)}
        for name, kind in SECTIONS.items():
            for f in dataclasses.fields(kind):
                flags.setdefault(dest_of.get((name, f.name), f.name), getattr(getattr(self, name), f.name))
        return argparse.Namespace(**flags)

    def with_flags(self, **changes) -> TrainConfig:
        """The same configuration with some flags changed, every section checked again."""
        flags = self.to_flags()
        for dest, value in changes.items():
            setattr(flags, dest, value)
        return TrainConfig.from_flags(flags)

    def to_dict(self) -> dict:
        """Every resolved setting, by section (run.json)."""
        settings = dataclasses.asdict(self)
        del settings["explicit"]
        return settings
