"""PyTorch reference implementation of the CosyVoice models (inference only, ``[export]`` extra).

Our own readable modules whose ``state_dict`` keys match the released ``llm.pt``/``flow.pt``/``hift.pt``.
They are the ground truth every ONNX graph and the NumPy runtime are checked against, and are themselves
checked against the official implementation in ``tests/parity``. Importing this package needs torch.
"""
