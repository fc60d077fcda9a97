"""Voices: prompt audio -> :class:`~cosyvoice_cpu.voices.voice.Voice` (x-vector, speech tokens, prompt mel) and
their atomic ``.npz`` files."""
