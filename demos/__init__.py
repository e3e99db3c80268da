"""The seeds' demo networks, apart from the Transformer: the multi-copy (MicroBatchInterleaved) MLP of seed 004
(interleaved_mlp/), the quickstart MLP with the op-level shard strategy ((2, 4), (4, 1)) of seed 003 (sharded_mlp/),
and the op-level strategy machinery it runs on (strategy/: MindSpore-style layouts → DTensor placements,
propagation, strategy dumps)."""
