"""Translation with the serial `Seq2SeqTransformer`: incremental decoding with a KV cache, greedy and beam search.

The encoder runs once per batch. The decoder then takes one token per step: every self-attention keeps the keys and
values of the positions already decoded (`KVCache`), every cross-attention projects the encoder memory to keys and
values once per source and reuses them. All of it runs through the model's own blocks — `Embeddings.embed_target`
at the next position, `DecoderLayer.decode` with a `LayerCache`, `Head` — so a cached step computes what the
teacher-forced forward computes for that position (tests/test_inference.py checks the logits and the tokens against
the full-prefix forward, which `use_cache=False` runs at every step).

Rows leave the batch as soon as they are finished (EOS, or all beams of a sentence done), so a batch costs what its
unfinished rows cost. PAD is never generated (the model is not trained to predict it, and a PAD in the prefix would
be masked out of attention), nor any id >= `vocab_limit` (a tokenizer smaller than the model's vocabulary).

Beam search follows `transformers`' `generate(num_beams=N, early_stopping=True)`, whose stopping rule is fairseq's:
- each step, the 2N best continuations of a sentence's N beams by summed log-probability (log-softmax over the
  whole vocabulary, then PAD and ids >= vocab_limit set to -inf);
- a continuation among the best N that ends in EOS (or reaches max_len) becomes a finished hypothesis with score
  sum_logprobs / len ** length_penalty, len = the number of generated tokens including the EOS (fairseq's and
  HF's `length_penalty`; 1.0 = the mean log-probability per token, 0 = the plain sum, larger favours longer);
- the best N continuations that did not end are the next beams;
- a sentence is done when it has N finished hypotheses (at max_len all its best N are finished); its translation
  is the finished hypothesis with the highest score.
Beam size 1 is greedy search.

    from model.inference import beam_decode, greedy_decode
    out = greedy_decode(model, src_ids, bos_id=2, eos_id=3, max_len=model.cfg.tgt_len)        # [B, <= max_len]
    out = beam_decode(model, src_ids, 2, 3, model.cfg.tgt_len, beam=5, length_penalty=1.0)
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.nn.functional as F

from model.transformer import DecoderLayer, Embeddings, EncoderLayer, Head, Seq2SeqTransformer


class KVCache:
    """Keys and values of one attention, [rows, heads, positions, head_dim] each. Self-attention appends the new
    positions every step; cross-attention fills it once with the projected encoder memory.

    With a `capacity` (the most positions it will hold: the decode length), the buffers are allocated once, at the
    first append, and each step writes its positions in place — `keys`/`values` are views of the filled part —
    instead of concatenating everything so far into new tensors every step."""

    def __init__(self, capacity: int | None = None):
        self.capacity = capacity
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None
        self._k = self._v = None
        self._length = 0

    @property
    def length(self) -> int:
        return self._length

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        new = k.shape[2]
        if self.capacity is None or self._length + new > self.capacity:
            if self.keys is None:
                self.keys, self.values = k, v
            else:
                self.keys, self.values = torch.cat([self.keys, k], dim=2), torch.cat([self.values, v], dim=2)
        else:
            if self._k is None:
                rows, heads, _, dim = k.shape
                self._k = k.new_empty(rows, heads, self.capacity, dim)
                self._v = v.new_empty(rows, heads, self.capacity, v.shape[3])
            self._k[:, :, self._length : self._length + new] = k
            self._v[:, :, self._length : self._length + new] = v
            self.keys = self._k[:, :, : self._length + new]
            self.values = self._v[:, :, : self._length + new]
        self._length += new
        return self.keys, self.values

    def select(self, rows: torch.Tensor) -> None:
        if self._k is not None:
            self._k, self._v = self._k[rows], self._v[rows]
            self.keys, self.values = self._k[:, :, : self._length], self._v[:, :, : self._length]
        elif self.keys is not None:
            self.keys, self.values = self.keys[rows], self.values[rows]


class LayerCache:
    """What one decoder layer keeps between steps: its self-attention and cross-attention caches."""

    def __init__(self, max_len: int | None = None):
        self.self_attn, self.cross_attn = KVCache(max_len), KVCache()

    def select(self, rows: torch.Tensor, same_sources: bool = False) -> None:
        self.self_attn.select(rows)
        if not same_sources:
            self.cross_attn.select(rows)


def serial_parts(model: Seq2SeqTransformer):
    """(Embeddings, [EncoderLayer], [DecoderLayer], Head) of a serial model; decoding runs in one process."""
    blocks = list(model.blocks)
    emb, head = blocks[0], blocks[-1]
    enc = [b for b in blocks if isinstance(b, EncoderLayer)]
    dec = [b for b in blocks if isinstance(b, DecoderLayer)]
    if not (
        isinstance(emb, Embeddings)
        and isinstance(head, Head)
        and enc
        and dec
        and len(enc) + len(dec) + 2 == len(blocks)
    ):
        raise TypeError("decoding needs a serial Seq2SeqTransformer (Embeddings, encoder, decoder, Head)")
    if model.ctx.tp_size != 1:
        raise ValueError(
            f"decoding runs the serial model; this one is tensor-parallel (tp={model.ctx.tp_size}) — "
            f"merge the checkpoint first (run_scripts/merge_checkpoint.py)"
        )
    return emb, enc, dec, head


class DecoderState:
    """The decoder side of a batch being translated: the encoder memory of its sources, the caches of every decoder
    layer, and `next_logits(prefix)` for the token after each row's prefix. `select(rows)` keeps (and reorders)
    rows: finished rows leave, beams follow their parents."""

    def __init__(
        self, model: Seq2SeqTransformer, src_ids: torch.Tensor, use_cache: bool = True, max_len: int | None = None
    ):
        self.emb, enc, self.dec, self.head = serial_parts(model)
        self.vocab_size = model.cfg.vocab_size
        self.src_ids = src_ids
        x = (self.emb.embed_source(src_ids), None, src_ids, None)
        for layer in enc:  # the last encoder layer hands over (tgt_h, memory, src_ids, tgt_ids)
            x = layer(x)
        self.memory = x[1]
        self.caches = [LayerCache(max_len) for _ in self.dec] if use_cache else None

    def next_logits(self, prefix: torch.Tensor) -> torch.Tensor:
        """prefix [rows, t] (BOS, then the tokens so far) → logits [rows, V] of token t+1. With the cache, only the
        last prefix token is new; without, the whole prefix runs through the decoder (the teacher-forced forward)."""
        if self.caches is None:
            h, caches = self.emb.embed_target(prefix), [None] * len(self.dec)
        else:
            h, caches = self.emb.embed_target(prefix[:, -1:], start=prefix.shape[1] - 1), self.caches
        for layer, cache in zip(self.dec, caches):
            h = layer.decode(h, self.memory, self.src_ids, prefix, cache)
        return self.head(h[:, -1])[:, : self.vocab_size]

    def select(self, rows: torch.Tensor, same_sources: bool = False) -> None:
        """Row i becomes row rows[i]. same_sources: each new row has the source it had (beams reordered within
        their sentence), so the per-source state — memory, cross-attention keys/values — is left as it is."""
        if not same_sources:
            self.src_ids, self.memory = self.src_ids[rows], self.memory[rows]
        for cache in self.caches or ():
            cache.select(rows, same_sources)


SYNC_EVERY = 8  # greedy decoding reads the batch's state on the host once per this many tokens


@contextmanager
def _eval_mode(model):
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


def _prepare(
    model: Seq2SeqTransformer, src_ids: torch.Tensor, max_len: int, pad_id: int | None, vocab_limit: int | None
):
    """Checks; the sources on the model's device; the ids that may not be generated."""
    cfg = model.cfg
    if not 1 <= max_len <= cfg.tgt_len:
        raise ValueError(f"max_len={max_len} must be in [1, tgt_len={cfg.tgt_len}] (learned target positions)")
    if src_ids.dim() != 2 or not 1 <= src_ids.shape[1] <= cfg.src_len:
        raise ValueError(f"src_ids must be [B, S] with 1 <= S <= src_len={cfg.src_len}, got {tuple(src_ids.shape)}")
    device = next(model.parameters()).device
    pad_id = cfg.pad_id if pad_id is None else pad_id
    banned = [pad_id] + list(range(cfg.vocab_size if vocab_limit is None else vocab_limit, cfg.vocab_size))
    return src_ids.to(device=device, dtype=torch.long), pad_id, torch.tensor(banned, device=device)


@torch.inference_mode()
def greedy_decode(
    model: Seq2SeqTransformer,
    src_ids: torch.Tensor,
    bos_id: int,
    eos_id: int,
    max_len: int,
    pad_id: int | None = None,
    vocab_limit: int | None = None,
    use_cache: bool = True,
) -> torch.Tensor:
    """Greedy translations of a batch of sources.

    src_ids: [B, S] int64, S <= cfg.src_len, laid out as the dataset does (tokens, EOS, then PAD).
    Returns [B, L] int64 on the CPU, L <= max_len: the generated tokens without the leading BOS, each row ending with
    its EOS (if one was produced within max_len tokens) followed by PAD; L is the length of the longest row.
    max_len <= cfg.tgt_len (the decoder input is BOS plus up to max_len-1 tokens, one learned position each).
    pad_id (default cfg.pad_id) and ids >= vocab_limit are never generated. The model runs in eval mode (no dropout)
    on the device of its parameters; its previous mode is restored afterwards.
    """
    src_ids, pad_id, banned = _prepare(model, src_ids, max_len, pad_id, vocab_limit)
    bsz, device = src_ids.shape[0], src_ids.device
    with _eval_mode(model):
        state = DecoderState(model, src_ids, use_cache, max_len)
        out = torch.full((bsz, max_len), pad_id, dtype=torch.long, device=device)
        prefix = torch.full((bsz, max_len), bos_id, dtype=torch.long, device=device)  # filled step by step
        rows = torch.arange(bsz, device=device)  # the output row of each row still decoding
        done = torch.zeros(bsz, dtype=torch.bool, device=device)
        steps = max_len
        for step in range(max_len):
            nxt = state.next_logits(prefix[:, : step + 1]).index_fill_(1, banned, float("-inf")).argmax(dim=-1)
            nxt = nxt.masked_fill(done, pad_id)  # a finished row writes PAD until it leaves
            out[rows, step] = nxt
            done = done | (nxt == eos_id)
            if step + 1 < max_len:
                prefix[:, step + 1] = nxt
            # the host looks at the batch only every SYNC_EVERY tokens (a read is a GPU sync): to stop, or to drop
            # the finished rows
            if (step + 1) % SYNC_EVERY and step + 1 < max_len:
                continue
            if bool(done.all()):
                steps = step + 1
                break
            keep = (~done).nonzero().squeeze(1)
            if keep.numel() < rows.numel():
                rows, prefix, done = rows[keep], prefix[keep], done[keep]
                state.select(keep)
        out = out[:, :steps].cpu()
        # as long as the longest translation: up to its EOS, or every step when one never ended
        ended = out == eos_id
        length = steps if not bool(ended.any(dim=1).all()) else int(ended.int().argmax(dim=1).max()) + 1
        return out[:, :length]


@torch.inference_mode()
def beam_decode(
    model: Seq2SeqTransformer,
    src_ids: torch.Tensor,
    bos_id: int,
    eos_id: int,
    max_len: int,
    beam: int,
    length_penalty: float = 1.0,
    pad_id: int | None = None,
    vocab_limit: int | None = None,
    use_cache: bool = True,
) -> torch.Tensor:
    """Beam-search translations of a batch of sources (the module docstring gives the algorithm); same arguments and
    output layout as `greedy_decode`: [B, L] on the CPU, the best hypothesis of each source, its EOS, then PAD."""
    if beam < 1:
        raise ValueError(f"beam={beam} must be >= 1")
    src_ids, pad_id, banned = _prepare(model, src_ids, max_len, pad_id, vocab_limit)
    bsz, device, n = src_ids.shape[0], src_ids.device, beam
    with _eval_mode(model):
        state = DecoderState(model, src_ids.repeat_interleave(n, dim=0), use_cache)
        prefix = torch.full((bsz * n, 1), bos_id, dtype=torch.long, device=device)
        scores = None  # [sentences, n] summed log-probs of the beams
        finished: list[list[tuple[float, list[int]]]] = [[] for _ in range(bsz)]
        sentences = list(range(bsz))  # the source of each sentence still searching
        for step in range(max_len):
            logits = state.next_logits(prefix)
            dtype = torch.promote_types(logits.dtype, torch.float32)
            logp = F.log_softmax(logits.to(dtype), dim=-1).index_fill_(1, banned, float("-inf"))
            if scores is None:  # all beams equal: only the first one may expand
                scores = torch.full((bsz, n), -1e9, dtype=dtype, device=device)
                scores[:, 0] = 0.0
            b, vocab = len(sentences), logp.shape[-1]
            total = (logp.view(b, n, vocab) + scores[:, :, None]).view(b, n * vocab)
            top, index = total.topk(2 * n, dim=1)  # sorted, best first
            parent, token = index // vocab, index % vocab
            generated = step + 1
            ends = torch.ones_like(token, dtype=torch.bool) if generated == max_len else token == eos_id

            # the best n continuations that end become finished hypotheses
            ended = ends[:, :n].nonzero().tolist()
            if ended:
                normalized = (top[:, :n] / generated**length_penalty).tolist()
                parent_l, token_l, history = parent[:, :n].tolist(), token[:, :n].tolist(), prefix[:, 1:].tolist()
                touched = set()
                for i, r in ended:
                    tokens = history[i * n + parent_l[i][r]] + [token_l[i][r]]
                    finished[sentences[i]].append((normalized[i][r], tokens))
                    touched.add(sentences[i])
                for s in touched:  # keep the n best (stable: earlier wins a tie)
                    finished[s] = sorted(finished[s], key=lambda h: -h[0])[:n]

            # the best n continuations that did not end go on
            going = top.masked_fill(ends, float("-inf")).topk(n, dim=1).indices
            parent, token, scores = parent.gather(1, going), token.gather(1, going), top.gather(1, going)
            alive = [i for i, s in enumerate(sentences) if len(finished[s]) < n and generated < max_len]
            if not alive:
                break
            keep = torch.tensor(alive, device=device)
            rows = (keep[:, None] * n + parent[keep]).view(-1)
            state.select(rows, same_sources=len(alive) == len(sentences))
            prefix = torch.cat([prefix[rows], token[keep].reshape(-1, 1)], dim=1)
            scores = scores[keep]
            sentences = [sentences[i] for i in alive]

        best = [max(hyps, key=lambda h: h[0])[1] if hyps else [] for hyps in finished]
        out = torch.full((bsz, max(1, max(map(len, best)))), pad_id, dtype=torch.long)
        for i, tokens in enumerate(best):
            out[i, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
        return out
