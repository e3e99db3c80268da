"""The operator graph of a network built from `demos.strategy.ops`, traced with torch.fx, with every shape.

Inputs (placeholders) are the dataset's tensors, parameters (get_attr) the weights, and every other node must be a
strategy operator (a `Primitive` leaf module): those are what strategies, propagation and the dumps talk about.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx
from torch import nn

from demos.strategy.layout import StrategyError
from demos.strategy.ops import Primitive


@dataclass
class OpNode:
    name: str  # module path, e.g. "_backbone.matmul" (the seed's instance name is the last part)
    prim: Primitive
    inputs: list[str]  # names of the values it reads (graph inputs, parameters or other ops)
    in_shapes: list[tuple[int, ...]]
    out_shape: tuple[int, ...]
    in_letters: tuple[str, ...]
    out_letters: str

    @property
    def kind(self) -> str:
        return type(self.prim).__name__

    @property
    def instance(self) -> str:
        return self.name.rsplit(".", 1)[-1]


@dataclass
class OpGraph:
    inputs: dict[str, tuple[int, ...]]  # graph input name → global shape
    params: dict[str, tuple[int, ...]]  # parameter path → shape
    ops: list[OpNode]  # in execution order
    output: str  # the op whose result the network returns

    def op(self, name: str) -> OpNode:
        return next(o for o in self.ops if o.name == name)

    def consumers(self, value: str) -> list[tuple[OpNode, int]]:
        return [(o, i) for o in self.ops for i, v in enumerate(o.inputs) if v == value]


class _Tracer(torch.fx.Tracer):
    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return isinstance(m, Primitive) or super().is_leaf_module(m, qualname)


def trace(module: nn.Module, example_inputs: dict[str, torch.Tensor]) -> OpGraph:
    """Trace `module(**example_inputs)` (global shapes) into an OpGraph."""
    graph = _Tracer().trace(module)
    gm = torch.fx.GraphModule(module, graph)
    from torch.fx.passes.shape_prop import ShapeProp

    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    missing = [n.target for n in placeholders if n.target not in example_inputs]
    if missing:
        raise StrategyError(f"no example input for {missing}: give one global-shaped tensor per network input")
    ShapeProp(gm).propagate(*[example_inputs[n.target] for n in placeholders])

    inputs, params, ops, value_of = {}, {}, [], {}
    output = None
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            inputs[node.target] = tuple(node.meta["tensor_meta"].shape)
            value_of[node.name] = node.target
        elif node.op == "get_attr":
            params[node.target] = tuple(node.meta["tensor_meta"].shape)
            value_of[node.name] = node.target
        elif node.op == "call_module" and isinstance(gm.get_submodule(node.target), Primitive):
            prim = gm.get_submodule(node.target)
            args = [value_of[a.name] for a in node.args]
            shapes = [tuple(a.meta["tensor_meta"].shape) for a in node.args]
            in_letters, out_letters = prim.signature(shapes)
            ops.append(
                OpNode(node.target, prim, args, shapes, tuple(node.meta["tensor_meta"].shape), in_letters, out_letters)
            )
            value_of[node.name] = node.target
        elif node.op == "output":
            output = value_of[node.args[0].name]
        else:
            raise StrategyError(
                f"{node.op} {node.target} in the traced network is not a strategy operator: build "
                f"the network from demos.strategy.ops (MatMul, ReLU, Sub, Square, ReduceMean, ...)"
            )
    return OpGraph(inputs, params, ops, output)
