"""Planning a run without starting it: the layout rank by rank with memory and communication (planner), its text
report (report), and hostfiles / rank tables (cluster)."""
