"""The machine: CPU features, usable cores and memory, the thread plan and page release (probes/ times it).

Nothing here imports onnxruntime at import time: the CPU is checked before any kernel library is loaded.
"""
