"""``python -m cosyvoice_cpu`` runs the command-line interface."""

from cosyvoice_cpu.cli import main

raise SystemExit(main())
