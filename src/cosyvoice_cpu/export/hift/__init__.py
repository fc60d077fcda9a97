"""The vocoder graphs per family: ``cosyvoice`` (HiFT, also CosyVoice2's) and ``cosyvoice3`` (the causal HiFT)."""
