"""The GPU tier: what only a GPU shows — nccl, bf16 and fp16 on CUDA kernels, train → save → resume.

Skipped on a machine without CUDA (CI has none). Run it on a GPU machine with `python -m pytest -q tests/test_gpu.py
-s`; GPU_RESULTS.md records the last run's figures. With one GPU the layouts are single-process (nccl with world
size 1: the backend, its device-tensor rule and every CUDA kernel are real, the multi-rank traffic is not); with two
or more GPUs the data- and tensor-parallel cases run too.
"""

import pytest
import torch

from tests.launch import TINY, read_metrics, run_train

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the GPU tier)")

STEPS, CUT = 20, 10
HALF_LOSS_TOL = 5e-4  # the same bound as tests/test_parity.py: bf16/fp16 rounding vs fp32


def _train(nproc, data, out, *flags, check=True):
    tsv, tok = data
    return run_train(
        nproc,
        [
            "--file_path",
            tsv,
            "--tokenizer",
            tok,
            "--output_dir",
            out,
            *TINY,
            "--steps",
            STEPS,
            "--clip_grad",
            0.5,
            "--save_checkpoint_steps",
            CUT,
            "--keep_checkpoint_max",
            4,
            *flags,
        ],
        check=check,
    )


@pytest.fixture(scope="module")
def data(multi30k_tsv, bpe_tokenizer):
    return multi30k_tsv, bpe_tokenizer


@pytest.fixture(scope="module")
def fp32_run(data, tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu-fp32")
    proc = _train(1, data, out, "--precision", "fp32")
    assert "backend=nccl" in proc.stdout and "device=cuda" in proc.stdout, proc.stdout[-2000:]
    return read_metrics(out)


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_train_save_resume_on_gpu(precision, data, fp32_run, tmp_path):
    first = tmp_path / "uninterrupted"
    _train(1, data, first, "--precision", precision)
    full = read_metrics(first)
    assert len(full) == STEPS and full[-1]["loss"] < full[0]["loss"] - 0.5
    worst = max(abs(a["loss"] - b["loss"]) / b["loss"] for a, b in zip(full, fp32_run))
    print(
        f"GPU {precision}: final loss {full[-1]['loss']:.4f}, worst relative difference from fp32 {worst:.2e}, "
        f"median step {sorted(r['step_time'] for r in full)[STEPS // 2] * 1000:.1f} ms"
    )
    assert worst <= (1e-5 if precision == "fp32" else HALF_LOSS_TOL)
    if precision == "fp16":
        assert all(r["loss_scale"] >= 1 for r in full)
    # resume from step CUT in a fresh directory: the continuation is the uninterrupted run's — the first resumed
    # step to fp32 rounding, later ones to the run-to-run noise of CUDA's atomic-add backward kernels
    resumed = tmp_path / "resumed"
    _train(1, data, resumed, "--precision", precision, "--ckpt_file", first / "checkpoints" / f"step_{CUT:08d}")
    again = [r["loss"] for r in read_metrics(resumed)]
    expected = [r["loss"] for r in full[CUT:]]
    drift = [abs(a - b) / b for a, b in zip(again, expected)]
    print(f"GPU {precision} resume at step {CUT}: first step rel {drift[0]:.2e}, worst {max(drift):.2e}")
    assert len(again) == STEPS - CUT and drift[0] <= 1e-6 and max(drift) <= HALF_LOSS_TOL


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (nccl over several ranks)")
@pytest.mark.parametrize(
    "flags", [[], ["--mp", "2"], ["--pipeline_stage", "2", "--micro_batch_num", "2"]], ids=["dp2", "tp2", "pp2"]
)
def test_two_gpu_layouts_match_one_gpu(flags, data, fp32_run, tmp_path):
    _train(2, data, tmp_path, "--precision", "fp32", *flags)
    got = read_metrics(tmp_path)
    worst = max(abs(a["loss"] - b["loss"]) / b["loss"] for a, b in zip(got, fp32_run))
    assert worst <= 1e-5


def test_greedy_decoding_reads_the_gpu_once_per_eight_tokens():
    """Greedy decoding looks at the batch on the host once per SYNC_EVERY tokens (to stop or drop finished rows),
    not twice per token; counted with torch's sync debug mode, which warns at every synchronizing CUDA call."""
    import warnings

    from model.config import ModelConfig
    from model.inference import SYNC_EVERY, greedy_decode
    from model.transformer import Seq2SeqTransformer

    cfg = ModelConfig(
        vocab_size=50,
        d_model=32,
        num_heads=4,
        ffn_size=64,
        encoder_layers=1,
        decoder_layers=1,
        src_len=12,
        tgt_len=32,
        dropout=0.0,
        attention_dropout=0.0,
    )
    model = Seq2SeqTransformer(cfg, seed=3).cuda()
    src = torch.randint(4, 50, (6, 12), device="cuda")
    greedy_decode(model, src, bos_id=2, eos_id=3, max_len=32)  # warm-up: kernels, allocator
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            greedy_decode(model, src, bos_id=2, eos_id=3, max_len=32)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    syncs = [w for w in caught if "synchroniz" in str(w.message)]
    print(f"greedy decode of 32 tokens: {len(syncs)} synchronizing calls")
    assert len(syncs) <= 2 * (32 // SYNC_EVERY) + 4, [str(w.message) for w in syncs]


def _training_step_syncs(layers: int) -> int:
    """Synchronizing CUDA calls in one training step (2 micro-batches, forward and backward, fused AdamW) of a
    `layers`+`layers` model with interleave_num 2, recompute and dropout, after a warm-up step."""
    import warnings

    from model.config import ModelConfig, ParallelConfig
    from model.transformer import Seq2SeqTransformer

    cfg = ModelConfig(
        vocab_size=50,
        d_model=32,
        num_heads=4,
        ffn_size=64,
        encoder_layers=layers,
        decoder_layers=layers,
        src_len=12,
        tgt_len=12,
        dropout=0.1,
        attention_dropout=0.1,
    )
    model = Seq2SeqTransformer(cfg, ParallelConfig(interleave_num=2, recompute=True), seed=3).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    g = torch.Generator().manual_seed(0)
    micro = []
    for _ in range(2):
        src, tgt, labels = (torch.randint(4, 50, (8, 12), generator=g) for _ in range(3))
        src[0, 6:], tgt[1, 5:], labels[1, 5:] = 0, 0, 0
        micro.append(tuple(t.cuda() for t in (src, tgt, labels)))

    def step():
        for src, tgt, labels in micro:
            model.loss_sum(src, tgt, labels).backward()
        opt.step()
        opt.zero_grad()

    step()  # warm-up: kernels, allocator, optimizer state
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def test_a_training_steps_host_syncs_do_not_grow_with_the_layers():
    """The host waits for the GPU once per micro-batch, interleave part and side (finding the real tokens,
    `model.packing`), never per layer or recomputation: a 4+4-layer model's training step synchronizes exactly as
    often as a 2+2-layer one's. (On CPU the same count is checked by tests/test_interleave.py.)"""
    small, large = _training_step_syncs(2), _training_step_syncs(4)
    print(
        f"one training step, 2 micro-batches, interleave 2, recompute: {small} synchronizing calls with 2+2 "
        f"layers, {large} with 4+4"
    )
    assert large == small, (small, large)


def test_host_batches_reach_the_gpu_through_pinned_memory():
    """A batch goes to the GPU from page-locked memory (`training.core.data.to_device`), a DMA the host does not wait
    for; from pageable memory the driver stages it synchronously. The CUDA trace names the copy's source."""
    from torch.profiler import ProfilerActivity, profile

    from training.core.data import to_device

    host = torch.randint(0, 8000, (64, 128))
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        on_gpu = to_device(host, torch.device("cuda"))
        torch.cuda.synchronize()
    copies = [e.name for e in prof.events() if "Memcpy HtoD" in e.name]
    assert copies and all("Pinned" in name for name in copies), copies
    assert torch.equal(on_gpu.cpu(), host)
