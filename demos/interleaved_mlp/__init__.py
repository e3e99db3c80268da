"""Seed 004: an MLP classifier on the bundled digits, trained with tensor parallelism and MicroBatchInterleaved."""
