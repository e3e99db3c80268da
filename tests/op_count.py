"""Counting the aten ops a piece of code runs (torch's dispatch mode), for tests of what a GPU would pay for: host
synchronisations such as nonzero(), per-tensor kernels a fused one should replace, copies."""

from torch.utils._python_dispatch import TorchDispatchMode


class OpCounter(TorchDispatchMode):
    """Counts the aten ops run under it, by name without overload ('mul_', '_foreach_mul_', 'clone', ...)."""

    def __init__(self):
        super().__init__()
        self.counts: dict = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        self.counts[name] = self.counts.get(name, 0) + 1
        return func(*args, **(kwargs or {}))

    def of(self, *names: str) -> int:
        return sum(self.counts.get(n, 0) for n in names)
