"""Tensor parallelism's building blocks: process groups (topology), the collectives as autograd functions
(mappings), column/row/vocab-parallel layers, the vocab-parallel cross-entropy, TP-aware random streams, and the
rules that cut a full tensor into TP shards (sharding)."""
