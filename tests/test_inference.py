"""Incremental decoding (model/inference.py) against the teacher-forced forward, and greedy vs beam search.

- a cached step's logits equal the full-prefix forward's at that position (float64: 1e-12, float32: 1e-5), with
  separate and with shared embeddings;
- cached greedy/beam decoding gives the same tokens as the uncached one (the whole prefix recomputed each step, the
  old model/generate.py), and beam 1 gives greedy's tokens;
- beam search is independent of the batch (a sentence alone decodes as in its batch) and honours max_len/PAD;
- the sources of a Translator are the dataset's source rows (tokens, EOS), longer ones counted.
Beam search's semantics (what it returns for a length penalty) are checked against transformers' generate() in
tests/test_hf_export.py.
"""

import pytest
import torch

from model.config import ModelConfig
from model.inference import DecoderState, beam_decode, greedy_decode
from model.transformer import Seq2SeqTransformer

PAD, UNK, BOS, EOS = 0, 1, 2, 3
B, S, T, V = 6, 7, 9, 14


def tiny_model(seed: int, share: bool = False, dtype=torch.float64) -> Seq2SeqTransformer:
    # init_std 0.5: well-separated logits; dropout on, to check that decoding runs in eval mode
    cfg = ModelConfig(
        vocab_size=V,
        d_model=16,
        num_heads=4,
        ffn_size=24,
        encoder_layers=2,
        decoder_layers=2,
        src_len=S,
        tgt_len=T,
        dropout=0.1,
        attention_dropout=0.1,
        init_std=0.5,
        pad_id=PAD,
        share_embeddings=share,
    )
    return Seq2SeqTransformer(cfg, seed=seed).to(dtype)


def sources(seed: int, rows: int = B) -> torch.Tensor:
    """Dataset layout: tokens, EOS, PAD — rows of different lengths."""
    g = torch.Generator().manual_seed(seed)
    src = torch.full((rows, S), PAD)
    for i in range(rows):
        n = 1 + i % (S - 1)
        src[i, :n] = torch.randint(4, V, (n,), generator=g)
        src[i, n] = EOS
    return src


def full_logits(model, src, tgt) -> torch.Tensor:
    """Teacher-forced logits at every target position: the blocks as training runs them, the Head on the last
    decoder block's hidden states."""
    x = (src, tgt)
    for block in model.blocks[:-1]:
        x = block(x)
    return model.blocks[-1](x if isinstance(x, torch.Tensor) else x[0])


@pytest.mark.parametrize("share", [False, True])
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
def test_cached_step_logits_equal_the_full_prefix_forward(share, dtype, tol):
    model = tiny_model(0, share, dtype).eval()
    src = sources(0)
    g = torch.Generator().manual_seed(1)
    tgt = torch.randint(4, V, (B, T), generator=g)
    tgt[:, 0] = BOS
    with torch.no_grad():
        reference = full_logits(model, src, tgt)  # [B, T, V], one pass
        state = DecoderState(model, src, use_cache=True)
        for t in range(1, T + 1):
            step = state.next_logits(tgt[:, :t])  # one new position per call
            assert state.caches[0].self_attn.length == t
            err = (step - reference[:, t - 1]).abs().max().item()
            assert err <= tol * reference.abs().max().item(), f"position {t - 1}: {err}"


def test_decoding_with_rows_leaving_equals_the_teacher_forced_forward():
    """A cache that dropped and reordered rows still continues each row exactly."""
    model = tiny_model(3).eval()
    src = sources(3)
    g = torch.Generator().manual_seed(5)
    tgt = torch.randint(4, V, (B, T), generator=g)
    tgt[:, 0] = BOS
    with torch.no_grad():
        reference = full_logits(model, src, tgt)
        state = DecoderState(model, src)
        rows = torch.arange(B)
        for t in range(1, T + 1):
            step = state.next_logits(tgt[rows, :t])
            assert (step - reference[rows, t - 1]).abs().max().item() < 1e-12
            if t in (3, 6):  # drop the first row, reverse the rest
                keep = torch.arange(len(rows) - 1, 0, -1)
                rows = rows[keep]
                state.select(keep)


@pytest.mark.parametrize("share", [False, True])
def test_cached_decoding_gives_the_uncached_tokens_and_beam_1_is_greedy(share):
    ended = 0
    for seed in range(6):
        model = tiny_model(seed, share, torch.float32)
        src = sources(seed)
        greedy = greedy_decode(model, src, BOS, EOS, T)
        assert torch.equal(greedy, greedy_decode(model, src, BOS, EOS, T, use_cache=False)), seed
        assert torch.equal(greedy, beam_decode(model, src, BOS, EOS, T, beam=1)), seed
        for lenpen in (0.0, 1.0, 2.0):
            beam = beam_decode(model, src, BOS, EOS, T, beam=3, length_penalty=lenpen)
            assert torch.equal(
                beam, beam_decode(model, src, BOS, EOS, T, beam=3, length_penalty=lenpen, use_cache=False)
            ), (seed, lenpen)
            ended += int((beam == EOS).any(1).sum())
        assert model.training  # the caller's mode is restored
    assert ended > 0  # some hypotheses ended with EOS


def test_beam_search_is_batch_independent_and_respects_max_len_and_pad():
    model = tiny_model(4, dtype=torch.float32)
    src = sources(4)
    for max_len in (1, 4, T):
        out = beam_decode(model, src, BOS, EOS, max_len, beam=4, length_penalty=1.0)
        assert out.dtype == torch.long and out.shape[0] == B and out.shape[1] <= max_len
        for i, row in enumerate(out.tolist()):
            n = row.index(EOS) + 1 if EOS in row else len(row)
            assert PAD not in row[:n] and all(t == PAD for t in row[n:])
            alone = beam_decode(model, src[i : i + 1], BOS, EOS, max_len, beam=4, length_penalty=1.0)[0].tolist()
            assert alone == row[: len(alone)] and all(t == PAD for t in row[len(alone) :]), (max_len, i)
    out = beam_decode(model, src, BOS, EOS, T, beam=4, vocab_limit=6)  # ids >= 6 may not be generated
    assert bool((out < 6).all())
    with pytest.raises(ValueError, match="beam=0"):
        beam_decode(model, src, BOS, EOS, T, beam=0)


def test_translator_sources_are_the_dataset_rows(multi30k_dataset_factory, multi30k_tsv, bpe_tokenizer):
    """encode_sources lays out a source as preprocess.dataset does, and names exactly the lines it had to cut."""
    from preprocess.textio import read_tsv_pairs
    from preprocess.tokenizer import encode_sources, load_tokenizer

    data = multi30k_dataset_factory(12, 12)
    lines = read_tsv_pairs(multi30k_tsv)[0][:300]
    rows, cut = encode_sources(load_tokenizer(bpe_tokenizer), lines, 12, data.eos_id)
    for i, ids in enumerate(rows):
        assert ids == [t for t in data.batch([i])["src_ids"][0].tolist() if t != data.pad_id], i
    assert cut == [i for i in range(300) if data.src_truncated[i]] and 0 < len(cut) < 300


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_decoding_on_cuda_follows_the_model_and_matches_cpu():
    model = tiny_model(0, dtype=torch.float64)
    src = sources(0)
    cpu = beam_decode(model, src, BOS, EOS, T, beam=3), greedy_decode(model, src, BOS, EOS, T)
    model.cuda()
    gpu = beam_decode(model, src, BOS, EOS, T, beam=3), greedy_decode(model, src, BOS, EOS, T)
    assert torch.equal(cpu[0], gpu[0]) and torch.equal(cpu[1], gpu[1])
