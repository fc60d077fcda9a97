"""``cosyvoice-cpu export`` (``[export]`` extra): an official model directory to ONNX graphs + a manifest, stage by
stage with numerics gates against the PyTorch reference (:mod:`.exporter`, :mod:`.stages`). The graphs of each
family are in ``lm/``, ``flow/``, ``hift/`` and ``tokenizer/`` (one module per family, the shared code in
``common.py``); what each family exports is its :class:`~cosyvoice_cpu.export.families.ExportFamily`, read through
:mod:`cosyvoice_cpu.family_parts`. Importing a submodule may need torch."""
