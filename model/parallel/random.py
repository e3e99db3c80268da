"""Randomness that keeps every layout equal to the serial model: weight init, dropout streams, recompute.

* Weights: each block draws its parameters from its own generator seeded by (seed, block index), at full (serial)
  size, and a TP rank keeps its slice. So for a given seed every layout starts from the serial model's weights,
  whatever the TP size or the stage a block lands on.
* Dropout: activations that are replicated over TP ranks (residual stream, embeddings) use the default generator,
  seeded identically on all TP ranks of a stage; activations sharded over TP (attention probabilities of this rank's
  heads) use a per-TP-rank stream entered with `RNG.fork()`. TP training with dropout is then distributed like the
  serial model's.
* Recompute: `checkpoint` saves the default generators *and* the TP stream before the forward, and replays them for
  the recomputation, so activation checkpointing reproduces the very same dropout masks.
"""

from __future__ import annotations

import hashlib
from contextlib import contextmanager

import torch

TP_STREAM_OFFSET = 2718


def block_generator(seed: int, block_key: str) -> torch.Generator:
    """The generator that initializes block `block_key`'s weights ("embed", "enc0", "dec1", "head"),
    independent of layout."""
    digest = hashlib.sha256(f"{seed}:{block_key}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))


def _device_states():
    states = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state()
    return states


def _set_device_states(states) -> None:
    torch.set_rng_state(states["cpu"])
    if "cuda" in states:
        torch.cuda.set_rng_state(states["cuda"])


class RNGStreams:
    """A named extra stream (the per-TP-rank one) that can be swapped in place of the default generators."""

    def __init__(self):
        self._tp_states = None

    def seed(self, seed: int, tp_rank: int = 0, pp_rank: int = 0) -> None:
        """Default generators: same on every TP rank of a stage. TP stream: distinct per TP rank."""
        torch.manual_seed(seed + 1000 * pp_rank)
        saved = _device_states()
        torch.manual_seed(seed + TP_STREAM_OFFSET + 100 * tp_rank + 1000 * pp_rank)
        self._tp_states = _device_states()
        _set_device_states(saved)

    @contextmanager
    def fork(self):
        if self._tp_states is None:
            self.seed(0)
        outer = _device_states()
        _set_device_states(self._tp_states)
        try:
            yield
        finally:
            self._tp_states = _device_states()
            _set_device_states(outer)

    def get_state(self):
        return {"default": _device_states(), "tp": self._tp_states}

    def set_state(self, state) -> None:
        _set_device_states(state["default"])
        self._tp_states = state["tp"]


RNG = RNGStreams()


def _differentiable(value) -> bool:
    return torch.is_tensor(value) and value.is_floating_point()


_FROM_AUTOGRAD = object()  # marks an output position that `_Checkpoint.apply` returns


class _Checkpoint(torch.autograd.Function):
    """Run `fn` without keeping activations; in backward, replay the RNG states and recompute with grad.

    Only floating-point tensors go through autograd: the token ids (and any other argument) are kept and passed to
    the recomputation as they are, and the ids `fn` hands on are returned as they are (`checkpoint` splices them
    back in). An integer tensor returned through an autograd Function comes out as a new view of itself, and a
    saved one as a new tensor, either without what `model.packing` keeps on the ids: the next layer, and the
    recomputation, would find the non-PAD tokens again (a nonzero, a host synchronisation per layer)."""

    @staticmethod
    def forward(ctx, fn, layout, *args):
        ctx.fn = fn
        ctx.rng = RNG.get_state()
        ctx.save_for_backward(*[a if _differentiable(a) else None for a in args])
        ctx.kept = [None if _differentiable(a) else a for a in args]
        with torch.no_grad():
            out = fn(*args)
        outs = out if isinstance(out, tuple) else (out,)
        layout.append((isinstance(out, tuple), [_FROM_AUTOGRAD if _differentiable(o) else o for o in outs]))
        return tuple(o for o in outs if _differentiable(o))

    @staticmethod
    def backward(ctx, *grads):
        inputs = []
        for t, kept in zip(ctx.saved_tensors, ctx.kept):
            if t is None:
                inputs.append(kept)
            else:
                x = t.detach()
                x.requires_grad_(t.requires_grad)
                inputs.append(x)
        now = RNG.get_state()
        RNG.set_state(ctx.rng)
        try:
            with torch.enable_grad():
                out = ctx.fn(*inputs)
        finally:
            RNG.set_state(now)
        outs = [o for o in (out if isinstance(out, tuple) else (out,)) if _differentiable(o)]
        pairs = [(o, g) for o, g in zip(outs, grads) if o.requires_grad and g is not None]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        return (None, None) + tuple(x.grad if _differentiable(x) and x.requires_grad else None for x in inputs)


def checkpoint(fn, *args):
    """Activation checkpointing that is exact under TP and dropout (see module docstring). `fn`'s non-float
    outputs (the token ids it hands on) come back as the very objects `fn` returned."""
    layout: list = []
    floats = iter(_Checkpoint.apply(fn, layout, *args))
    is_tuple, outs = layout[0]
    out = tuple(next(floats) if o is _FROM_AUTOGRAD else o for o in outs)
    return out if is_tuple else out[0]
