"""Batched greedy decoding for the serial `Seq2SeqTransformer` (inference only; no KV cache).

The encoder runs once per batch; the decoder then runs on the whole growing prefix [BOS, y1, ..., yk] at every
step and the next token is the argmax of the last position's logits. For the tutorial's sizes (tgt_len ≤ a few
dozen) recomputing the prefix is cheap and reuses the training code path unchanged — the same blocks, the same
causal and key-padding masks — so what is decoded is exactly what the teacher-forced forward would predict.

Rows that have produced EOS keep PAD afterwards (PAD keys are masked, so they never influence anything) and the
loop ends as soon as every row is done, or after `max_len` tokens. `max_len` is at most `cfg.tgt_len`: the target
positions are learned embeddings of that many rows, and the decoder input is BOS plus up to max_len-1 tokens.

    from model.generate import greedy_decode
    out = greedy_decode(model, src_ids, bos_id=2, eos_id=3, max_len=model.cfg.tgt_len)   # [B, ≤ max_len]
"""
from __future__ import annotations

from typing import Optional

import torch

from model.transformer import DecoderLayer, Embeddings, EncoderLayer, Head, Seq2SeqTransformer


def _split_blocks(model: Seq2SeqTransformer):
    blocks = list(model.blocks)
    emb, head = blocks[0], blocks[-1]
    enc = [b for b in blocks if isinstance(b, EncoderLayer)]
    dec = [b for b in blocks if isinstance(b, DecoderLayer)]
    if not (isinstance(emb, Embeddings) and isinstance(head, Head) and enc and dec
            and len(enc) + len(dec) + 2 == len(blocks)):
        raise TypeError("greedy_decode needs a serial Seq2SeqTransformer (Embeddings, encoder, decoder, Head)")
    if model.ctx.tp_size != 1:
        raise ValueError(f"greedy_decode runs the serial model; this one is tensor-parallel (tp={model.ctx.tp_size})"
                         f" — merge the checkpoint first (run_scripts/merge_checkpoint.py)")
    return emb, enc, dec, head


@torch.no_grad()
def greedy_decode(model: Seq2SeqTransformer, src_ids: torch.Tensor, bos_id: int, eos_id: int, max_len: int,
                  pad_id: Optional[int] = None, vocab_limit: Optional[int] = None) -> torch.Tensor:
    """Greedy translations of a batch of sources.

    src_ids: [B, S] int64, S ≤ cfg.src_len, laid out as the dataset does (tokens, EOS, then PAD).
    Returns [B, L] int64 with L ≤ max_len: the generated tokens without the leading BOS, each row ending with its
    EOS (if one was produced within max_len tokens) followed by PAD. L is the length of the longest row.

    pad_id (default cfg.pad_id) is never generated — the model is not trained to predict it, and a PAD inside the
    prefix would be masked out of attention. vocab_limit (default: all) restricts generation to ids < vocab_limit,
    e.g. a tokenizer's size when the model's vocabulary is larger. The model is switched to eval mode (no dropout)
    for the call and put back in its previous mode afterwards.
    """
    cfg = model.cfg
    if not 1 <= max_len <= cfg.tgt_len:
        raise ValueError(f"max_len={max_len} must be in [1, tgt_len={cfg.tgt_len}] (learned target positions)")
    if src_ids.dim() != 2 or src_ids.shape[1] > cfg.src_len:
        raise ValueError(f"src_ids must be [B, S≤{cfg.src_len}], got {tuple(src_ids.shape)}")
    pad_id = cfg.pad_id if pad_id is None else pad_id
    emb, enc, dec, head = _split_blocks(model)
    was_training = model.training
    model.eval()
    try:
        device = emb.tgt_pos.device
        src_ids = src_ids.to(device=device, dtype=torch.long)
        bsz = src_ids.shape[0]
        # Encoder once: the tuple protocol of the blocks carries a (here: 1-token dummy) target along.
        ys = torch.full((bsz, 1), bos_id, dtype=torch.long, device=device)
        x = emb((src_ids, ys))
        for block in enc:
            x = block(x)
        _, memory, _, _ = x

        banned = torch.zeros(cfg.vocab_size, dtype=torch.bool, device=device)
        banned[pad_id] = True
        if vocab_limit is not None:
            banned[vocab_limit:] = True
        done = torch.zeros(bsz, dtype=torch.bool, device=device)
        for _ in range(max_len):
            t = ys.shape[1]
            tgt_h = emb.drop(emb.tgt_word(ys) + emb.tgt_pos[:t])
            h = (tgt_h, memory, src_ids, ys)
            for block in dec:
                h = block(h)
            logits = head(h[:, -1])                                 # [B, V] (serial: the whole vocabulary)
            logits = logits[:, : cfg.vocab_size].masked_fill(banned, float("-inf"))
            nxt = logits.argmax(dim=-1)
            nxt = torch.where(done, torch.full_like(nxt, pad_id), nxt)
            ys = torch.cat([ys, nxt[:, None]], dim=1)
            done |= nxt == eos_id
            if bool(done.all()):
                break
        return ys[:, 1:].cpu()
    finally:
        model.train(was_training)
