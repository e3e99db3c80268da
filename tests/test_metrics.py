"""What train.py reports per step beyond the loss: padding, achieved FLOP/s, MFU (only where the peak is known) and
peak memory — checked against the data and the cost model independently of how train.py computed them."""
import numpy as np

from model.config import ModelConfig
from preprocess.textio import read_tsv_pairs
from preprocess.tokenizer import load_tokenizer
from preprocess.token_batches import TokenBatchSchedule
from tests.launch import TINY, read_metrics, run_train
from model.costs import model_flops


def test_step_metrics_padding_flops_memory(multi30k_tsv, bpe_tokenizer, tmp_path):
    flags = ["--file_path", multi30k_tsv, "--tokenizer", bpe_tokenizer, "--output_dir", tmp_path, *TINY,
             "--max_tokens", "256", "--batch_multiple", "8", "--steps", 4]
    run_train(1, flags)
    records = read_metrics(tmp_path)
    src_len = tgt_len = int(TINY[TINY.index("--src_len") + 1])
    # the real lengths from the tokenizer's untruncated counts (not from the token store train.py reads)
    tok = load_tokenizer(bpe_tokenizer)
    counts = [np.array([len(e.ids) for e in tok.encode_batch(side, add_special_tokens=False)])
              for side in read_tsv_pairs(multi30k_tsv)]
    src_real = np.minimum(counts[0] + 1, src_len)
    tgt_real = np.minimum(counts[1] + 1, tgt_len)
    sched = TokenBatchSchedule(src_real, tgt_real, 256, 8, int(TINY[TINY.index("--seed") + 1]), src_len, tgt_len)
    cfg = ModelConfig(vocab_size=8000, d_model=32, num_heads=4, ffn_size=64, encoder_layers=2, decoder_layers=2,
                      src_len=src_len, tgt_len=tgt_len)
    for step, r in enumerate(records):
        idx = sched.global_batch(step)
        s, t = sched.shape(step)
        n_src, n_tgt = int(src_real[idx].sum()), int(tgt_real[idx].sum())
        assert r["tokens"] == n_tgt
        assert abs(r["padding"] - (1 - (n_src + n_tgt) / (len(idx) * (s + t)))) < 1e-4
        flops = model_flops(cfg, n_src, n_tgt, len(idx), s, t)
        assert abs(r["tflops"] * 1e12 * r["step_time"] / flops - 1) < 1e-6
        assert "mfu" not in r                                   # a CPU: no peak to divide by, none guessed
        assert 100 < r["peak_mem_mib"] < 8000
    assert len({r["padding"] for r in records}) > 1             # token batches: each its own padding
