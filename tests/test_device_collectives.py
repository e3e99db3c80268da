"""No host tensor ever reaches a collective: nccl takes device tensors only, gloo on a CPU takes anything.

`tests.device_check.HostTensorChecker` tells the engine's device from the host by provenance (see its docstring) and
fails any torch.distributed call handed a host tensor. First proof that it catches the bug it exists for (the loss
reduction this repository used to do on a host float64 tensor), then every training path — train and eval steps,
each ZeRO stage, pipelines, tensor parallelism, fp32/bf16/fp16, clipping, checkpoint save and load — runs under it
on 2 and 4 processes.
"""

import re

import pytest
import torch
import torch.distributed as dist

from tests import accelerator
from tests.device_check import HostTensorChecker, HostTensorInCollective
from tests.launch import TINY, run_many
from tests.multiproc import run_ranks


def _host_reduction_is_caught(rank, world):
    checker = HostTensorChecker("cpu").install()
    try:
        model = torch.nn.Linear(3, 1).to("cpu")  # engine-side: moved to the device
        loss = model(torch.ones(2, 3).to("cpu")).sum()
        # the old training/core/step.py:_dp_mean, verbatim in spirit: a host float64 accumulator, all-reduced
        total = torch.zeros((), dtype=torch.float64)
        total += loss.detach().double().cpu()
        value = (total / 1).to(torch.float64)
        with pytest.raises(HostTensorInCollective, match="all_reduce was given a host tensor"):
            dist.all_reduce(value)
        # today's rule (training.core.objective.GlobalTokenMean.reported) keeps the reduction on the engine's device
        from training.core.objective import GlobalTokenMean

        return GlobalTokenMean(dp_size=world, micro_batches=1).reported([loss], None), checker.checked
    finally:
        checker.uninstall()


def test_checker_catches_a_host_tensor_in_a_collective():
    results = run_ranks(2, _host_reduction_is_caught)
    (value0, checked0), (value1, _) = results
    assert value0 == value1 and checked0 == 1


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [2, 4])
def test_every_training_path_keeps_collectives_on_the_device(nproc, multi30k_tsv, bpe_tokenizer, tmp_path):
    base = ["--file_path", multi30k_tsv, "--tokenizer", bpe_tokenizer, *TINY, "--steps", 3]

    def run(name, *flags):
        return base + ["--output_dir", tmp_path / name, *flags]

    if nproc == 2:
        runs = [
            run("dp2", "--save_checkpoint_steps", 3, "--clip_grad", 0.5),
            run("dp2-eval", "--train", 0, "--ckpt_file", tmp_path / "dp2"),
            *(
                [run("dp2-zero1-fp16", "--zero_stage", 1, "--precision", "fp16")]
                if accelerator.supported("fp16")
                else []
            ),  # fp16 only where the CPU computes in it
            run("dp2-zero2-bf16", "--zero_stage", 2, "--precision", "bf16", "--clip_grad", 0.5),
            run("dp2-zero3", "--zero_stage", 3, "--save_checkpoint_steps", 3),
            run("dp2-zero3-resume", "--zero_stage", 3, "--steps", 4, "--ckpt_file", tmp_path / "dp2-zero3"),
            run(
                "pp2-bf16",
                "--pipeline_stage",
                2,
                "--micro_batch_num",
                2,
                "--precision",
                "bf16",
                "--clip_grad",
                0.5,
                "--save_checkpoint_steps",
                3,
            ),
            run(
                "share-pp2",
                "--share_embeddings",
                1,
                "--pipeline_stage",
                2,
                "--micro_batch_num",
                2,
                "--save_checkpoint_steps",
                3,
            ),
            run(
                "share-pp2-to-tp2",
                "--share_embeddings",
                1,
                "--mp",
                2,
                "--vocab_emb_dp",
                0,
                "--steps",
                4,
                "--ckpt_file",
                tmp_path / "share-pp2",
            ),
            run("tp2", "--mp", 2, "--dropout", 0.1, "--save_checkpoint_steps", 3),
            run("tp2-resume", "--mp", 2, "--dropout", 0.1, "--steps", 4, "--ckpt_file", tmp_path / "tp2"),
        ]
    else:  # the pipeline engine's data-parallel loss reduction, a 3-axis checkpoint round trip, split boundaries
        runs = [
            run(
                "dp2xpp2-zero1",
                "--pipeline_stage",
                2,
                "--micro_batch_num",
                2,
                "--zero_stage",
                1,
                "--clip_grad",
                0.5,
                "--save_checkpoint_steps",
                3,
            ),
            run(
                "dp2xpp2-resume",
                "--pipeline_stage",
                2,
                "--micro_batch_num",
                2,
                "--zero_stage",
                1,
                "--steps",
                4,
                "--ckpt_file",
                tmp_path / "dp2xpp2-zero1",
            ),
            run("dp2xtp2-bf16", "--mp", 2, "--precision", "bf16"),
            # stage boundaries split over the TP ranks and all-gathered by the receiving stage (pipe_partitioned)
            run("tp2xpp2", "--mp", 2, "--pipeline_stage", 2, "--micro_batch_num", 2),
        ]
    proc = run_many(nproc, runs, tmp_path, "--check_devices")
    counts = [int(n) for n in re.findall(r"device check: (\d+) collective calls", proc.stdout)]
    assert len(counts) == nproc and min(counts) > 100, proc.stdout[-2000:]
