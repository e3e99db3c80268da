"""Fail any torch.distributed collective that is handed a host tensor — on a machine whose engine device IS the host.

nccl only takes device tensors, so a loss statistic kept on the host breaks every GPU run at its first collective,
while gloo on a CPU machine accepts it silently. To catch that here, `HostTensorChecker` makes the engine's device
distinguishable from the host by provenance: a `TorchFunctionMode` marks every tensor that is *made on the host* —

    factories without a device (torch.zeros(...), torch.tensor(...), torch.from_numpy(...)), and `.cpu()`

— and carries the mark through every op that reads a marked tensor (x.double(), x / n, torch.stack([...]), ...).
In-place ops keep their target's mark, and only an explicit move to the engine's device (`.to(device)`, a factory
with `device=` the engine's device) produces an unmarked tensor: exactly the ways code gets a tensor onto a GPU.
Every torch.distributed collective (DeepSpeed's comm layer calls the same functions) then checks its tensors and
raises `HostTensorInCollective` naming the collective, the tensor and the caller.

    checker = HostTensorChecker().install()      # before deepspeed.init_distributed (its backend caches functions)
    ...train...
    checker.uninstall(); print(checker.checked)
"""

from __future__ import annotations

import contextlib
import traceback

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

MARK = "_dsr_made_on_host"
COLLECTIVES = (
    "all_reduce",
    "all_reduce_coalesced",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "broadcast",
    "reduce",
    "send",
    "recv",
    "isend",
    "irecv",
    "all_to_all",
    "all_to_all_single",
    "gather",
    "scatter",
    "batch_isend_irecv",
)
FACTORIES = {
    torch.tensor,
    torch.as_tensor,
    torch.from_numpy,
    torch.zeros,
    torch.ones,
    torch.empty,
    torch.full,
    torch.arange,
    torch.linspace,
    torch.eye,
    torch.rand,
    torch.randn,
    torch.randint,
    torch.randperm,
    torch.empty_strided,
    torch.scalar_tensor,
}


class HostTensorInCollective(RuntimeError):
    pass


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from _tensors(item)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from _tensors(item)
    elif hasattr(obj, "tensor") and isinstance(obj.tensor, torch.Tensor):  # dist.P2POp
        yield obj.tensor


def is_marked(t: torch.Tensor) -> bool:
    return getattr(t, MARK, False)


def _set_mark(obj, value: bool) -> None:
    for t in _tensors(obj):
        with contextlib.suppress(AttributeError, RuntimeError):  # e.g. tensors that do not take Python attributes
            setattr(t, MARK, value)


class HostTensorChecker(TorchFunctionMode):
    def __init__(self, engine_device=None):
        super().__init__()
        if engine_device is None:
            from deepspeed.accelerator import get_accelerator

            engine_device = get_accelerator().current_device_name()
        self.engine_device = torch.device(engine_device)
        self.checked = 0
        self._originals = {}

    # ---------------------------------------------------------------------------------------------- marking
    def _on_engine(self, device) -> bool:
        device = torch.device(device)
        return device.type == self.engine_device.type and device.index in (None, self.engine_device.index, 0)

    def _explicit_device(self, func, args, kwargs):
        """The device a call explicitly asks for, or None."""
        if "device" in kwargs and kwargs["device"] is not None:
            return kwargs["device"]
        if func in (torch.Tensor.to,) and len(args) > 1:
            target = args[1]
            if isinstance(target, (str, torch.device)):
                return target
            if isinstance(target, torch.Tensor):
                return target.device
        return None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        device = self._explicit_device(func, args, kwargs)
        if func is torch.Tensor.cpu:
            _set_mark(out, True)
        elif device is not None or func is torch.Tensor.cuda:
            _set_mark(out, not (func is torch.Tensor.cuda or self._on_engine(device)))
        elif func in FACTORIES:
            _set_mark(out, True)
        elif (
            name.endswith("_")
            and not name.endswith("__")
            or name in ("__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__")
        ):
            pass  # in place: the target keeps its mark
        elif any(is_marked(t) for t in _tensors((args, kwargs))):
            _set_mark(out, True)
        return out

    # ---------------------------------------------------------------------------------------------- checking
    def _wrap(self, name, original):
        def checked(*args, **kwargs):
            for t in _tensors((args, kwargs)):
                if is_marked(t):
                    caller = "".join(traceback.format_stack(limit=6)[:-1])
                    raise HostTensorInCollective(
                        f"torch.distributed.{name} was given a host tensor (shape {tuple(t.shape)}, {t.dtype}); "
                        f"nccl accepts only tensors on the engine's device {self.engine_device}. Called from:\n"
                        f"{caller}"
                    )
            self.checked += 1
            return original(*args, **kwargs)

        checked.__name__ = name
        return checked

    def install(self) -> HostTensorChecker:
        for name in COLLECTIVES:
            original = getattr(dist, name, None)
            if original is not None:
                self._originals[name] = original
                setattr(dist, name, self._wrap(name, original))
        self.__enter__()
        return self

    def uninstall(self) -> None:
        self.__exit__(None, None, None)
        for name, original in self._originals.items():
            setattr(dist, name, original)
        self._originals.clear()
