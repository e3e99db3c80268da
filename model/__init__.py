"""Tensor-parallel encoder-decoder Transformer: config, process groups, collectives, layers, blocks, pipeline."""
