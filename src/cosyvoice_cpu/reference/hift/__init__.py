"""The vocoder stage of the PyTorch reference: ``cosyvoice`` (the HiFT generator CosyVoice-300M and
CosyVoice2 share, at 22.05 and 24 kHz), ``cosyvoice3`` (the causal HiFT), the harmonic source (:mod:`.source`) and
the pieces both generators are made of (:mod:`.common`)."""
