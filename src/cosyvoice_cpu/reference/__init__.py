"""PyTorch reference implementation of the CosyVoice models (inference only, ``[export]`` extra).

Our own readable modules whose ``state_dict`` keys match the released ``llm.pt``/``flow.pt``/``hift.pt``.
They are the ground truth every ONNX graph and the NumPy runtime are checked against, and are themselves
checked against the official implementation in ``tests/parity``. ``lm/``, ``flow/`` and ``hift/`` hold one module
per family (``cosyvoice``, ``cosyvoice2``, ``cosyvoice3``) beside the code they share; :mod:`.loaders` says how each
family's directory is read. Importing this package needs torch.
"""
