"""Settings: train.py's flags and recipe files (flags), the typed sections they become (sections), and the checks
of a user's DeepSpeed JSON (deepspeed_check)."""
