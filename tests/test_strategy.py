"""Op-level strategies (demos/strategy/): the seed's ((2, 4), (4, 1)) as DTensor placements, the propagation giving
the seed's ReLU ((2, 4),) and MatMul ((2, 4), (4, 1)), bad strategies as one error naming op, strategy and shapes,
and the seed's network simulated in one process at 8 and 64 ranks: the serial loss at every step, the seed's
per-rank shapes, the collectives counted. The runs in real processes are in tests/test_sharded_mlp.py."""

import sys

import pytest
import torch
from torch import nn

from demos.sharded_mlp.network import network_with_loss
from demos.sharded_mlp.train import MLPConfig, build, run_simulated, train_serial
from demos.strategy.graph import trace
from demos.strategy.layout import StrategyError
from demos.strategy.ops import MatMul, ReduceMean, ReLU, Sub, shard
from demos.strategy.propagate import layouts_for, propagate, redistribution_cost
from tests.launch import env, run_python

SEED_IR_RANK0 = {  # the seed's 18_execute IR on rank 0: inputs → output of each op, local shapes
    "_backbone.matmul": ([(8, 8), (8, 16)], (8, 16)),
    "_backbone.relu": ([(8, 4)], (8, 4)),
    "_backbone.matmul2": ([(8, 4), (4, 16)], (8, 16)),
}


def seed_plan(mesh=(2, 4), strategy=((2, 4), (4, 1)), batch=16):
    net = network_with_loss(strategy=strategy)
    return propagate(trace(net, {"data": torch.zeros(batch, 32), "label": torch.zeros(batch, 16)}), mesh)


def names(layouts):
    return [lay.describe() for lay in layouts]


def test_seed_strategy_is_shard_shard_then_partial_over_mesh_dim_1():
    p = seed_plan().ops["_backbone.matmul"]
    assert names(p.in_layouts) == ["(S(0), S(1))", "(R, S(0))"]  # x rows / mesh 0, x cols & w rows / mesh 1
    assert p.out_layout.describe() == "(S(0), P)" and p.reduction_dims == (1,)  # contracted k: partial sums
    assert [lay.local_shape for lay in p.in_layouts] == [(8, 8), (8, 16)]
    assert p.out_layout.reduced().describe() == "(S(0), R)"


def test_propagation_gives_the_seeds_strategies():
    plan = seed_plan()
    got = {name: (p.strategy, p.source) for name, p in plan.ops.items()}
    assert got["_backbone.matmul"] == (((2, 4), (4, 1)), "shard()")
    assert got["_backbone.relu"][0] == ((2, 4),) and got["_backbone.relu"][1].startswith("propagated")
    assert got["_backbone.matmul2"][0] == ((2, 4), (4, 1))
    assert got["_loss_fn.reduce_mean"][0] == ((2, 4),)


def test_propagation_prefers_no_communication_then_least_slicing():
    """ReLU after the MatMul: (2, 4) and (8, 1) both only slice the (8, 16) block each rank holds; (8, 1) splits
    rows over both mesh dims (MindSpore charges that reshape); (4, 2) and (1, 8) need other ranks' rows."""
    plan = seed_plan()
    src = plan.value_layout("_backbone.matmul")
    relu = plan.ops["_backbone.relu"].op
    cost = {
        s: redistribution_cost(src, layouts_for(relu, ((s[0], s[1]),), (2, 4))[0][0])
        for s in [(2, 4), (8, 1), (4, 2), (1, 8)]
    }
    assert cost[(2, 4)] == (0, 128) and cost[(8, 1)] == (0, 384)
    assert cost[(4, 2)][0] > 0 and cost[(1, 8)][0] > 0


def test_propagation_at_64_ranks():
    plan = seed_plan(mesh=(8, 8), strategy=((8, 8), (8, 1)), batch=128)
    assert plan.ops["_backbone.relu"].strategy == ((8, 8),)
    assert plan.ops["_backbone.matmul2"].strategy == ((8, 8), (8, 1))
    assert [lay.local_shape for lay in plan.ops["_backbone.matmul"].in_layouts] == [(16, 4), (4, 16)]


class _SharedWeight(nn.Module):
    """Two MatMuls reading one weight, with strategies that split it differently."""

    def __init__(self, first, second):
        super().__init__()
        self.w = nn.Parameter(torch.zeros(32, 16))
        self.mm_a, self.mm_b, self.sub, self.mean = shard(MatMul(), first), shard(MatMul(), second), Sub(), ReduceMean()

    def forward(self, data, label):
        return self.mean(self.sub(self.mm_a(data, self.w), self.mm_b(label, self.w)))


@pytest.mark.parametrize(
    "strategy,needles",
    [
        (
            ((4, 4), (4, 1)),
            ["strategy ((4, 4), (4, 1))", "(16, 32), (32, 16)", "splits over 16 devices", "mesh (2, 4) has 8"],
        ),
        (((2, 3), (3, 1)), ["split 3 does not divide dimension 1 (size 32) of input 0"]),
        (((2, 4), (2, 1)), ["strategy ((2, 4), (2, 1))", "split a shared dimension differently (4 and 2"]),
        (((2, 2), (2, 2)), ["splits [2, 2, 2] cannot each take whole dimensions of the mesh (2, 4)"]),
        (((2, 4),), ["give one split per dimension of each of its 2 input(s)"]),
    ],
)
def test_bad_strategy_names_op_strategy_and_shapes(strategy, needles):
    with pytest.raises(StrategyError) as err:
        seed_plan(strategy=strategy)
    msg = str(err.value)
    assert "_backbone.matmul (MatMul)" in msg and "\n" not in msg
    for needle in needles:
        assert needle in msg, msg


def test_strategy_conflicting_with_a_neighbours_fixed_one():
    net = _SharedWeight(((2, 4), (4, 1)), ((4, 2), (2, 1)))
    with pytest.raises(StrategyError) as err:
        propagate(trace(net, {"data": torch.zeros(16, 32), "label": torch.zeros(16, 32)}), (2, 4))
    msg = str(err.value)
    for needle in (
        "mm_b (MatMul) strategy ((4, 2), (2, 1)) for inputs of shape (16, 32), (32, 16)",
        "conflicts with mm_a (MatMul) strategy ((2, 4), (4, 1))",
        "parameter w of shape (32, 16)",
    ):
        assert needle in msg, msg
    # the same weight split alike is fine, and an unconfigured reader follows it
    plan = propagate(
        trace(
            _SharedWeight(((2, 4), (4, 1)), ((2, 4), (4, 1))),
            {"data": torch.zeros(16, 32), "label": torch.zeros(16, 32)},
        ),
        (2, 4),
    )
    assert plan.params["w"].splits == (4, 1)


def test_network_must_be_made_of_strategy_operators():
    class Plain(nn.Module):
        def __init__(self):
            super().__init__()
            self.mm = MatMul()
            self.w = nn.Parameter(torch.zeros(32, 16))

        def forward(self, data):
            return torch.tanh(self.mm(data, self.w))

    with pytest.raises(StrategyError, match="call_function .*tanh.* is not a strategy operator"):
        trace(Plain(), {"data": torch.zeros(16, 32)})


def test_malformed_strategy_is_named():
    with pytest.raises(StrategyError, match=r"ReLU.shard\(\(2, 4\)\): a strategy is one tuple per input"):
        ReLU().shard((2, 4))


def test_bad_strategy_is_one_error_line_from_the_cli(assert_user_error):
    proc = run_python(
        [sys.executable, "run_scripts/sharded_mlp.py", "--check", "--strategy", "((4, 4), (4, 1))"],
        env=env(),
        timeout=120,
    )
    assert_user_error(proc, "_backbone.matmul (MatMul) strategy ((4, 4), (4, 1))", "(16, 32), (32, 16)")


def _simulate(cfg):
    lines = []
    result = run_simulated(cfg, None, log=lines.append)
    serial = train_serial(cfg)
    worst = max(abs(a - b) / abs(b) for a, b in zip(result.losses, serial))
    return result, serial, worst, lines


def test_simulated_8_ranks_match_serial_and_the_seeds_shapes():
    cfg = MLPConfig()
    result, serial, worst, lines = _simulate(cfg)
    print(f"STRATEGY sim 8 ranks: max relative loss difference {worst:.2e} over {len(serial)} steps")
    assert len(result.losses) == 20 and worst <= 1e-6
    assert serial[-1] < serial[0] - 0.1  # it learns, as the seed's log shows
    loss_lines = [line for line in lines if line.startswith("epoch: ")]
    assert loss_lines[9] == f"epoch: 3 step: 2, loss is {result.losses[9]}"  # the seed's line
    recs = {r.name: r for r in result.runner.records}
    for name, (ins, out) in SEED_IR_RANK0.items():
        assert ([i.after for i in recs[name].inputs], recs[name].out_shape) == (ins, out), name
    mm = recs["_backbone.matmul"]
    assert mm.reduction == {"all_reduce": 1}  # AllReduce over ranks 0-3
    assert mm.inputs[0].collectives == {"all_to_all": 1}  # data (2, 32) → (8, 8)
    relu_in = recs["_backbone.relu"].inputs[0]
    assert (relu_in.before, relu_in.after, relu_in.collectives) == ((8, 16), (8, 4), {})  # StridedSlice
    assert result.backward == {"all_gather": 2, "all_reduce": 2}
    text = "\n".join(lines)
    assert "AllReduce (8, 16) over ranks [0-3]  all_reduce ×1" in text
    assert "%relu = ReLU(%matmul) {instance name: relu} {in_strategy: ((2, 4),)}" in text


def test_simulated_64_ranks_plan_a_bigger_mesh():
    cfg = MLPConfig(mesh=(8, 8), strategy=((8, 8), (8, 1)), epochs=1)
    result, serial, worst, _ = _simulate(cfg)
    print(f"STRATEGY sim 64 ranks: max relative loss difference {worst:.2e} over {len(serial)} steps")
    assert worst <= 1e-6
    recs = {r.name: r for r in result.runner.records}
    assert [i.after for i in recs["_backbone.matmul"].inputs] == [(16, 4), (4, 16)]
    assert recs["_backbone.relu"].out_shape == (16, 2)


def test_dtensors_own_rule_would_choose_differently():
    """Left to DTensor, ReLU on the MatMul's partial sums reduce-scatters them into rows over all 8 ranks —
    strategy (8, 1), not the seed's (2, 4) — and the second MatMul then runs data-parallel on a replicated
    weight; hence our own propagation."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.debug import CommDebugMode

    from demos.strategy.execute import counted, make_mesh
    from demos.strategy.simulation import simulated_world

    cfg = MLPConfig()
    module, plan = build(cfg)
    p = plan.ops["_backbone.matmul"]
    x, w, w2 = torch.rand(16, 32), module._backbone.weight.detach(), module._backbone.weight2.detach()
    with simulated_world(8):
        mesh = make_mesh(cfg.mesh)
        out = torch.matmul(
            distribute_tensor(x, mesh, p.in_layouts[0].placements(), src_data_rank=None),
            distribute_tensor(w, mesh, p.in_layouts[1].placements(), src_data_rank=None),
        )
        with CommDebugMode() as comm:
            relu = torch.relu(out)
        assert list(relu.placements) == [Shard(0), Shard(0)] and counted(comm) == {"reduce_scatter": 1}
        out2 = torch.matmul(relu, distribute_tensor(w2, mesh, [Replicate(), Replicate()], src_data_rank=None))
        assert list(out2.placements) == [Shard(0), Shard(0)]
