"""The values of a recipe's "deepspeed" section or a --deepspeed_config file, checked when the flags are parsed.

DeepSpeed reads most top-level keys as plain values and compares them much later (`"gradient_clipping": "1"`
ends in `TypeError: '>' not supported` after the model is built), and its pydantic sections coerce what they can
(`"enabled": "yes"` is true). Here, before any work, every value must have the JSON type DeepSpeed means:

- top-level keys DeepSpeed reads as numbers, integers, booleans or strings (`SCALARS`, from
  deepspeed/runtime/config.py's get_scalar_param calls in DeepSpeed 0.19.8), and sections that must be objects;
- the fields of the sections DeepSpeed describes with pydantic models (zero_optimization, fp16, bf16), by their
  annotations — a boolean is true/false, an integer is an integer (5e8 is fine), an enum one of its values — and
  then the model itself, which also refuses keys it does not know;
- `fp16.enabled` / `bf16.enabled` must agree with --precision: the engine, the plan and the metrics are built for
  the precision the flags name;
- `communication_data_type`, if given, must be "fp32": gradients are averaged over the data-parallel ranks in fp32
  under every precision (training.core.engine.GRAD_REDUCE_DTYPE), which the parity tests, plan.py's figures and
  run.json's grad_reduce_dtype rely on; a bf16 average over 8 dp ranks is off by about 4e-3 relative.

Keys starting with "_" are comments, as elsewhere in recipes.
"""

from __future__ import annotations

import enum
import json
import types
import typing

from common.errors import UserError

NUMBER, INTEGER, BOOLEAN, STRING, OBJECT = "a number", "an integer", "true or false", "a string", "a JSON object"
SCALARS = {
    "train_batch_size": INTEGER,
    "train_micro_batch_size_per_gpu": INTEGER,
    "gradient_accumulation_steps": INTEGER,
    "steps_per_print": INTEGER,
    "gradient_clipping": NUMBER,
    "gradient_predivide_factor": NUMBER,
    "prescale_gradients": BOOLEAN,
    "sparse_gradients": BOOLEAN,
    "wall_clock_breakdown": BOOLEAN,
    "memory_breakdown": BOOLEAN,
    "dump_state": BOOLEAN,
    "zero_allow_untested_optimizer": BOOLEAN,
    "zero_force_ds_cpu_optimizer": BOOLEAN,
    "disable_allgather": BOOLEAN,
    "dataloader_drop_last": BOOLEAN,
    "communication_data_type": STRING,
    "seq_parallel_communication_data_type": STRING,
}
OBJECTS = (
    "zero_optimization",
    "fp16",
    "bf16",
    "pipeline",
    "data_types",
    "optimizer",
    "scheduler",
    "activation_checkpointing",
    "flops_profiler",
    "tensorboard",
    "wandb",
    "csv_monitor",
    "comms_logger",
    "aio",
    "autotuning",
    "compression_training",
    "checkpoint",
    "elasticity",
)


def _model(section: str):
    if section == "zero_optimization":
        from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

        return DeepSpeedZeroConfig
    if section in ("fp16", "bf16"):
        from deepspeed.runtime.precision_config import DeepSpeedBF16Config, DeepSpeedFP16Config

        return DeepSpeedFP16Config if section == "fp16" else DeepSpeedBF16Config
    return None


def _kind_ok(value, kind: str) -> bool:
    if kind == BOOLEAN:
        return isinstance(value, bool)
    if kind == INTEGER:
        return not isinstance(value, bool) and (
            isinstance(value, int) or (isinstance(value, float) and value.is_integer())
        )
    if kind == NUMBER:
        return not isinstance(value, bool) and isinstance(value, (int, float))
    if kind == STRING:
        return isinstance(value, str)
    return isinstance(value, dict)


def _expected(annotation) -> tuple[str | None, bool, object]:
    """(kind, null allowed, nested model or enum) for a pydantic field annotation; kind None = not checked here."""
    nullable = False
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        nullable = len(args) < len(typing.get_args(annotation))
        if len(args) != 1:
            return None, nullable, None
        annotation = args[0]
    if annotation is bool:
        return BOOLEAN, nullable, None
    if annotation is int:
        return INTEGER, nullable, None
    if annotation is float:
        return NUMBER, nullable, None
    if annotation is str:
        return STRING, nullable, None
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return "enum", nullable, annotation
    if isinstance(annotation, type) and hasattr(annotation, "model_fields"):
        return OBJECT, nullable, annotation
    return None, nullable, None


def _bad(where: str, path: str, value, want: str) -> UserError:
    return UserError(f"{where}: {path} is {json.dumps(value)}; DeepSpeed expects {want}")


def _check_fields(model, values: dict, where: str, path: str) -> None:
    fields = model.model_fields
    for key, value in values.items():
        if key.startswith("_"):
            continue
        field = fields.get(key) or next((f for f in fields.values() if f.alias == key), None)
        if field is None:
            continue  # the model below names unknown keys
        kind, nullable, sub = _expected(field.annotation)
        if kind is None or (value is None and nullable):
            continue
        if kind == "enum":
            allowed = [m.value for m in sub]
            if value not in allowed:
                raise _bad(where, f"{path}.{key}", value, f"one of {json.dumps(allowed)}")
        elif not _kind_ok(value, kind):
            raise _bad(where, f"{path}.{key}", value, kind)
        elif kind == OBJECT:
            _check_fields(sub, value, where, f"{path}.{key}")


def strip_comments(values):
    if isinstance(values, dict):
        return {k: strip_comments(v) for k, v in values.items() if not k.startswith("_")}
    return values


def check_communication_dtype(values: dict, where: str) -> None:
    """Refuse a gradient-reduction dtype other than fp32 (module docstring). null is refused too: DeepSpeed would
    then reduce in the training precision."""
    if "communication_data_type" in values and str(values["communication_data_type"]).lower() != "fp32":
        raise UserError(
            f"{where}: communication_data_type is {json.dumps(values['communication_data_type'])}, but "
            f"gradients are averaged over the data-parallel ranks in fp32 under every --precision here "
            f'(a bf16 average is off by about 4e-3 relative at dp 8); remove the key or set it to "fp32"'
        )


def check_deepspeed_config(values: dict, where: str, precision: str) -> None:
    """UserError naming the first value DeepSpeed would misread (see the module docstring)."""
    if not isinstance(values, dict):
        raise UserError(f"{where} must be a JSON object of DeepSpeed settings")
    check_communication_dtype(values, where)
    for key, value in values.items():
        if key.startswith("_"):
            continue
        if key in SCALARS and not (value is None and SCALARS[key] == STRING) and not _kind_ok(value, SCALARS[key]):
            raise _bad(where, key, value, SCALARS[key])
        if key in OBJECTS and not isinstance(value, dict):
            raise _bad(where, key, value, OBJECT)
        model = _model(key)
        if model is None:
            continue
        _check_fields(model, value, where, key)
        import pydantic

        try:
            model(**strip_comments(value))
        except pydantic.ValidationError as exc:
            err = exc.errors()[0]
            field = ".".join(str(p) for p in (key, *err["loc"]))
            if err["type"] == "extra_forbidden":
                raise UserError(f"{where}: {field} is not a DeepSpeed setting (a typo?)") from None
            raise UserError(f"{where}: {field} is {json.dumps(err.get('input'), default=str)}: {err['msg']}") from None
        if key in ("fp16", "bf16") and "enabled" in value and value["enabled"] != (precision == key):
            raise UserError(
                f"{where}: {key}.enabled is {json.dumps(value['enabled'])} but --precision is "
                f"{precision}; choose the precision with --precision (or the recipe's "
                f"training.precision), not in the DeepSpeed config"
            )
