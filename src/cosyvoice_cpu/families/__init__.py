"""Model families at run time: one small class per family (:mod:`~cosyvoice_cpu.families.registry`), reading the
per-family facts of :mod:`cosyvoice_cpu.facts` (a ground-floor module: this package's stages are above it)."""
