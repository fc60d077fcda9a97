"""``cosyvoice-cpu bench``: tasks run in child processes (``python -m cosyvoice_cpu.benchmark``) and the report."""
