"""Text → TSV pairs → tokenizer.json → tokenized Arrow cache → layout-invariant global batches."""
