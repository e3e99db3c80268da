"""Evaluation: validation loss/BLEU during training, the best checkpoint and early stopping (validation); decoding a
checkpoint into translations and exporting it to transformers (translator)."""
