"""Op-level sharding strategies (MindSpore's `shard()` and `sharding_propagation`) on torch.distributed.tensor.

    ops.py        MatMul / ReLU / Sub / Square / ReduceMean / MSELoss with `.shard(strategy)`
    layout.py     strategy tuples ↔ DTensor placements on a DeviceMesh (Shard / Replicate / Partial)
    graph.py      the operator graph of a network (torch.fx) with every shape
    propagate.py  a strategy for every operator from the given ones (MindSpore's propagation rule)
    execute.py    run the plan on DTensors: redistribution, per-op all-reduce, gradient sync, counted collectives
    dump.py       the per-op strategy dump and the per-rank executed shapes (the seed's two IR files)

A concern of its own, beside the Megatron-style tensor-parallel layers of model/parallel/layers.py.
"""
