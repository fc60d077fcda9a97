"""``cosyvoice-cpu export`` (``[export]`` extra): the graphs of an official model directory, which
:mod:`cosyvoice_cpu.workshop.exporter` writes stage by stage with numerics gates against the PyTorch reference. The
graphs of each family are in ``lm/``, ``flow/``, ``hift/`` and ``tokenizer/`` (one module per family, the shared
code in ``common.py``); what each family exports is its :class:`~cosyvoice_cpu.export.families.ExportFamily`, read
through :mod:`cosyvoice_cpu.workshop.parts`. Importing a submodule may need torch."""
