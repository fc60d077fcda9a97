"""The flow stage of the PyTorch reference: one module per family (``cosyvoice``: length regulator + U-Net;
``cosyvoice2``: chunk-causal Conformer + causal U-Net; ``cosyvoice3``: DiT) and the building blocks they share (the
conditional flow matching solver :mod:`.cfm`, the encoders and estimators)."""
