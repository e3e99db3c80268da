"""interleave_num (the seed's MicroBatchInterleaved) on the TP model, in real gloo processes: the same loss and
gradients as interleave_num 1, the same collectives N times at 1/N the size, issued asynchronously, and in flight
while the other part computes — in forward and in backward."""

import json
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from model.config import ConfigError, ModelConfig, ParallelConfig, validate_layout
from model.parallel import mappings
from model.parallel.mappings import CommLog
from model.transformer import Seq2SeqTransformer
from tests.multiproc import run_ranks
from tests.op_count import OpCounter
from tests.test_tp_layers import tp_context

B, S, T = 6, 7, 6


def tiny(enc=2, dec=2, dropout=0.0):
    return ModelConfig(
        vocab_size=50,
        d_model=16,
        num_heads=4,
        ffn_size=24,
        encoder_layers=enc,
        decoder_layers=dec,
        src_len=S,
        tgt_len=T,
        dropout=dropout,
        attention_dropout=dropout,
        pad_id=0,
    )


def batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    src, tgt, labels = (torch.randint(4, 50, (B, n), generator=g) for n in (S, T, T))
    src[0, 4:] = 0  # padded source (part 0) and target (part 0 of 2, part 1 of 3)
    tgt[2, 3:] = 0
    labels[2, 3:] = 0
    src[5, 2:] = 0  # padded source in the last part
    return src, tgt, labels


def _run(model, inputs):
    src, tgt, labels = inputs
    with CommLog() as fwd:
        loss = model.loss_sum(src, tgt, labels)
    with CommLog() as bwd:
        loss.backward()
    return loss.detach(), {k: p.grad.clone() for k, p in model.named_parameters()}, fwd, bwd


def _pair_case(rank, world, n, dtype, recompute, vocab_emb_dp):
    """interleave_num 1 and n on the same TP model and batch: (loss rel diff, worst grad rel diff, logs)."""
    ctx = tp_context(world)
    inputs = batch()
    runs = {}
    for il in (1, n):
        parallel = ParallelConfig(
            model_parallel=world, interleave_num=il, recompute=recompute, vocab_emb_dp=vocab_emb_dp
        )
        model = Seq2SeqTransformer(tiny(), parallel, ctx, seed=42).to(dtype)
        runs[il] = _run(model, inputs)
    (l1, g1, f1, b1), (ln, gn, fn, bn) = runs[1], runs[n]
    loss_err = float((ln - l1).abs() / l1.abs())
    grad_err = max(float((gn[k] - g1[k]).norm() / g1[k].norm().clamp(min=1e-30)) for k in g1)
    return loss_err, grad_err, (f1, b1, fn, bn)


# (interleave_num, dtype, recompute, vocab_emb_dp): measured worst gradient difference in the comment
CASES = [
    (2, torch.float32, False, True),  # 1.4e-7 (weight gradients summed over 2 parts: fp32 rounding)
    (3, torch.float32, False, False),  # split embeddings too (their all-reduce is not interleaved)
    (2, torch.float32, True, True),  # recompute: the interleaved block is recomputed in backward
    (2, torch.float64, False, True),
]  # 3e-16: no rounding left


@pytest.mark.parametrize("n,dtype,recompute,vocab_emb_dp", CASES)
def test_interleaved_loss_and_grads_equal_plain(n, dtype, recompute, vocab_emb_dp):
    results = run_ranks(2, _pair_case, n, dtype, recompute, vocab_emb_dp)
    loss_err = max(r[0] for r in results)
    grad_err = max(r[1] for r in results)
    print(f"tp2 interleave {n} vs 1 ({dtype}, recompute={recompute}): loss {loss_err:.1e}, grads {grad_err:.1e}")
    tol = 1e-6 if dtype == torch.float32 else 1e-13
    assert loss_err <= tol and grad_err <= tol


def _stage_split_case(rank, world, n):
    """1 encoder + 3 decoder layers placed as a 2-stage pipeline would place them — decoder 0 last on stage 0 (drops
    memory_tp), decoder 1 first on stage 1 (the memory enters the TP region again), recomputed — run block after
    block in one process: what each stage runs, without the send/receive."""
    from model.placement import BlockPlacement
    from model.transformer import TokenLoss, block_specs

    ctx = tp_context(world)
    cfg = tiny(enc=1, dec=3)
    placements = [
        BlockPlacement("encoder", 0, 0),
        BlockPlacement("decoder", 0, 0),
        BlockPlacement("decoder", 1, 1, recomputed=True),
        BlockPlacement("decoder", 2, 1),
    ]
    out = {}
    for il in (1, n):
        parallel = ParallelConfig(model_parallel=world, interleave_num=il)
        blocks = torch.nn.ModuleList(cls(**kw) for cls, kw in block_specs(cfg, parallel, ctx, 42, placements))
        src, tgt, labels = batch()
        x = (src, tgt)
        for block in blocks:
            x = block(x)
            if block is blocks[2]:
                assert len(x) == 4  # memory_tp dropped at the stage boundary
        loss = TokenLoss(cfg, parallel.dp_mp_config, ctx).token_losses(x, labels).sum()
        loss.backward()
        out[il] = (loss.detach(), {k: p.grad for k, p in blocks.named_parameters()})
    (l1, g1), (ln, gn) = out[1], out[n]
    return float((ln - l1).abs() / l1), max(float((gn[k] - g1[k]).norm() / g1[k].norm()) for k in g1)


def test_stage_boundary_between_decoder_layers():
    loss_err, grad_err = max(run_ranks(2, _stage_split_case, 2))
    assert loss_err <= 1e-6 and grad_err <= 1e-6, (loss_err, grad_err)


def test_recipe_key_and_flag_reach_the_parallel_config(tmp_path):
    from training.config.flags import parse_config

    recipe = tmp_path / "r.json"
    recipe.write_text(json.dumps({"parallel": {"model_parallel": 2, "interleave_num": 4}}))
    assert parse_config(["--recipe", str(recipe)]).parallel.parallel_config(2).interleave_num == 4
    flagged = parse_config(["--recipe", str(recipe), "--interleave_num", "2"])
    assert flagged.parallel.parallel_config(2).interleave_num == 2
    assert parse_config([]).parallel.parallel_config(1).interleave_num == 1


def test_same_collectives_n_times_at_one_nth_the_size():
    """Every all-reduce of the encoder and decoder layers (forward: attention and MLP outputs; backward: their
    inputs' gradients and the memory's) is issued n times, one per batch part, asynchronously, the parts' sizes
    adding up to the whole (a part carries its own real tokens, `model.packing`: so "1/n the size" when the parts
    hold as many tokens; the memory's gradient is padded, exactly 1/n); the others — the head's input gradient and
    the loss's statistics — are issued as before."""
    n, enc, dec = 2, 2, 2
    f1, b1, fn, bn = run_ranks(2, _pair_case, n, torch.float32, False, True)[0][2]
    h = tiny().d_model
    src, tgt, _ = batch()

    def real(ids):
        return [int((part != 0).sum()) * h for part in ids.chunk(n)]

    src_parts, tgt_parts = real(src), real(tgt)
    assert src_parts != [sum(src_parts) // n] * n  # the parts differ: sizes are really per part
    layer_fwd = [src_parts] * (2 * enc) + [tgt_parts] * (3 * dec)
    layer_bwd = layer_fwd + [[B * S * h // n] * n]  # + the memory's gradient, once per stage
    for plain, inter, layer in ((f1, fn, layer_fwd), (b1, bn, layer_bwd)):
        want_async = sorted(("all_reduce", size) for parts in layer for size in parts)
        assert sorted(inter.async_calls) == want_async
        rest = list(plain.calls)
        for parts in layer:
            rest.remove(("all_reduce", sum(parts)))
        sync = list(inter.calls)
        for call in inter.async_calls:
            sync.remove(call)
        assert sorted(sync) == sorted(rest) and not plain.async_calls
        assert len(inter.calls) == len(plain.calls) + (n - 1) * len(layer)
    print(
        f"CommLog tp2, {enc}+{dec} layers, B={B}: forward {len(f1.calls)} collectives → {len(fn.calls)} with "
        f"interleave {n} ({len(fn.async_calls)} async), backward {len(b1.calls)} → {len(bn.calls)} "
        f"({len(bn.async_calls)} async)"
    )


_MATMULS = ("mm", "bmm", "addmm", "scaled_dot_product")


class _Trace(TorchDispatchMode):
    """Logs every matrix product (forward and autograd's backward run on this thread on CPU)."""

    def __init__(self, events):
        super().__init__()
        self.events = events

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        if name.lstrip("_").startswith(_MATMULS):
            self.events.append(("compute", name))
        return func(*args, **(kwargs or {}))


def _overlap_case(rank, world, n):
    """For each async all-reduce: the matrix products this rank ran between starting it and waiting for it."""
    ctx = tp_context(world)
    model = Seq2SeqTransformer(tiny(), ParallelConfig(model_parallel=world, interleave_num=n), ctx, seed=42)
    events, started = [], [0]
    real_start = mappings._start_all_reduce

    class Work:
        def __init__(self, work, i):
            self.work, self.i = work, i

        def wait(self):
            events.append(("wait", self.i))
            self.work.wait()

    def start(t, group):
        started[0] += 1
        events.append(("start", started[0]))
        return Work(real_start(t, group), started[0])

    mappings._start_all_reduce = start
    src, tgt, labels = batch()
    try:
        with _Trace(events):
            loss = model.loss_sum(src, tgt, labels)
            events.append(("backward", None))
            loss.backward()
    finally:
        mappings._start_all_reduce = real_start
    split = events.index(("backward", None))
    between = {"forward": [], "backward": []}
    for i in range(1, started[0] + 1):
        s, w = events.index(("start", i)), events.index(("wait", i))
        between["forward" if s < split else "backward"].append(sum(e[0] == "compute" for e in events[s:w]))
    return between


def test_communication_is_in_flight_during_the_other_parts_compute():
    """With 2 parts, every layer all-reduce but one per block and direction has matrix products of the other part
    running while it is in flight: forward, all but the last part's last branch; backward (autograd's reverse
    order), all but the first part's first branch. That one per block is the price of starting and ending every
    block with whole tensors."""
    between = run_ranks(2, _overlap_case, 2)[0]
    blocks = 4
    for direction, counts in between.items():
        idle = sum(c == 0 for c in counts)
        print(
            f"{direction}: {len(counts) - idle} of {len(counts)} all-reduces overlap compute; products in flight "
            f"per all-reduce {counts}"
        )
        assert idle == blocks, (direction, counts)


def _dropout_case(rank, world, recompute, n=2):
    from model.parallel.random import RNG

    ctx = tp_context(world)
    model = Seq2SeqTransformer(
        tiny(dropout=0.2), ParallelConfig(model_parallel=world, interleave_num=n, recompute=recompute), ctx, seed=3
    )
    model.train()
    RNG.seed(123, tp_rank=ctx.tp_rank)
    loss, grads, _, _ = _run(model, batch())
    return float(loss), grads


def test_recompute_replays_interleaved_dropout_exactly():
    """Recompute re-runs the interleaved schedule with the saved RNG states: the same masks, bit for bit."""
    plain = run_ranks(2, _dropout_case, False)
    recomputed = run_ranks(2, _dropout_case, True)
    for (l0, g0), (l1, g1) in zip(plain, recomputed):
        assert l0 == l1
        assert all(torch.equal(g0[k], g1[k]) for k in g0)
    assert plain[0][0] == plain[1][0]  # the TP ranks drew the same residual dropout masks


@pytest.mark.parametrize("n", [2, 3])
def test_dropout_masks_on_cpu_are_those_of_interleave_1(n):
    """The schedule draws each dropout site's masks part 0 first, in the order the non-interleaved layer draws
    them; CPU's generator fills them element by element, so the masks — and loss and gradients — are
    interleave_num 1's (dropout 0.2 on residuals and attention)."""
    for (l1, g1), (ln, gn) in zip(run_ranks(2, _dropout_case, False, 1), run_ranks(2, _dropout_case, False, n)):
        assert ln == l1
        assert max(float((gn[k] - g1[k]).norm() / g1[k].norm()) for k in g1) <= 1e-6


def test_interleave_num_must_divide_the_micro_batch():
    cfg = ModelConfig(num_heads=8, d_model=128)
    layout = ParallelConfig(data_parallel=2, model_parallel=2, micro_batch_num=2, interleave_num=3)
    with pytest.raises(ConfigError) as e:
        validate_layout(layout, cfg, world_size=4, global_batch=32)
    msg = str(e.value)
    assert "interleave_num=3 does not divide the micro-batch of 8 samples per rank" in msg
    assert "use interleave_num 1, 2, 4 or 8" in msg
    validate_layout(layout.replace(interleave_num=4), cfg, world_size=4, global_batch=32)
    with pytest.raises(ConfigError, match="interleave_num=0 must be >= 1"):
        validate_layout(layout.replace(interleave_num=0), cfg)


def _packings_case(rank, world, n, recompute, micro_batches):
    """One training step of a 3+3-layer TP model (forward and backward over `micro_batches` micro-batches, then
    an optimizer step): how many packings were built from ids (`Packing.__init__`), how many nonzero() ran, and
    how often the layers ran (recompute: twice per micro-batch)."""
    from model import interleave
    from model.packing import Packing

    ctx = tp_context(world)
    model = Seq2SeqTransformer(
        tiny(enc=3, dec=3), ParallelConfig(model_parallel=world, interleave_num=n, recompute=recompute), ctx, seed=5
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    built, layer_runs = [0], [0]
    real_init, real_enc, real_dec = Packing.__init__, interleave.encoder_layer, interleave.decoder_layer

    def counted_init(self, *args):
        built[0] += 1
        real_init(self, *args)

    def counted(real):
        def run(*args):
            layer_runs[0] += 1
            return real(*args)

        return run

    Packing.__init__ = counted_init
    interleave.encoder_layer, interleave.decoder_layer = counted(real_enc), counted(real_dec)
    try:
        with OpCounter() as ops:
            for k in range(micro_batches):
                src, tgt, labels = batch(seed=k)
                model.loss_sum(src, tgt, labels).backward()
            opt.step()
    finally:
        Packing.__init__ = real_init
        interleave.encoder_layer, interleave.decoder_layer = real_enc, real_dec
    return built[0], ops.of("nonzero", "nonzero_static"), layer_runs[0]


@pytest.mark.parametrize("n,recompute", [(2, True), (2, False), (1, True)])
def test_packing_is_built_once_per_micro_batch_part_and_side(n, recompute):
    """Finding a batch's real tokens (`model.packing`: a nonzero(), a host synchronisation on a GPU) happens once
    per micro-batch, interleave part and side (source, target) — not once per layer, part and recomputation: the
    parts' packings are kept on the ids tensor, recompute passes the ids through as they are, and the Head's
    whole-batch packing is joined from the parts'. (Before: 74 packings for n 2 with recompute, 38 for n 1 with
    recompute, instead of 8 and 4.)"""
    micro, layers = 2, 6
    built, nonzero, layer_runs = run_ranks(2, _packings_case, n, recompute, micro)[0]
    print(
        f"tp2, {layers} layers, interleave {n}, recompute {recompute}: {built} packings, {nonzero} nonzero() "
        f"in one step of {micro} micro-batches"
    )
    if n > 1:  # the interleaved layers ran, and with recompute ran again in backward
        assert layer_runs == micro * layers * (2 if recompute else 1), layer_runs
    assert built == micro * n * 2, built
    assert nonzero == built, nonzero


# ------------------------------------------------------------------------------------------- through train.py
STEPS = 4
LAYOUTS = {  # name: (processes, flags); each runs with interleave_num 1 and 2 (recompute: 2 only, against 1 plain)
    "tp2": (2, ["--mp", "2"]),
    "tp2xpp2": (4, ["--mp", "2", "--pipeline_stage", "2", "--micro_batch_num", "2"]),
    "dp2xtp2": (4, ["--mp", "2"]),
    "tp2xpp2-recompute": (4, ["--mp", "2", "--pipeline_stage", "2", "--micro_batch_num", "2", "--recompute", "1"]),
}


@pytest.mark.slow
def test_train_py_interleave_2_equals_1_per_layout(multi30k_tsv, bpe_tokenizer, tmp_path):
    """Loss and gradient norm at every step, and every merged weight after the last step: interleave_num 2 against 1
    under tp2, tp2×pp2 (interleaving inside each stage's blocks; plain and with recompute) and dp2×tp2 — 2 launches.
    Measured: loss ≤ 1.1e-7, grad_norm ≤ 1.1e-7, weights RMS ≤ 6e-4·lr (the near-zero key biases)."""
    from tests.launch import TINY, read_metrics, run_many
    from tests.test_checkpoint import merged

    LR = float(TINY[TINY.index("--lr") + 1])

    def argv(name, il):
        return [
            "--file_path",
            multi30k_tsv,
            "--tokenizer",
            bpe_tokenizer,
            "--steps",
            STEPS,
            *TINY,
            "--output_dir",
            tmp_path / f"{name}-il{il}",
            "--interleave_num",
            il,
            "--save_checkpoint_steps",
            STEPS,
            *LAYOUTS[name][1],
        ]

    runs = [(name, il) for name in LAYOUTS for il in ((2,) if "recompute" in name else (1, 2))]
    for nproc in (2, 4):
        run_many(nproc, [argv(name, il) for name, il in runs if LAYOUTS[name][0] == nproc], tmp_path)
    for name, il in runs:
        if il == 1:
            continue
        ref = name.replace("-recompute", "")
        got, want = read_metrics(tmp_path / f"{name}-il2"), read_metrics(tmp_path / f"{ref}-il1")
        assert len(got) == len(want) == STEPS
        info = json.loads((tmp_path / f"{name}-il2" / "run.json").read_text())
        assert info["interleave_num"] == 2, info
        loss = max(abs(g["loss"] - w["loss"]) / w["loss"] for g, w in zip(got, want))
        norm = max(abs(g["grad_norm"] - w["grad_norm"]) / w["grad_norm"] for g, w in zip(got, want))
        last = Path("checkpoints") / f"step_{STEPS:08d}"
        a, b = merged(tmp_path / f"{name}-il2" / last)["model"], merged(tmp_path / f"{ref}-il1" / last)["model"]
        # RMS weight difference in units of lr, as tests/test_parity.py: Adam turns the rounding noise of gradients
        # that are ~0 (attention key biases) into O(lr) steps; a missing or doubled part would be O(lr) everywhere
        weights = max(float((a[k] - b[k]).pow(2).mean().sqrt()) / LR for k in b)
        print(
            f"INTERLEAVE {name}: interleave 2 vs 1 over {STEPS} steps — loss {loss:.1e}, grad_norm {norm:.1e}, "
            f"weights RMS {weights:.1e}·lr"
        )
        assert loss <= 1e-6 and norm <= 1e-6 and weights <= 1e-2
