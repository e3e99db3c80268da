"""What crosses a pipeline stage boundary: one floating-point tensor (the stage's two hidden tensors joined along the
sequence, `model.pipeline.join_boundary`) and the token ids, so that DeepSpeed's pipeline engine can split it over
the tensor-parallel ranks on the wire (`pipe_partitioned`, `grad_partitioned`: training.core.engine).

A real tp2×pp2 DeepSpeed pipeline engine (4 gloo processes) trains one step with the split on and off: the same loss
and gradient norm, and each TP rank sends half the activation and gradient bytes per boundary with it on (counted at
DeepSpeed's own `p2p.send`), which is what plan.py's cost model (model.costs.boundary_bytes) says it sends. That the
split is on in train.py's runs, and exact over 20 steps with fixed and token batches, is checked by
tests/test_parity.py (tp2xpp2 cases, run.json's pipe_partitioned)."""

import pytest
import torch

from model.config import ModelConfig, ParallelConfig
from model.pipeline import join_boundary, split_boundary
from model.transformer import DecoderLayer, EncoderLayer, Head
from tests.multiproc import run_ranks

B, S, T, D = 8, 7, 5, 16


def test_join_and_split_are_inverse_for_every_kind_of_receiving_stage():
    g = torch.Generator().manual_seed(0)
    src_ids, tgt_ids = torch.randint(1, 9, (B, S), generator=g), torch.randint(1, 9, (B, T), generator=g)
    src_h, tgt_h = torch.randn(B, S, D, generator=g), torch.randn(B, T, D, generator=g)
    for first_layer, hidden in ((EncoderLayer, (src_h, tgt_h)), (DecoderLayer, (tgt_h, src_h))):
        joined = join_boundary((*hidden, src_ids, tgt_ids))
        assert len(joined) == 3 and joined[0].shape == (B, S + T, D) and joined[1] is src_ids
        assert sum(t.is_floating_point() for t in joined) == 1  # what DeepSpeed can partition
        back = split_boundary(joined, first_layer)
        assert all(torch.equal(a, b) for a, b in zip(back, (*hidden, src_ids, tgt_ids)))
    before_head = (tgt_h, tgt_ids)  # the last decoder's output: one float
    assert join_boundary(before_head) is before_head and split_boundary(before_head, Head) is before_head


def _one_step(rank, world, partitioned):
    """One train_batch of a tp2×pp2 engine (2 micro-batches, padded token ids) with `pipe_partitioned` and
    `grad_partitioned` on or off: (loss, grad norm, the engine's flags, bytes this rank sent per kind)."""
    import deepspeed.runtime.pipe.p2p as p2p

    from model.parallel.topology import init_deepspeed_comm
    from training.core.engine import build_engine

    init_deepspeed_comm("gloo")
    cfg = ModelConfig(
        vocab_size=60,
        d_model=D,
        num_heads=4,
        ffn_size=24,
        encoder_layers=2,
        decoder_layers=2,
        src_len=S,
        tgt_len=T,
        dropout=0.0,
        attention_dropout=0.0,
        pad_id=0,
    )
    parallel = ParallelConfig(model_parallel=2, pipeline_stage=2, micro_batch_num=2)
    switch = {"pipe_partitioned": partitioned, "grad_partitioned": partitioned}
    engine = build_engine(
        cfg,
        parallel,
        world_size=world,
        global_batch=B,
        seed=3,
        lr=1e-3,
        weight_decay=0.0,
        lr_schedule=lambda step: 1.0,
        clip_grad=1.0,
        ds_overrides={"pipeline": switch},
    )
    g = torch.Generator().manual_seed(11)
    micro = []
    for _ in range(2):
        src, tgt, labels = (torch.randint(4, 60, (B // 2, n), generator=g) for n in (S, T, T))
        src[0, 4:], tgt[1, 2:], labels[1, 2:] = 0, 0, 0
        micro.append(((src, tgt), labels))
    engine.objective.begin_step(int(sum((m[1] != 0).sum() for m in micro)))
    sent = {"activation": 0, "gradient": 0, "ids": 0, "meta": 0}
    real_send = p2p.send

    def counting_send(tensor, dest_stage, async_op=False):
        stage = engine.ds.stage_id
        kind = (
            "meta"
            if tensor.dtype in (torch.int32, torch.int64) and tensor.dim() == 1
            else "ids"
            if not tensor.is_floating_point()
            else "activation"
            if dest_stage > stage
            else "gradient"
        )
        sent[kind] += tensor.numel() * tensor.element_size()
        return real_send(tensor, dest_stage, async_op)

    p2p.send = counting_send
    try:
        loss = float(engine.ds.train_batch(data_iter=iter(micro)))
    finally:
        p2p.send = real_send
    flags = (engine.ds.is_pipe_partitioned, engine.ds.is_grad_partitioned)
    return loss, engine.grad_norm(), flags, sent, engine.ds.stage_id


def test_tp_ranks_send_half_the_boundary_each_and_train_alike():
    """Each TP rank sends 1/2 of the activation forward and of its gradient backward (the receiving stage
    all-gathers the halves), and the step's loss and gradient norm are those of the unsplit boundary, bit for bit."""
    on, off = run_ranks(4, _one_step, True), run_ranks(4, _one_step, False)
    full = 2 * (B // 2) * (S + T) * D * 4  # 2 micro-batches of the joined [B/2, S+T, d] fp32 boundary
    for (loss, norm, flags, sent, stage), (loss_off, norm_off, flags_off, sent_off, _) in zip(on, off):
        assert flags == (True, True) and flags_off == (False, False)
        assert loss == loss_off and norm == norm_off  # the same numbers, only fewer bytes moved
        kind = "activation" if stage == 0 else "gradient"
        assert sent_off[kind] == full and sent[kind] == full // 2, (stage, sent, sent_off)
    assert sorted(r[4] for r in on) == [0, 0, 1, 1]
    # plan.py's figures (model.costs) are what DeepSpeed sent (payload: the split layout and shapes aside)
    from model.costs import boundary_bytes, boundary_tensors

    cfg = ModelConfig(
        vocab_size=60, d_model=D, num_heads=4, ffn_size=24, encoder_layers=2, decoder_layers=2, src_len=S, tgt_len=T
    )
    tensors = boundary_tensors(cfg, "encoder.1", B // 2)  # the seed's split of 2+2 blocks on 2 stages
    for runs, split in ((on, True), (off, False)):
        fwd, bwd = boundary_bytes(tensors, 4, 2, split, split)
        sent = {r[4]: r[3] for r in runs}  # stage → bytes one of its ranks sent
        assert sent[0]["activation"] + sent[0]["ids"] == 2 * fwd and sent[1]["gradient"] == 2 * bwd
    # the split's only overhead: DeepSpeed's layout of each split tensor (PartitionedTensor.to_meta: ndims, the 3
    # sizes, num_parts, rank, num_parts + 1 offsets, as int64) once per micro-batch and direction
    layout = 8 * (1 + 3 + 1 + 1 + (2 + 1))
    for stage, kind in ((0, "meta"), (1, "meta")):
        extra = next(r[3] for r in on if r[4] == stage)[kind] - next(r[3] for r in off if r[4] == stage)[kind]
        assert extra == 2 * layout, (stage, extra)
    for name, runs in (("off", off), ("on", on)):
        a, gr = next(r[3] for r in runs if r[4] == 0), next(r[3] for r in runs if r[4] == 1)
        print(
            f"tp2xpp2, 2 micro-batches of [{B // 2}, {S}+{T}] d={D}, per TP rank and step: {name}: activations "
            f"{a['activation']} B + ids {a['ids']} B + meta {a['meta']} B forward, gradients {gr['gradient']} B "
            f"+ meta {gr['meta']} B backward"
        )


# token batches: shapes come back. A small, B large, C new but inside B's buffers; validation at D in between
A, B_, C, D_ = (S, T), (S + 4, T + 3), (S + 2, T + 1), (S + 1, T + 2)
TRAIN_SHAPES = [A, B_, C, A, B_, C]
VALIDATE_AFTER = {1: D_, 4: D_}  # eval_batch after these steps (indices), at shape D
COUNT_FROM = 3  # steps 4-6 and the second validation repeat shapes seen before


def _shape_cycle(rank, world, remember, tp, pp):
    """A tp×pp engine trained on `TRAIN_SHAPES`, validated at `D_` in between, each batch's shape announced as
    train.py does (Engine.expect_shape). remember=False is how it was before training.core.boundary_meta: the
    engine started over (reset_activation_shape) at every change of shape. Returns the losses, the metadata
    messages this rank sent and the host reads (.item, .tolist, .to("cpu")) it made from step 4 on (shapes seen
    before), its stage, and the messages BoundaryMeta let through over the whole run."""
    import deepspeed.runtime.pipe.p2p as p2p

    from model.parallel.topology import init_deepspeed_comm
    from training.core.engine import build_engine

    init_deepspeed_comm("gloo")
    cfg = ModelConfig(
        vocab_size=60,
        d_model=D,
        num_heads=4,
        ffn_size=24,
        encoder_layers=2,
        decoder_layers=2,
        src_len=S + 4,
        tgt_len=T + 3,
        dropout=0.0,
        attention_dropout=0.0,
        pad_id=0,
    )
    engine = build_engine(
        cfg,
        ParallelConfig(model_parallel=tp, pipeline_stage=pp, micro_batch_num=2),
        world_size=world,
        global_batch=B,
        seed=3,
        lr=1e-3,
        weight_decay=0.0,
        lr_schedule=lambda step: 1.0,
        clip_grad=1.0,
    )
    ds = engine.ds
    if not remember:
        ds._send_tensor_meta, ds._recv_tensor_meta = engine.boundary._send, engine.boundary._recv
        last = []

        def start_over_at_a_change(shape):
            if last and last[-1] != shape:
                ds.reset_activation_shape()
            last.append(shape)

        engine.expect_shape = start_over_at_a_change
    counts = {"meta messages": 0, "host reads": 0}
    real = {"send": p2p.send, "item": torch.Tensor.item, "tolist": torch.Tensor.tolist, "to": torch.Tensor.to}

    def send(tensor, dest_stage, async_op=False):
        counts["meta messages"] += tensor.dtype == torch.int32  # DeepSpeed's metadata buffer (int32)
        return real["send"](tensor, dest_stage, async_op)

    def read(name):
        def counted(t, *args, **kwargs):
            if name != "to" or (args and str(args[0]) == "cpu"):
                counts["host reads"] += 1
            return real[name](t, *args, **kwargs)

        return counted

    g = torch.Generator().manual_seed(11)

    def batches(s, t):
        micro = []
        for _ in range(2):
            src, tgt, labels = (torch.randint(4, 60, (B // 2, n), generator=g) for n in (s, t, t))
            src[0, s - 2 :], tgt[1, 2:], labels[1, 2:] = 0, 0, 0
            micro.append(((src, tgt), labels))
        engine.objective.begin_step(int(sum((m[1] != 0).sum() for m in micro)))
        engine.expect_shape((B // 2, s, t))
        return iter(micro)

    losses = []
    for step, shape in enumerate(TRAIN_SHAPES):
        if step == COUNT_FROM:
            p2p.send = send
            torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.to = read("item"), read("tolist"), read("to")
        losses.append((float(ds.train_batch(data_iter=batches(*shape))), engine.grad_norm()))
        if step in VALIDATE_AFTER:
            losses.append(float(ds.eval_batch(data_iter=batches(*VALIDATE_AFTER[step]))))
    p2p.send = real["send"]
    torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.to = real["item"], real["tolist"], real["to"]
    return losses, counts, ds.stage_id, dict(engine.boundary.messages)


@pytest.mark.parametrize("tp,pp", [(2, 2), (1, 3)], ids=["tp2xpp2", "pp3"])
def test_a_shape_seen_before_is_not_exchanged_again_and_trains_alike(tp, pp):
    """Stages remember per micro-batch shape what they exchanged about the boundary tensors (sizes, and the
    tensor-parallel split's records): over the run each boundary carries one metadata message per distinct shape
    (4: A, B, C and validation's D), and when a shape comes back no stage sends one or reads one back, where the
    engine used to start over at each change of shape (a message and its host reads per change; gradients need
    none, their buffers are sized from the stage's own outputs). pp3's middle stage receives activations and
    gradients from one buffer pool. Training and validation losses and gradient norms are bit-identical to
    starting over."""
    world = tp * pp
    kept, fresh = run_ranks(world, _shape_cycle, True, tp, pp), run_ranks(world, _shape_cycle, False, tp, pp)
    for (losses, counts, stage, messages), (losses_fresh, counts_fresh, _, _) in zip(kept, fresh):
        assert losses == losses_fresh, (stage, losses, losses_fresh)
        print(
            f"tp{tp}xpp{pp} stage {stage}, steps 4-6 and the second validation (shapes seen before): "
            f"remembered {counts}, started over {counts_fresh}; messages over the run {messages}"
        )
        assert messages == {"sent": 4 if stage < pp - 1 else 0, "received": 4 if stage > 0 else 0}, messages
        assert counts["meta messages"] == 0
        if stage < pp - 1:  # a sender: one message per change of shape before
            assert counts_fresh["meta messages"] == 4, counts_fresh
        if stage > 0 or tp > 1:  # a receiver: its reads of each message (and of the split records) gone
            assert counts["host reads"] < counts_fresh["host reads"], (counts, counts_fresh)
        else:
            assert counts["host reads"] == counts_fresh["host reads"], (counts, counts_fresh)
    assert sorted(r[2] for r in kept) == sorted(s for s in range(pp) for _ in range(tp))
