"""Each TP layer and the parallel loss against its serial reference, on real gloo processes (tp = 2 and 4)."""

import pytest
import torch
import torch.nn.functional as F

from model.config import ModelConfig, ParallelConfig
from model.parallel.cross_entropy import vocab_parallel_cross_entropy
from model.parallel.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from model.parallel.mappings import CommLog
from model.parallel.sharding import partition_dim, take_shard
from model.parallel.topology import ParallelContext, build_context
from tests.multiproc import run_ranks

TOL = 1e-6


def rel(a, b):
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


def tp_context(tp):
    from model.parallel.topology import init_deepspeed_comm

    init_deepspeed_comm("gloo")
    return build_context(ParallelConfig(model_parallel=tp))


def _linear_case(rank, world, kind):
    torch.manual_seed(0)
    x = torch.randn(3, 5, 16)
    g_out = torch.randn(3, 5, 12)
    ctx = tp_context(world)
    if kind == "column":
        ser = ColumnParallelLinear(16, 12, ParallelContext.serial(), gen=torch.Generator().manual_seed(7))
        par = ColumnParallelLinear(16, 12, ctx, gather_output=True, gen=torch.Generator().manual_seed(7))
        xs, xp = x.clone().requires_grad_(), x.clone().requires_grad_()
    else:
        ser = RowParallelLinear(16, 12, ParallelContext.serial(), gen=torch.Generator().manual_seed(7))
        par = RowParallelLinear(16, 12, ctx, gen=torch.Generator().manual_seed(7))
        xs = x.clone().requires_grad_()
        xp = take_shard(x, 2, rank, world, 16 // world).clone().requires_grad_()
    for m in (ser, par):
        m.bias.data.normal_(generator=torch.Generator().manual_seed(3))
    if kind == "column":
        par.bias.data = take_shard(ser.bias.data, 0, rank, world, 12 // world).clone()
    with CommLog() as log:
        ys, yp = ser(xs), par(xp)
        (ys * g_out).sum().backward()
        (yp * g_out).sum().backward()
    errs = {"out": rel(yp, ys)}
    x_ref = xs.grad if kind == "column" else take_shard(xs.grad, 2, rank, world, 16 // world)
    errs["input_grad"] = rel(xp.grad, x_ref)
    for name, p in par.named_parameters():
        full = dict(ser.named_parameters())[name].grad
        errs[name + "_grad"] = rel(
            p.grad,
            take_shard(
                full, partition_dim(p), rank, world, p.shape[partition_dim(p)] if partition_dim(p) is not None else 0
            ),
        )
    return errs, log.calls


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("kind", ["column", "row"])
def test_linear_matches_serial(tp, kind):
    for errs, calls in run_ranks(tp, _linear_case, kind):
        assert max(errs.values()) <= TOL, errs
        ops = [op for op, _ in calls]
        # column: forward gather of the output (test only) + backward all-reduce of the input grad;
        # row: forward all-reduce of partial outputs, backward nothing.
        assert ops.count("all_reduce") == 1, calls


def _embedding_case(rank, world, vocab, split):
    ctx = tp_context(world)
    ids = torch.randint(0, vocab, (4, 9), generator=torch.Generator().manual_seed(1))
    padded = -(-vocab // world) * world
    ser = VocabParallelEmbedding(vocab, 8, ParallelContext.serial(), False, gen=torch.Generator().manual_seed(5))
    par = VocabParallelEmbedding(vocab, 8, ctx, split, padded, gen=torch.Generator().manual_seed(5))
    g = torch.randn(4, 9, 8, generator=torch.Generator().manual_seed(2))
    with CommLog() as log:
        (ser(ids) * g).sum().backward()
        out = par(ids)
        (out * g).sum().backward()
    dim = partition_dim(par.weight)
    ref = take_shard(ser.weight.grad, dim, rank, world, par.weight.shape[0]) if dim is not None else ser.weight.grad
    return rel(out, ser(ids)), rel(par.weight.grad, ref), len(log.calls)


@pytest.mark.parametrize("tp,vocab", [(2, 50), (4, 50), (4, 53)])
@pytest.mark.parametrize("split", [True, False])
def test_vocab_embedding_matches_serial(tp, vocab, split):
    for out_err, grad_err, ncalls in run_ranks(tp, _embedding_case, vocab, split):
        assert out_err <= TOL and grad_err <= TOL, (out_err, grad_err)
        assert ncalls == (1 if split else 0)


def _ce_case(rank, world, vocab, smoothing):
    ctx = tp_context(world)
    gen = torch.Generator().manual_seed(11)
    logits = torch.randn(6, 7, vocab, generator=gen) * 3
    labels = torch.randint(0, vocab, (6, 7), generator=gen)
    labels[:, 5:] = 0  # PAD = 0, ignored
    ref_logits = logits.clone().requires_grad_()
    ref = F.cross_entropy(
        ref_logits.view(-1, vocab), labels.view(-1), ignore_index=0, reduction="none", label_smoothing=smoothing
    ).view(6, 7)
    g = torch.rand(6, 7, generator=gen)
    (ref * g).sum().backward()
    per = -(-vocab // world)
    shard = take_shard(logits, 2, rank, world, per).clone().requires_grad_()
    with CommLog() as log:
        loss = vocab_parallel_cross_entropy(shard, labels, rank * per, vocab, 0, smoothing, ctx.tp_group)
        (loss * g).sum().backward()
    grad_ref = take_shard(ref_logits.grad, 2, rank, world, per)
    return rel(loss, ref), rel(shard.grad, grad_ref), log.calls


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("vocab", [40, 41])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_vocab_parallel_cross_entropy(tp, vocab, smoothing):
    for loss_err, grad_err, calls in run_ranks(tp, _ce_case, vocab, smoothing):
        assert loss_err <= TOL and grad_err <= TOL, (loss_err, grad_err)
        # exactly 3 small all-reduces (max, sum-exp, [target, Σz]) of (tokens,) / (2, tokens) elements; none in bwd
        assert [op for op, _ in calls] == ["loss_all_reduce"] * 3
        assert [n for _, n in calls] == [42, 42, 84]


def test_bad_layout_names_value_and_fix():
    from model.config import ConfigError, validate_layout

    cfg = ModelConfig(num_heads=8, d_model=128, encoder_layers=1, decoder_layers=1)
    with pytest.raises(ConfigError) as e:
        validate_layout(ParallelConfig(model_parallel=3, data_parallel=2), cfg, world_size=6, global_batch=36)
    msg = str(e.value)
    assert "num_heads=8 is not divisible by model_parallel=3" in msg
    assert "batch_size" not in msg.split(". Layouts")[0]
    assert "Layouts that fit 6 processes" in msg and "dp=3 mp=2 pp=1" in msg
    with pytest.raises(ConfigError, match="pipeline_stage=3 > 2 blocks"):
        validate_layout(ParallelConfig(pipeline_stage=3), cfg, world_size=3)
    with pytest.raises(ConfigError, match=r"= 4 but the world has 8 processes"):
        validate_layout(ParallelConfig(model_parallel=4), cfg, world_size=8)
    with pytest.raises(ConfigError, match=r"global batch_size=30 is not divisible by .* = 2×2 = 4"):
        validate_layout(ParallelConfig(data_parallel=2, micro_batch_num=2), cfg, world_size=2, global_batch=30)
    with pytest.raises(ConfigError, match="ZeRO stage 2 cannot be combined with pipeline_stage=2"):
        validate_layout(ParallelConfig(pipeline_stage=2, zero_stage=2), cfg, world_size=2)
    with pytest.raises(ConfigError, match="FFN size=100 is not divisible by model_parallel=8"):
        validate_layout(ParallelConfig(model_parallel=8), cfg.replace(ffn_size=100), world_size=8)


def test_layout_suggestions_never_fail_and_batches_are_the_nearest():
    """Every layout an error suggests passes the rules itself; the one that just failed is never suggested (a model
    whose d_model the heads do not divide used to get its own failing layout back); a batch that does not divide gets
    the nearest sizes that do (15 with micro_batch_num 2 → 14 or 16, not 2, 4, 6)."""
    import re

    from model.config import ConfigError, layout_errors, validate_layout

    def suggestions(parallel, model, world, batch=None):
        with pytest.raises(ConfigError) as e:
            validate_layout(parallel, model, world_size=world, global_batch=batch)
        found = re.search(r"Layouts that fit \d+ processes: (.*)$", str(e.value))
        return str(e.value), (
            [tuple(int(v) for v in re.findall(r"=(\d+)", s)) for s in found.group(1).split(", ")] if found else []
        )

    cfg = ModelConfig(num_heads=8, d_model=128, encoder_layers=1, decoder_layers=1)
    bad_heads = cfg.replace(d_model=130)  # no layout can fix d_model % num_heads
    msg, fits = suggestions(ParallelConfig(), bad_heads, 1)
    assert "d_model=130 is not divisible by num_heads=8" in msg and fits == []
    assert "No other layout of 1 processes fits" in msg
    msg, fits = suggestions(ParallelConfig(model_parallel=2), bad_heads, 2)
    assert fits == [] and "dp=1 mp=2 pp=1" not in msg.split(": ", 1)[1].split(". ", 1)[1]
    cases = [
        (ParallelConfig(model_parallel=3, data_parallel=2), cfg, 6, 36),
        (ParallelConfig(model_parallel=2, pipeline_stage=2, zero_stage=2), cfg, 4, 32),
        (ParallelConfig(data_parallel=8), cfg.replace(num_heads=6, d_model=96), 8, 12),
        (ParallelConfig(model_parallel=4, interleave_num=4), cfg, 8, 16),
    ]
    # worked out by hand (dp × mp × pp = world; mp divides the heads and the FFN; pp at most the 2 blocks, and 1
    # with ZeRO 2; dp × micro_batch_num divides the batch); the last case is only checked against the rules
    by_hand = [
        {(3, 2, 1), (6, 1, 1), (3, 1, 2)},
        {(4, 1, 1), (2, 2, 1), (1, 4, 1)},
        {(4, 2, 1), (4, 1, 2), (2, 2, 2)},
        None,
    ]
    for (parallel, model, world, batch), want in zip(cases, by_hand):
        msg, fits = suggestions(parallel, model, world, batch)
        assert fits, msg
        assert want is None or set(fits) == want, (fits, want)
        assert (parallel.data_parallel, parallel.model_parallel, parallel.pipeline_stage) not in fits
        for dp, mp, pp in fits:
            assert not layout_errors(
                parallel.replace(data_parallel=dp, model_parallel=mp, pipeline_stage=pp), model, world, batch
            ), (dp, mp, pp)
    for batch, micro, dp, want in (
        (15, 2, 1, "try batch_size 14 or 16"),
        (30, 1, 4, "try batch_size 28 or 32"),
        (3, 1, 4, "try batch_size 4)"),
        (65, 4, 2, "try batch_size 64 or 72"),
    ):
        with pytest.raises(ConfigError) as e:
            validate_layout(
                ParallelConfig(data_parallel=dp, micro_batch_num=micro), cfg, world_size=dp, global_batch=batch
            )
        assert want in str(e.value), str(e.value)
