"""The machine: CPU features, usable cores and memory, the thread plan, kernel calibration and page release.

Nothing here imports onnxruntime at import time: the CPU is checked before any kernel library is loaded.
"""
