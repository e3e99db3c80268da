"""What a training step reads back from the device (on a GPU each read is a synchronisation that drains the queue of
kernels): counted on CPU with a tracer around train.py's real steps (tests/drivers/sync_count.py), and the pieces
that removed reads — packing built on the host with the batch (model.packing), the stop vote read a step later
(training.run.stop_request)."""

from __future__ import annotations

import json
import signal

import pytest
import torch

from model.packing import Packing
from tests.launch import REPO_ROOT, TINY, env, launch_cmd, run_python
from tests.multiproc import run_ranks


def _without(flags: list, *names) -> list:
    out, skip = [], False
    for flag in flags:
        if skip:
            skip = False
        elif flag in names:
            skip = True
        else:
            out.append(flag)
    return out


DRIVER = str(REPO_ROOT / "tests" / "drivers" / "sync_count.py")
VARIANTS = {
    "2+2": ["--encoder_layer", 2, "--decoder_layer", 2],
    "4+4": ["--encoder_layer", 4, "--decoder_layer", 4],
    "2+2, 2 micro-batches": ["--encoder_layer", 2, "--decoder_layer", 2, "--micro_batch_num", 2],
    "2+2, 4 micro-batches, interleave 2, recompute": [
        "--encoder_layer",
        2,
        "--decoder_layer",
        2,
        "--micro_batch_num",
        4,
        "--interleave_num",
        2,
        "--recompute",
        "true",
    ],
}


def _counts(nproc: int, extra: list, data, tmp_path) -> list[dict]:
    """Per rank: {variant: the calls of one step}."""
    tsv, tok = data
    base = [
        "--file_path",
        tsv,
        "--tokenizer",
        tok,
        "--cache_dir",
        tmp_path / "cache",
        "--log_interval",
        "1",
        *_without(TINY, "--encoder_layer", "--decoder_layer"),
        *extra,
    ]
    runs = tmp_path / "runs.json"
    runs.write_text(json.dumps([[str(a) for a in base + v] for v in VARIANTS.values()]))
    out = tmp_path / "counts.json"
    proc = run_python(launch_cmd(nproc, script=DRIVER) + [str(runs), str(out)], env=env(), timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    files = [out] if nproc == 1 else [tmp_path / f"counts-rank{r}.json" for r in range(nproc)]
    per_rank = [dict(zip(VARIANTS, json.loads(f.read_text()))) for f in files]
    for rank, counts in enumerate(per_rank):
        for name, c in counts.items():
            print(f"{nproc} rank(s) {' '.join(map(str, extra))} rank {rank}, {name}: {c} (total {sum(c.values())})")
    return per_rank


def test_a_training_step_calls_no_nonzero_and_the_same_reads_whatever_the_layers_and_micro_batches(
    multi30k_tsv, bpe_tokenizer, tmp_path
):
    """The issue's check from outside: nonzero/item/tolist/bool/int/float on tensors counted during train.py's
    steps (in one process), per step. Before the packing was built on the host a step called nonzero() twice per
    micro-batch (and twice more per interleave part): 2, 2, 4 and 16 for the variants here."""
    (counts,) = _counts(1, [], (multi30k_tsv, bpe_tokenizer), tmp_path)
    assert all(c["nonzero"] == 0 for c in counts.values()), counts
    assert len({sum(c.values()) for c in counts.values()}) == 1, counts


@pytest.mark.slow
def test_no_pipeline_stage_calls_nonzero_either(multi30k_tsv, bpe_tokenizer, tmp_path):
    """pp2 on 2 ranks: DeepSpeed hands each stage copies of the ids, and each stage puts the step's host-built
    packings on them (model.pipeline). Before, stage 0 called nonzero() once per micro-batch (source side) and
    stage 1 twice (1, 1, 2, 8 and 2, 2, 4, 16 for the variants here); the reads left are the same on every stage and
    for every variant (the loss, the gradient norm, the stop vote)."""
    per_rank = _counts(2, ["--distribute", "true", "--pipeline_stage", 2], (multi30k_tsv, bpe_tokenizer), tmp_path)
    assert all(c["nonzero"] == 0 for counts in per_rank for c in counts.values()), per_rank
    assert len({sum(c.values()) for counts in per_rank for c in counts.values()}) == 1, per_rank


def test_host_built_packing_is_what_nonzero_finds_and_its_parts_too():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 50, (8, 11), generator=g)
    for row, end in enumerate([3, 11, 0, 7, 1, 11, 5, 9]):
        ids[row, end:] = 0
    device_ids = ids.clone()
    attached = Packing.from_host(ids.numpy(), 0, lambda t: t.clone()).keep_on(device_ids, 0)
    found = Packing(ids, 0)
    assert Packing.of(device_ids, 0) is attached
    assert torch.equal(attached.index, found.index) and attached.tokens == found.tokens
    for n in (2, 4):
        parts = Packing.parts(device_ids, 0, n)
        for part, chunk in zip(parts, ids.chunk(n)):
            ref = Packing(chunk, 0)
            assert torch.equal(part.index, ref.index) and part.tokens == ref.tokens and part.batch == ref.batch


def test_unpack_writes_the_rows_into_zeros_and_passes_their_gradient_back():
    ids = torch.tensor([[5, 6, 0], [7, 0, 0]])
    pack = Packing(ids, 0)
    rows = torch.arange(6.0).reshape(3, 2).requires_grad_()
    out = pack.unpack(rows)
    assert out.tolist() == [[[0, 1], [2, 3], [0, 0]], [[4, 5], [0, 0], [0, 0]]]
    (out * torch.arange(12.0).reshape(2, 3, 2)).sum().backward()
    assert rows.grad.tolist() == [[0, 1], [2, 3], [6, 7]]


def _votes(rank, world):
    from training.run.stop_request import StopRequest

    request = StopRequest()
    if rank == 1:
        request.code = int(signal.SIGTERM)  # noted on one rank during step 1
    after = [request.agreed(torch.device("cpu"), world) for _ in range(2)]
    final = StopRequest()
    if rank == 0:
        final.code = int(signal.SIGUSR1)
    return after, final.agreed(torch.device("cpu"), world, final=True)


def test_the_stop_vote_of_a_step_is_read_after_the_next_and_at_once_after_the_last():
    """The all-reduce started after step k is read after step k+1, so the host does not wait for it behind the
    device's queue; every rank still stops at the same step. The loop's last step reads its vote at once."""
    results = run_ranks(2, _votes)
    for after, final in results:
        assert after == [0, int(signal.SIGTERM)]
        assert final == int(signal.SIGUSR1)
