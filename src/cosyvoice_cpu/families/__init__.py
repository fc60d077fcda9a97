"""Model families: the table of per-family facts (:mod:`~cosyvoice_cpu.families.facts`, importable from anywhere,
the PyTorch side included) and the runtime's family classes (:mod:`~cosyvoice_cpu.families.registry`).

This ``__init__`` imports nothing: the facts must stay cheap to import for the manifest, voices and the exporter.
"""
