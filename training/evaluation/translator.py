"""A trained model with its tokenizer: load a checkpoint, check the two belong together, translate text.

    from training.evaluation.translator import Translator
    tr = Translator.load("out/run")          # any layout, or a merged/averaged .pt; its tokenizer comes with it
    result = tr.translate(["Un homme en vélo."], beam=5, length_penalty=1.0)
    result.hypotheses, result.truncated, result.unfinished

The tokenizer is the one the checkpoint recorded (checkpoints hold a copy of the run's tokenizer.json; merged and
averaged .pt files its text), unless a tokenizer path is given — which must be the checkpoint's (sha256). A checkpoint
saved before checkpoints recorded their tokenizer needs the path.

The checkpoint is consolidated into the serial model (training/checkpoint/consolidated.py) and decoded by
model/inference.py on one device (default: DeepSpeed's accelerator, as in training). Sources are encoded as the
training data is (tokens, then EOS); a source longer than the model's src_len positions is cut to src_len-1 tokens +
EOS — as the training data was — and listed in `truncated`, which the caller must report (evaluate.py prints a
warning and counts them). Sentences are decoded in batches of similar length (sorted, then put back in input order)."""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from common.errors import UserError
from common.hashing import file_sha256
from model.config import ModelConfig
from model.inference import beam_decode, greedy_decode
from model.transformer import Seq2SeqTransformer
from preprocess.tokenizer import (
    TOKENIZER_FILE,
    decode_hypotheses,
    encode_sources,
    load_tokenizer,
    special_ids,
    tokenizer_from_json,
)
from training.checkpoint import consolidated


@dataclass
class Translation:
    hypotheses: list[str]  # one detokenized line per source, in input order
    truncated: list[int]  # indices of sources longer than src_len-1 tokens (cut to fit)
    unfinished: int  # hypotheses that reached tgt_len tokens without EOS
    seconds: float  # encoding + decoding + detokenizing


class Translator:
    def __init__(self, model: Seq2SeqTransformer, tokenizer, tokenizer_path: str, state: dict):
        # tokenizer_path: the file given, or "<checkpoint> (recorded)" for the checkpoint's own tokenizer
        self.model, self.tokenizer, self.tokenizer_path = model, tokenizer, tokenizer_path
        self.cfg: ModelConfig = model.cfg
        self.ids = special_ids(tokenizer)
        self.vocab_limit = tokenizer.get_vocab_size(with_added_tokens=True)
        self.step, self.checkpoint = state["step"], state["checkpoint"]
        self.averaged = state.get("averaged")
        self.chosen = ""  # which checkpoint a name like RUN/best led to, and why (decode_cli.load_translator)

    @classmethod
    def load(
        cls,
        ckpt: str,
        tokenizer_path: str | None = None,
        ignore_tokenizer_hash: bool = False,
        device: str | None = None,
        verify: bool = True,
    ) -> Translator:
        """`ckpt`: a step_* folder, a run's output_dir or checkpoints/ folder (→ latest), or a consolidated .pt.
        `tokenizer_path`: None for the one the checkpoint recorded. Refuses (UserError) a tokenizer that is not the
        checkpoint's, and a checkpoint that recorded none when no path is given."""
        state = consolidated.load(ckpt, verify=verify)
        if tokenizer_path is None:
            if not state.get("tokenizer_json"):
                raise UserError(
                    state.get("tokenizer_problem")
                    or f"checkpoint {state['checkpoint']} does not hold its tokenizer (it was saved before "
                    f"checkpoints recorded theirs); pass the tokenizer.json it was trained with "
                    f"(--tokenizer)"
                )
            tokenizer = tokenizer_from_json(state["tokenizer_json"], f"the tokenizer of {state['checkpoint']}")
            tokenizer_path = f"{state['checkpoint']} (recorded)"
            loaded_sha = hashlib.sha256(state["tokenizer_json"].encode("utf-8")).hexdigest()
        else:
            if os.path.isdir(tokenizer_path):
                tokenizer_path = os.path.join(tokenizer_path, TOKENIZER_FILE)
            tokenizer = load_tokenizer(tokenizer_path)
            loaded_sha = file_sha256(tokenizer_path)
        cls._check_tokenizer(state, tokenizer, tokenizer_path, loaded_sha, ignore_tokenizer_hash)
        model = Seq2SeqTransformer(ModelConfig(**state["model_config"]))
        model.load_state_dict(state["model"], strict=True)
        if device is None:
            from training.core.distributed import device as accelerator_device

            device = accelerator_device()
        return cls(model.to(device).eval(), tokenizer, tokenizer_path, state)

    @staticmethod
    def _check_tokenizer(state: dict, tokenizer, tokenizer_path: str, loaded_sha: str, ignore_hash: bool) -> None:
        """The tokenizer the checkpoint was trained with: its vocabulary fits, PAD is the same id, and the bytes
        loaded (a file, or the copy a consolidated .pt holds) have the sha256 the checkpoint recorded."""
        ckpt, model_cfg = state["checkpoint"], state["model_config"]
        ids = special_ids(tokenizer)
        tok_vocab = tokenizer.get_vocab_size(with_added_tokens=True)
        if tok_vocab > model_cfg["vocab_size"]:
            raise UserError(
                f"tokenizer {tokenizer_path} has {tok_vocab} tokens but checkpoint {ckpt} was trained "
                f"with vocab_size {model_cfg['vocab_size']}: it is not the tokenizer of this checkpoint "
                f"(pass the --tokenizer the run trained with)"
            )
        if ids.pad != model_cfg["pad_id"]:
            raise UserError(
                f"tokenizer {tokenizer_path} has PAD id {ids.pad} but checkpoint {ckpt} was trained with "
                f"pad_id {model_cfg['pad_id']}: it is not the tokenizer of this checkpoint"
            )
        saved = state.get("tokenizer_sha256")
        if saved and not ignore_hash and loaded_sha != saved:
            raise UserError(
                f"tokenizer {tokenizer_path} is not the one checkpoint {ckpt} was trained with (sha256 "
                f"differs); token ids would not match. Pass the run's tokenizer, or "
                f"--ignore_tokenizer_hash if it is a byte-different copy of the same vocabulary"
            )

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def decode_ids(
        self, src_ids: torch.Tensor, beam: int = 1, length_penalty: float = 1.0, use_cache: bool = True
    ) -> torch.Tensor:
        """[B, S] source ids → [B, L] generated ids (model.inference's layout), greedy for beam 1."""
        ids, max_len = self.ids, self.cfg.tgt_len
        if beam == 1:
            return greedy_decode(self.model, src_ids, ids.bos, ids.eos, max_len, ids.pad, self.vocab_limit, use_cache)
        return beam_decode(
            self.model, src_ids, ids.bos, ids.eos, max_len, beam, length_penalty, ids.pad, self.vocab_limit, use_cache
        )

    def translate(
        self,
        lines: Sequence[str],
        beam: int = 1,
        length_penalty: float = 1.0,
        batch_size: int = 64,
        use_cache: bool = True,
        progress: bool = False,
    ) -> Translation:
        if beam < 1:
            raise UserError(f"beam size {beam} must be >= 1 (1 = greedy)")
        if batch_size < 1:
            raise UserError(f"batch size {batch_size} must be >= 1")
        from common.progress_bar import ProgressBar

        start = time.perf_counter()
        sources, truncated = encode_sources(self.tokenizer, lines, self.cfg.src_len, self.ids.eos)
        order = sorted(range(len(sources)), key=lambda i: -len(sources[i]))  # similar lengths together
        generated: list[list[int]] = [[] for _ in sources]
        for lo in ProgressBar(range(0, len(order), batch_size), desc="decoding", unit="batch", disable=not progress):
            batch = order[lo : lo + batch_size]
            width = max(len(sources[i]) for i in batch)
            src = torch.full((len(batch), width), self.ids.pad, dtype=torch.long)
            for row, i in enumerate(batch):
                src[row, : len(sources[i])] = torch.tensor(sources[i], dtype=torch.long)
            for i, out in zip(batch, self.decode_ids(src, beam, length_penalty, use_cache).tolist(), strict=True):
                generated[i] = out
        hypotheses, finished = decode_hypotheses(self.tokenizer, generated, self.ids.eos, self.ids.pad)
        return Translation(hypotheses, truncated, finished.count(False), time.perf_counter() - start)

    def export_transformers(
        self, output_dir: str, overwrite: bool = False, beam: int = 5, length_penalty: float = 1.0
    ) -> str:
        """Write a folder that `transformers`' AutoModelForSeq2SeqLM / AutoTokenizer load with no code of ours
        (model/hf_export.py: Blenderbot; preprocess/tokenizer.py: the tokenizer appending EOS), with generate()
        defaults that decode as `translate` does (beam, length_penalty). Written next to output_dir and renamed into
        place: an error leaves nothing behind. An existing non-empty output_dir needs overwrite=True, and is only
        replaced if it holds a model (config.json)."""
        from common.staging import staged_folder
        from model.hf_export import to_blenderbot
        from preprocess.tokenizer import save_for_transformers

        if beam < 1:
            raise UserError(f"beam size {beam} must be >= 1 (1 = greedy)")
        output_dir = os.path.abspath(output_dir)
        if os.path.exists(output_dir) and not os.path.isdir(output_dir):
            raise UserError(f"--output {output_dir} is a file, not a folder")
        existing = os.path.isdir(output_dir) and bool(os.listdir(output_dir))
        if existing and not overwrite:
            raise UserError(
                f"--output {output_dir} is not empty; pass --overwrite to replace it, or choose a new folder"
            )
        if existing and not os.path.isfile(os.path.join(output_dir, "config.json")):
            raise UserError(
                f"--output {output_dir} is not empty and holds no model (config.json); refusing to "
                f"replace it even with --overwrite — choose a new folder"
            )
        ids = self.ids
        hf = to_blenderbot(self.model, ids.bos, ids.eos, ids.pad, self.vocab_limit, beam, length_penalty)
        # the folder checked above may go (replace=True), once the new one is complete: an error leaves it as it was
        with staged_folder(output_dir, replace=True) as tmp:
            hf.save_pretrained(tmp)
            save_for_transformers(self.tokenizer, tmp, self.cfg.src_len)
        return output_dir
