"""The HiFT vocoder at run time: mel -> wave (graphs + the NumPy harmonic source), its windows for long
sentences and its two stream forms (overlap-joined chunks; the causal HiFT continued)."""
