"""Seed 003: the quickstart MLP whose first MatMul has the strategy ((2, 4), (4, 1)) on 8 devices, the rest
propagated."""
