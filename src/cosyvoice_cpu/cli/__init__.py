"""The ``cosyvoice-cpu`` command: one module per command group (entry point :func:`cosyvoice_cpu.cli.main.main`)."""
