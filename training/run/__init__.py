"""How a job lives and ends, above config/ and checkpoint/: where it starts (start_point: decided once, on rank 0;
launch_check: the launch scripts' questions before any process starts), joining the job (job: the process group with
the job watch), the output folder's lock (output_lock), stop requests and signals (stop_request), rank supervision
and collective timeouts (rank_supervisor, job_watch), non-finite steps (nonfinite_steps), each launch's record and
the SLURM chain (launch_record, slurm_chain, launcher)."""
