"""The serial model as a `transformers` BlenderbotForConditionalGeneration: same weights, same function.

Blenderbot (the 3B/9B variant, not blenderbot-small) is a pre-LN encoder-decoder like ours, detail for detail:

    ours                                         Blenderbot config / module
    word + learned position, no scaling          scale_embedding=False; positions from 0 (no offset, unlike BART)
    src_len / tgt_len position rows              max_position_embeddings = max of both; the shorter table is padded
                                                 with zero rows that a source/target within our lengths never reads
    separate src / tgt / output tables           tie_word_embeddings=False (share_embeddings: True, one `shared`)
    pre-LN self-attn, [cross-attn,] GELU MLP     *_layer_norm before each sublayer; activation_function="gelu" (erf)
    fused qkv / kv projections (rows: head,      q_proj, k_proj, v_proj (with bias), split back per head
      {q,k,v}, head_dim)
    SDPA with scale head_dim ** -0.5             attention `scaling` = head_dim ** -0.5
    encoder's final LayerNorm                    encoder.layer_norm
    Head: LayerNorm + projection without bias    decoder.layer_norm + lm_head (bias-free) + final_logits_bias = 0
    LayerNorm eps 1e-5                           nn.LayerNorm default eps 1e-5
    dropout (embeddings, sublayer outputs),      dropout, attention_dropout; activation_dropout=0 and no layerdrop
      attention dropout, none inside the MLP       (both off in eval mode, which from_pretrained sets)
    BOS starts the decoder; PAD never generated  decoder_start_token_id=bos; suppress_tokens=[pad, ...]
    no forced EOS, no n-gram blocking            forced_eos_token_id=None, (encoder_)no_repeat_ngram_size=0
    max_len = tgt_len generated tokens           max_new_tokens = tgt_len
    beam search as in model.inference            num_beams, early_stopping=True, length_penalty = ours

tests/test_hf_export.py checks the logits, greedy and beam outputs of the loaded folder against ours.
"""

from __future__ import annotations

import torch

from model.config import ModelConfig
from model.inference import serial_parts
from model.transformer import ParallelAttention, Seq2SeqTransformer

ARCHITECTURE = "BlenderbotForConditionalGeneration"


def blenderbot_config(cfg: ModelConfig, bos_id: int, eos_id: int, pad_id: int):
    from transformers import BlenderbotConfig

    return BlenderbotConfig(
        vocab_size=cfg.vocab_size,
        d_model=cfg.d_model,
        max_position_embeddings=max(cfg.src_len, cfg.tgt_len),
        encoder_layers=cfg.encoder_layers,
        decoder_layers=cfg.decoder_layers,
        encoder_attention_heads=cfg.num_heads,
        decoder_attention_heads=cfg.num_heads,
        encoder_ffn_dim=cfg.ffn,
        decoder_ffn_dim=cfg.ffn,
        activation_function="gelu",
        dropout=cfg.dropout,
        attention_dropout=cfg.attention_dropout,
        activation_dropout=0.0,
        encoder_layerdrop=0.0,
        decoder_layerdrop=0.0,
        init_std=cfg.init_std,
        scale_embedding=False,
        pad_token_id=pad_id,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        decoder_start_token_id=bos_id,
        forced_eos_token_id=None,
        encoder_no_repeat_ngram_size=0,
        tie_word_embeddings=cfg.share_embeddings,
        is_encoder_decoder=True,
        use_cache=True,
        architectures=[ARCHITECTURE],
    )


def generation_config(
    cfg: ModelConfig,
    bos_id: int,
    eos_id: int,
    pad_id: int,
    vocab_limit: int | None = None,
    beam: int = 5,
    length_penalty: float = 1.0,
):
    """`generate()` defaults that decode as model.inference does: our beam search (early_stopping=True), or greedy
    for beam 1 — transformers refuses to save early_stopping with num_beams=1, so a greedy export needs
    `generate(num_beams=N, early_stopping=True)` to beam-search as we do."""
    from transformers import GenerationConfig

    suppress = [pad_id] + list(range(vocab_limit or cfg.vocab_size, cfg.vocab_size))
    beam_options = {"early_stopping": True, "length_penalty": length_penalty} if beam > 1 else {}
    return GenerationConfig(
        decoder_start_token_id=bos_id,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        max_new_tokens=cfg.tgt_len,
        num_beams=beam,
        do_sample=False,
        suppress_tokens=suppress,
        forced_eos_token_id=None,
        forced_bos_token_id=None,
        no_repeat_ngram_size=0,
        encoder_no_repeat_ngram_size=0,
        **beam_options,
    )


def _attention(attn: ParallelAttention, prefix: str) -> dict:
    """Our fused projection rows are (head, part, head_dim); HF has one [d, d] projection per part."""
    heads, hd = attn.heads, attn.head_dim
    if attn.cross:
        parts = {"q": (attn.q, 0, 1), "k": (attn.kv, 0, 2), "v": (attn.kv, 1, 2)}
    else:
        parts = {"q": (attn.qkv, 0, 3), "k": (attn.qkv, 1, 3), "v": (attn.qkv, 2, 3)}
    out = {}
    for name, (linear, part, count) in parts.items():
        w, b = linear.weight.detach(), linear.bias.detach()
        out[f"{prefix}.{name}_proj.weight"] = w.view(heads, count, hd, -1)[:, part].reshape(heads * hd, -1)
        out[f"{prefix}.{name}_proj.bias"] = b.view(heads, count, hd)[:, part].reshape(heads * hd)
    out[f"{prefix}.out_proj.weight"] = attn.out.weight.detach()
    out[f"{prefix}.out_proj.bias"] = attn.out.bias.detach()
    return out


def _norm(ln, prefix: str) -> dict:
    return {f"{prefix}.weight": ln.weight.detach(), f"{prefix}.bias": ln.bias.detach()}


def _mlp(mlp, prefix: str) -> dict:
    return {
        f"{prefix}.fc1.weight": mlp.fc1.weight.detach(),
        f"{prefix}.fc1.bias": mlp.fc1.bias.detach(),
        f"{prefix}.fc2.weight": mlp.fc2.weight.detach(),
        f"{prefix}.fc2.bias": mlp.fc2.bias.detach(),
    }


def _positions(table: torch.Tensor, rows: int) -> torch.Tensor:
    table = table.detach()
    return (
        torch.cat([table, table.new_zeros(rows - table.shape[0], table.shape[1])]) if rows > table.shape[0] else table
    )


def blenderbot_state_dict(model: Seq2SeqTransformer) -> dict:
    """Our serial model's parameters under BlenderbotForConditionalGeneration's names (tied names once)."""
    emb, enc, dec, head = serial_parts(model)
    cfg = model.cfg
    rows = max(cfg.src_len, cfg.tgt_len)
    sd = {
        "model.shared.weight": emb.source_table.weight.detach(),
        "model.encoder.embed_positions.weight": _positions(emb.src_pos, rows),
        "model.decoder.embed_positions.weight": _positions(emb.tgt_pos, rows),
        "final_logits_bias": torch.zeros(1, cfg.vocab_size),
    }
    if not cfg.share_embeddings:
        sd["model.encoder.embed_tokens.weight"] = emb.source_table.weight.detach()
        sd["model.decoder.embed_tokens.weight"] = emb.target_table.weight.detach()
        sd["lm_head.weight"] = head.proj.weight.detach()
    for i, layer in enumerate(enc):
        p = f"model.encoder.layers.{i}"
        sd.update(_norm(layer.ln1, f"{p}.self_attn_layer_norm"))
        sd.update(_attention(layer.attn, f"{p}.self_attn"))
        sd.update(_norm(layer.ln2, f"{p}.final_layer_norm"))
        sd.update(_mlp(layer.mlp, p))
    sd.update(_norm(enc[-1].final_ln, "model.encoder.layer_norm"))
    for i, layer in enumerate(dec):
        p = f"model.decoder.layers.{i}"
        sd.update(_norm(layer.ln1, f"{p}.self_attn_layer_norm"))
        sd.update(_attention(layer.self_attn, f"{p}.self_attn"))
        sd.update(_norm(layer.ln2, f"{p}.encoder_attn_layer_norm"))
        sd.update(_attention(layer.cross_attn, f"{p}.encoder_attn"))
        sd.update(_norm(layer.ln3, f"{p}.final_layer_norm"))
        sd.update(_mlp(layer.mlp, p))
    sd.update(_norm(head.ln, "model.decoder.layer_norm"))
    return {name: t.float().contiguous().clone() for name, t in sd.items()}


def to_blenderbot(
    model: Seq2SeqTransformer,
    bos_id: int,
    eos_id: int,
    pad_id: int,
    vocab_limit: int | None = None,
    beam: int = 5,
    length_penalty: float = 1.0,
):
    """A BlenderbotForConditionalGeneration (fp32, eval mode) holding our weights, with our decoding defaults."""
    from transformers import BlenderbotForConditionalGeneration

    hf = BlenderbotForConditionalGeneration(blenderbot_config(model.cfg, bos_id, eos_id, pad_id))
    missing, unexpected = hf.load_state_dict(blenderbot_state_dict(model), strict=False)
    tied = {"model.encoder.embed_tokens.weight", "model.decoder.embed_tokens.weight", "lm_head.weight"}
    missing = [k for k in missing if not (model.cfg.share_embeddings and k in tied)]
    if missing or unexpected:  # our mapping and this transformers version disagree: fail loudly
        raise RuntimeError(f"Blenderbot state dict mismatch: missing {missing}, unexpected {unexpected}")
    hf.generation_config = generation_config(model.cfg, bos_id, eos_id, pad_id, vocab_limit, beam, length_penalty)
    return hf.eval()
