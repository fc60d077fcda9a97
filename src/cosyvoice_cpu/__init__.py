"""cosyvoice-cpu: CosyVoice text-to-speech on CPUs alone.

The runtime (everything outside ``reference/`` and ``export/``) needs only NumPy and ONNX Runtime; the PyTorch
reference and the exporters live behind the ``[export]`` extra and are imported lazily.
"""

__version__ = "0.1.0"

__all__ = ["AudioChunk", "Engine", "EngineConfig", "SynthesisConfig", "Voice", "__version__"]

_PUBLIC = {
    "Engine": "cosyvoice_cpu.engine",
    "EngineConfig": "cosyvoice_cpu.config",
    "SynthesisConfig": "cosyvoice_cpu.config",
    "AudioChunk": "cosyvoice_cpu.config",
    "Voice": "cosyvoice_cpu.voices.voice",
}


def __getattr__(name: str) -> object:
    """The public API, imported on first use (``import cosyvoice_cpu`` stays instant for the CLI)."""
    if name in _PUBLIC:
        import importlib

        return getattr(importlib.import_module(_PUBLIC[name]), name)
    raise AttributeError(f"module 'cosyvoice_cpu' has no attribute {name!r}")
