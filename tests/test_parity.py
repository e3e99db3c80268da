"""Every parallel layout trains exactly like one process: fp32, dropout 0, same seed and global batch, 20 steps.

A declarative list of (name, processes, flags), as torchtitan's integration tests. Each case runs train.py through
DeepSpeed's real launcher on CPU (gloo) and compares its per-step loss with the single-process run: step 1 within
1e-6 relative, every step within 1e-4.
"""
import pytest

from tests.launch import TINY, losses, run_train

STEPS = 20

LAYOUTS = [
    # name                      procs  flags
    ("dp2",                         2, []),
    ("dp2-zero1",                   2, ["--enable_parallel_optimizer", "1"]),
    ("dp2-zero2",                   2, ["--zero_stage", "2"]),
    ("dp2-zero3",                   2, ["--zero_stage", "3"]),
    ("tp2",                         2, ["--mp", "2"]),
    ("tp2-recompute",               2, ["--mp", "2", "--recompute", "1"]),
    ("pp2-mb4",                     2, ["--pipeline_stage", "2", "--micro_batch_num", "4"]),
    ("pp2-mb4-recompute",           2, ["--pipeline_stage", "2", "--micro_batch_num", "4", "--recompute", "1"]),
    ("dp2xtp2",                     4, ["--mp", "2"]),
    ("dp2xpp2-zero1",               4, ["--pipeline_stage", "2", "--micro_batch_num", "2",
                                        "--enable_parallel_optimizer", "1"]),
    ("tp2xpp2-mb2",                 4, ["--mp", "2", "--pipeline_stage", "2", "--micro_batch_num", "2"]),
    ("dp2xtp2xpp2-zero1-recompute", 8, ["--mp", "2", "--pipeline_stage", "2", "--micro_batch_num", "2",
                                        "--enable_parallel_optimizer", "1", "--recompute", "1"]),
]


@pytest.fixture(scope="module")
def reference(multi30k_tsv, bpe_tokenizer, tmp_path_factory):
    out = tmp_path_factory.mktemp("serial")
    run_train(1, ["--file_path", multi30k_tsv, "--tokenizer", bpe_tokenizer, "--steps", STEPS,
                  "--output_dir", out, *TINY])
    ref = losses(out)
    assert len(ref) == STEPS and ref[-1] < ref[0] - 0.5, ref     # it learns
    return ref


def worst_relative(a, b):
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


@pytest.mark.slow
@pytest.mark.parametrize("name,nproc,flags", LAYOUTS, ids=[c[0] for c in LAYOUTS])
def test_layout_matches_single_process(name, nproc, flags, reference, multi30k_tsv, bpe_tokenizer, tmp_path):
    run_train(nproc, ["--file_path", multi30k_tsv, "--tokenizer", bpe_tokenizer, "--steps", STEPS,
                      "--output_dir", tmp_path, *TINY, *flags])
    got = losses(tmp_path)
    assert len(got) == STEPS
    first = abs(got[0] - reference[0]) / reference[0]
    worst = worst_relative(got, reference)
    print(f"PARITY {name}: first-step rel {first:.2e}, worst rel over {STEPS} steps {worst:.2e}")
    assert first <= 1e-6, (got[0], reference[0])
    assert worst <= 1e-4, list(zip(got, reference))
