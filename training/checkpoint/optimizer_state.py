"""Where each parameter's fp32 master weight and AdamW moments live, under each optimizer DeepSpeed builds here, and
how to read and write them one parameter at a time (training.checkpoint.manager saves and loads through this).

    optimizer DeepSpeed builds       when (training.core.engine.optimizer_zero_stage)     master weight / moments
    torch AdamW (ClippingAdamW)      fp32 at ZeRO 0                                  the parameter / state[param]
    BF16_Optimizer                   bf16 at ZeRO 0/1, pipelined or not              flat fp32 partition per group
    DeepSpeedZeroOptimizer           ZeRO 1/2 in fp32, ZeRO 2 in bf16, fp16 ZeRO 1/2 flat fp32 partition per group
    DeepSpeedZeroOptimizer_Stage3    ZeRO 3                                          flat fp32 partition per sub-group

In every case the master weights and moments are fp32, so a checkpoint saved under one of them loads into any other
(another precision or ZeRO stage) without conversion. Any other optimizer — DeepSpeed's ZeRO-0 half-precision
wrappers FP16_UnfusedOptimizer / FP16_Optimizer, which train.py never asks for, or a class a newer DeepSpeed builds —
is refused with `UnsupportedOptimizer` before anything is written: a checkpoint never silently misses state.

The wrappers are read and written through DeepSpeed's public API (deepspeed.utils safe_get_full_fp32_param,
safe_get_full_optimizer_state, safe_set_full_fp32_param, safe_set_full_optimizer_state), which gathers/scatters
over the ZeRO partitions itself. What that API does not cover uses DeepSpeed internals, checked against DeepSpeed
0.19.8 (re-check them on upgrades; tests/test_checkpoint.py fails if one changes meaning):
  - the flat fp32 partitions each wrapper hands to AdamW — BF16_Optimizer.fp32_groups_flat_partition,
    DeepSpeedZeroOptimizer.single_partition_of_fp32_groups, DeepSpeedZeroOptimizer_Stage3.fp32_partitioned_groups_flat
    — to create AdamW's state before the first step (AdamW makes it lazily in step(); loading needs it earlier);
  - `_hp_optimizer_states_linked` / `_lazy_init_hp_params_optimizer_state()` (BF16_Optimizer, DeepSpeedZeroOptimizer):
    DeepSpeed links each parameter's fragment to that state only after the first step(); without the link the
    fragment API raises TypeError (the bf16 resume failure GPU_RESULTS.md records) or finds no state;
  - `update_lp_params()` (BF16_Optimizer, DeepSpeedZeroOptimizer; DeepSpeed's engine calls it after loading a
    universal checkpoint): copy the loaded master weights into the model's (bf16/fp16/fp32) weights;
  - ZeRO-3: `checkpoint_event_prologue()` / `checkpoint_event_epilogue()` (the engine brackets its own loads with
    them: partition every parameter, re-gather the persistent ones) and `_reassign_or_swap_out_partitioned_parameters
    (i)` over `fp16_partitioned_groups_flat` (what its step() does to copy the fp32 partitions into the model's);
  - `optimizer.loss_scaler` (cur_scale, cur_iter, last_overflow_iter, cur_hysteresis): fp16's dynamic loss scale.
"""

from __future__ import annotations

import torch

from common.errors import UserError
from training.core.grad_norm import ClippingAdamW

STATE_KEYS = ("exp_avg", "exp_avg_sq")
KEYS = ("param",) + STATE_KEYS
SCALER_FIELDS = ("cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis")


class UnsupportedOptimizer(UserError):
    pass


def local_shape(p) -> tuple:
    """This rank's (TP/PP-local) shape of a parameter; ZeRO-3 keeps only a flat partition in p itself."""
    return tuple(p.ds_shape if hasattr(p, "ds_shape") else p.shape)


def adam_step_tensor(step: int, param: torch.Tensor, group: dict) -> torch.Tensor:
    """AdamW's step counter as torch's own first step makes it: for the fused and capturable kernels a float32
    tensor on the parameter's device (the CUDA fused kernel refuses a CPU one: a resumed GPU run failed so), else a
    CPU scalar."""
    if group.get("fused") or group.get("capturable"):
        return torch.tensor(float(step), dtype=torch.float32, device=param.device)
    return torch.tensor(float(step), dtype=torch.float32)


def _groups_by_param(opt: torch.optim.Optimizer) -> dict:
    return {id(p): group for group in opt.param_groups for p in group["params"]}


class OptimizerState:
    """One optimizer's view: `get` / `set` a parameter's "param" (fp32 master), "exp_avg" or "exp_avg_sq" as a
    full (TP-local) fp32 tensor. `partitioned`: get/set are collectives over the data-parallel group (every DP rank
    calls them for the same parameters in the same order)."""

    partitioned = True
    kind = ""

    def __init__(self, engine):
        self.engine, self.opt = engine, engine.ds.optimizer

    def describe(self) -> dict:
        return {
            "class": type(self.opt).__name__,
            "kind": self.kind,
            "precision": self.engine.precision,
            "zero_stage": self.engine.zero_stage,
        }

    # subclasses
    def prepare(self) -> None:
        """Make the AdamW state exist (as AdamW's first step would create it) and be reachable per parameter."""

    def get(self, p, key: str) -> torch.Tensor:
        raise NotImplementedError

    def set(self, p, key: str, value: torch.Tensor) -> None:
        raise NotImplementedError

    def begin_load(self) -> None:
        pass

    def end_load(self) -> None:
        """After every `set`: make the model's weights the loaded master weights."""

    def _base(self) -> torch.optim.Optimizer:
        return self.opt.optimizer

    def step(self) -> int:
        for state in self._base().state.values():
            if "step" in state:
                return int(state["step"])
        return 0

    def set_step(self, step: int) -> None:
        base = self._base()
        group_of = _groups_by_param(base)
        for p, state in base.state.items():
            if "exp_avg" in state:
                state["step"] = adam_step_tensor(step, p, group_of.get(id(p), {}))

    def scaler_state(self) -> dict | None:
        scaler = getattr(self.opt, "loss_scaler", None)
        if scaler is None or not getattr(scaler, "dynamic", False):
            return None
        return {f: getattr(scaler, f) for f in SCALER_FIELDS}

    def load_scaler_state(self, saved: dict | None) -> None:
        scaler = getattr(self.opt, "loss_scaler", None)
        if saved and scaler is not None and getattr(scaler, "dynamic", False):
            for f in SCALER_FIELDS:
                setattr(scaler, f, saved[f])


class PlainAdamW(OptimizerState):
    """fp32 at ZeRO 0: DeepSpeed steps our AdamW unwrapped; the parameter is the master weight."""

    partitioned = False
    kind = "torch AdamW (ZeRO 0)"

    def _base(self):
        return self.opt

    def get(self, p, key):
        if key == "param":
            return p.detach()
        state = self.opt.state.get(p, {})
        # no state yet: AdamW creates zeros at the parameter's first gradient, so zeros are its exact state
        return state[key].detach() if key in state else torch.zeros(p.shape, dtype=torch.float32)

    def set(self, p, key, value):
        if key == "param":
            p.data.copy_(value)
        else:
            self.opt.state.setdefault(p, {})[key] = value.to(device=p.device, dtype=torch.float32).clone()


class _Wrapped(OptimizerState):
    """DeepSpeed's fp32-master wrappers: AdamW steps flat fp32 partitions, and each model parameter maps to its
    fragment of them (ZeRO-1/2, BF16_Optimizer: `_hp_mapping`; ZeRO-3: its partition of a sub-group)."""

    def _flat_partitions(self) -> list:
        raise NotImplementedError

    def prepare(self):
        base = self._base()
        group_of = _groups_by_param(base)
        for flat in self._flat_partitions():
            state = base.state[flat]
            if "exp_avg" not in state:  # what torch AdamW's first step creates
                state.update(
                    step=adam_step_tensor(0, flat, group_of.get(id(flat), {})),
                    exp_avg=torch.zeros_like(flat),
                    exp_avg_sq=torch.zeros_like(flat),
                )
        self._link()

    def _link(self):
        pass

    def get(self, p, key):
        from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

        value = safe_get_full_fp32_param(p) if key == "param" else safe_get_full_optimizer_state(p, key)
        if value is None:
            raise RuntimeError(
                f"DeepSpeed's {type(self.opt).__name__} has no {key} for a parameter of shape "
                f"{local_shape(p)}: its parameters are not linked to the optimizer state"
            )
        return value.detach().float().reshape(local_shape(p))

    def set(self, p, key, value):
        from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

        value = value.to(device=self.engine.device, dtype=torch.float32)
        if key == "param":
            safe_set_full_fp32_param(p, value)
        else:
            safe_set_full_optimizer_state(p, value, key)


class FragmentLinked(_Wrapped):
    """BF16_Optimizer and DeepSpeedZeroOptimizer (ZeRO 1/2)."""

    def __init__(self, engine, kind: str, flat_attr: str):
        super().__init__(engine)
        self.kind, self.flat_attr = kind, flat_attr

    def _flat_partitions(self):
        return list(getattr(self.opt, self.flat_attr))

    def _link(self):
        self.opt._hp_optimizer_states_linked = False
        self.opt._lazy_init_hp_params_optimizer_state()

    def end_load(self):
        self.opt.update_lp_params()  # fp32 partitions → model weights, all-gathered over DP


class ZeroStage3(_Wrapped):
    kind = "DeepSpeedZeroOptimizer_Stage3 (ZeRO 3)"

    def _flat_partitions(self):
        return list(self.opt.fp32_partitioned_groups_flat)

    def begin_load(self):
        self.opt.checkpoint_event_prologue()

    def end_load(self):
        for i in range(len(self.opt.fp16_partitioned_groups_flat)):
            self.opt._reassign_or_swap_out_partitioned_parameters(i)
        self.opt.checkpoint_event_epilogue()


SUPPORTED = "torch AdamW at ZeRO 0, BF16_Optimizer, DeepSpeedZeroOptimizer (ZeRO 1/2), DeepSpeedZeroOptimizer_Stage3"


def for_engine(engine) -> OptimizerState:
    """The view of the optimizer DeepSpeed built, or UnsupportedOptimizer naming it."""
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    opt = engine.ds.optimizer
    cls = type(opt)
    if cls in (torch.optim.AdamW, ClippingAdamW):
        return PlainAdamW(engine)
    wrappers = {
        BF16_Optimizer: lambda: FragmentLinked(engine, "BF16_Optimizer", "fp32_groups_flat_partition"),
        DeepSpeedZeroOptimizer: lambda: FragmentLinked(
            engine, "DeepSpeedZeroOptimizer (ZeRO 1/2)", "single_partition_of_fp32_groups"
        ),
        DeepSpeedZeroOptimizer_Stage3: lambda: ZeroStage3(engine),
    }
    if cls in wrappers:
        base = type(getattr(opt, "optimizer", None))
        if base in (torch.optim.AdamW, ClippingAdamW):
            return wrappers[cls]()
        raise UnsupportedOptimizer(
            f"checkpoints need AdamW inside DeepSpeed's {cls.__name__}, but it wraps "
            f"{base.__name__}; do not set an optimizer in --deepspeed_config"
        )
    hint = ""
    if cls.__name__ in ("FP16_UnfusedOptimizer", "FP16_Optimizer"):
        hint = (
            " DeepSpeed builds it for fp16/bf16 without ZeRO, which train.py never asks for: a --deepspeed_config "
            "that turns on fp16 or bf16 does; choose the precision with --precision instead."
        )
    raise UnsupportedOptimizer(
        f"cannot checkpoint DeepSpeed's {cls.__module__}.{cls.__name__}: the checkpoint code "
        f"knows where master weights and AdamW moments live only for {SUPPORTED}.{hint}"
    )
