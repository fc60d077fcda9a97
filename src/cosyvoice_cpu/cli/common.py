"""What several commands share: the check for the ``[export]`` extra before a command that needs PyTorch."""

from __future__ import annotations

from cosyvoice_cpu.errors import MissingExtraError


def need_export_extra() -> None:
    """Raise :class:`MissingExtraError` with the install command unless PyTorch can be imported."""
    try:
        import torch  # noqa: F401
    except ImportError as e:
        raise MissingExtraError(
            "this command needs the [export] extra (PyTorch): pip install torch==2.13.0 && "
            "pip install 'cosyvoice-cpu[export]'"
        ) from e
