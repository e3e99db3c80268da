"""Checkpoints: what one holds on disk and how it is read (format, shard_io), the folder's rules (folder), which one
a run starts from (resume), save/load and the trainer's manager (manager), every optimizer's state
(optimizer_state), format-1 conversion (convert), and merged/averaged single-file weights (consolidated)."""
