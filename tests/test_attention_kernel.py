"""Which attention form the training step gives torch: the decoder's packed self-attention is `is_causal` with no
mask tensor (a mask rules out CUDA's flash kernel), and that form is bit-identical on CPU in fp32 to the causal &
key-padding mask it replaced, dropout included; and which kernels torch may choose (not cuDNN's, which plans per
shape)."""

import pytest
import torch
import torch.nn.functional as F

from model.config import ModelConfig
from model.transformer import Seq2SeqTransformer


def test_training_decoder_self_attention_passes_no_mask(monkeypatch):
    cfg = ModelConfig(
        vocab_size=50,
        d_model=32,
        num_heads=4,
        ffn_size=64,
        encoder_layers=2,
        decoder_layers=2,
        src_len=12,
        tgt_len=12,
        dropout=0.1,
        attention_dropout=0.1,
    )
    model = Seq2SeqTransformer(cfg, seed=3)
    calls = []
    real = F.scaled_dot_product_attention

    def recorded(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, **kw):
        calls.append((attn_mask is None, is_causal))
        return real(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, **kw)

    monkeypatch.setattr(F, "scaled_dot_product_attention", recorded)
    g = torch.Generator().manual_seed(0)
    src, tgt, labels = (torch.randint(4, 50, (4, 12), generator=g) for _ in range(3))
    src[0, 6:], tgt[1, 5:], labels[1, 5:] = 0, 0, 0
    model.loss_sum(src, tgt, labels).backward()
    # per layer: encoder self (mask) ×2, then per decoder layer self (no mask, causal) and cross (mask)
    assert calls == [(False, False)] * 2 + [(True, True), (False, False)] * 2


def test_building_the_model_takes_cudnn_attention_out_of_torchs_choice():
    """cuDNN's attention builds a plan per input shape (token batches: a new shape nearly every step; 2.1× slower
    steps on an H200, GPU_RESULTS.md 2026-11-28). The flag is process-wide and read on CUDA only; set on any device."""
    torch.backends.cuda.enable_cudnn_sdp(True)
    try:
        Seq2SeqTransformer(
            ModelConfig(
                vocab_size=50,
                d_model=32,
                num_heads=4,
                ffn_size=64,
                encoder_layers=1,
                decoder_layers=1,
                src_len=12,
                tgt_len=12,
            ),
            seed=3,
        )
        assert not torch.backends.cuda.cudnn_sdp_enabled()
    finally:
        torch.backends.cuda.enable_cudnn_sdp(False)


@pytest.mark.parametrize("dropout", [0.0, 0.1])
@pytest.mark.parametrize("shape", [(8, 4, 12, 8), (16, 16, 40, 64), (3, 2, 7, 16)])
def test_is_causal_equals_the_causal_and_padding_mask_on_right_padded_rows(shape, dropout):
    batch, heads, length, dim = shape
    g = torch.Generator().manual_seed(sum(shape))
    lengths = torch.randint(1, length + 1, (batch,), generator=g)
    real = torch.arange(length)[None] < lengths[:, None]
    keep = real[:, None, :, None]
    q, k, v = (torch.randn(batch, heads, length, dim, generator=g) * keep for _ in range(3))
    upstream = torch.randn(batch, heads, length, dim, generator=g) * keep  # PAD queries are dropped by pack
    mask = torch.ones(length, length, dtype=torch.bool).tril()[None, None] & real[:, None, None, :]
    results = []
    for kwargs in (dict(attn_mask=mask), dict(is_causal=True)):
        qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
        torch.manual_seed(5)
        out = F.scaled_dot_product_attention(qq, kk, vv, dropout_p=dropout, **kwargs)
        (out * upstream).sum().backward()
        results.append((out.detach() * keep, qq.grad, kk.grad, vv.grad))
    assert all(torch.equal(a, b) for a, b in zip(*results))
