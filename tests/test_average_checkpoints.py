"""Checkpoint averaging (run_scripts/average_checkpoints.py, training/checkpoint/consolidated.py).

One run saved under two layouts: 4 steps in one process (checkpoints at steps 2 and 4), continued from step 4 on
2 tensor-parallel processes to step 6. Then:
- `--last 2` of the first run equals the elementwise mean of the two checkpoints' fp32 weights, computed here from
  training.checkpoint.manager's full tensors;
- averaging step 4 (1 process) with step 6 (tp2 shards) works and equals the mean too; evaluate.py and
  export_hf.py take the averaged file as --ckpt_file;
- bad input (more checkpoints asked than kept, checkpoints of different models): one `error:` line, nothing written.
"""

import json

import pytest
import torch

from tests.launch import REPO_ROOT, TINY, concurrently, run_tool, run_train

AVERAGE = str(REPO_ROOT / "run_scripts" / "average_checkpoints.py")


def full_weights(step_dir) -> dict:
    from training.checkpoint.format import load_full_state, read_meta

    return {name: v["param"] for name, v in load_full_state(str(step_dir), read_meta(str(step_dir))).items()}


def assert_is_mean(averaged_file, step_dirs):
    got = torch.load(averaged_file, weights_only=True)["model"]
    weights = [full_weights(d) for d in step_dirs]
    assert set(got) == set(weights[0])
    for name, value in got.items():
        expected = torch.stack([w[name] for w in weights]).mean(0)
        assert value.dtype == torch.float32
        torch.testing.assert_close(value, expected, rtol=1e-6, atol=1e-9, msg=name)
    # a real average: the checkpoints differ, and the mean is neither of them
    name = "blocks.1.attn.qkv.weight"
    assert (weights[0][name] - weights[-1][name]).abs().max() > 1e-4
    assert not torch.equal(got[name], weights[0][name]) and not torch.equal(got[name], weights[-1][name])


@pytest.fixture(scope="module")
def two_layouts(multi30k_tsv, bpe_tokenizer, tmp_path_factory):
    serial = tmp_path_factory.mktemp("avg-serial")
    common = [
        "--file_path",
        multi30k_tsv,
        "--tokenizer",
        bpe_tokenizer,
        *TINY,
        "--save_checkpoint_steps",
        2,
        "--keep_checkpoint_max",
        5,
    ]
    run_train(1, [*common, "--output_dir", serial, "--steps", 4])
    tp2 = tmp_path_factory.mktemp("avg-tp2")
    run_train(
        2,
        [
            *common,
            "--output_dir",
            tp2,
            "--mp",
            2,
            "--steps",
            6,
            "--ckpt_file",
            serial / "checkpoints" / "step_00000004",
        ],
    )
    return serial / "checkpoints", tp2 / "checkpoints"


@pytest.mark.slow
def test_average_last_k_is_the_elementwise_mean(two_layouts, tmp_path):
    serial, _ = two_layouts
    out = tmp_path / "avg2.pt"
    proc = run_tool("average_checkpoints.py", serial.parent, "--last", 2, "--output", out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "steps 2, 4" in proc.stdout
    assert_is_mean(out, [serial / "step_00000002", serial / "step_00000004"])


@pytest.mark.slow
def test_average_across_layouts_and_use_it(two_layouts, bpe_tokenizer, multi30k_dir, tmp_path):
    serial, tp2 = two_layouts
    assert json.loads((tp2 / "step_00000006" / "meta.json").read_text())["parallel"]["model_parallel"] == 2
    out = tmp_path / "mixed.pt"
    proc = run_tool("average_checkpoints.py", serial / "step_00000004", tp2 / "step_00000006", "--output", out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_is_mean(out, [serial / "step_00000004", tp2 / "step_00000006"])

    proc = run_tool(
        "evaluate.py",
        "--ckpt_file",
        out,
        "--tokenizer",
        bpe_tokenizer,
        "--src",
        multi30k_dir / "val.fr.gz",
        "--ref",
        multi30k_dir / "val.en.gz",
        "--limit",
        8,
        "--beam",
        2,
        "--no_progress",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.splitlines()[-1])
    assert summary["step"] == 6 and [a["step"] for a in summary["averaged"]] == [4, 6]
    proc = run_tool("export_hf.py", "--ckpt_file", out, "--tokenizer", bpe_tokenizer, "--output", tmp_path / "hf")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "hf" / "config.json").is_file()


@pytest.mark.slow
def test_average_errors_are_one_line(two_layouts, multi30k_tsv, bpe_tokenizer, tmp_path, assert_user_error):
    serial, tp2 = two_layouts
    out = tmp_path / "avg.pt"
    other = tmp_path / "other"
    too_few, _ = concurrently(  # the first case needs nothing of the second's run
        lambda: run_tool("average_checkpoints.py", serial.parent, "--last", 3, "--output", out),
        lambda: run_train(
            1,
            [
                "--file_path",
                multi30k_tsv,
                "--tokenizer",
                bpe_tokenizer,
                *TINY,
                "--d_model",
                16,
                "--steps",
                1,
                "--save_checkpoint_steps",
                1,
                "--output_dir",
                other,
            ],
        ),
    )
    assert_user_error(too_few, "--last 3", "holds 2 complete checkpoint(s)")
    assert_user_error(
        run_tool("average_checkpoints.py", serial / "step_00000004", other, "--output", out),
        "different model",
        "d_model: checkpoint 16 vs now 32",
    )
    assert not out.exists()
