"""Settings: each declared once in sections (the how of a declaration: schema), train.py's flags and recipe files
read from them (flags), and the checks before a run starts (preflight)."""
