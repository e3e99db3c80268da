"""Settings: train.py's flags and recipe files (flags), the typed sections they become (sections), and the checks
before a run starts (preflight)."""
