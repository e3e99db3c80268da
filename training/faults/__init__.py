"""How a job fails cleanly: the output folder's lock (output_lock), rank supervision and collective timeouts
(rank_supervisor), non-finite steps and weights (nonfinite), a full disk (disk_full), and the tests' fault
injection (injection)."""
