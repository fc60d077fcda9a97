"""cosyvoice-cpu: CosyVoice text-to-speech on CPUs alone.

The runtime (everything outside ``reference/`` and ``export/``) needs only NumPy and ONNX Runtime; the PyTorch
reference and the exporters live behind the ``[export]`` extra and are imported lazily.
"""

__version__ = "0.1.0"
