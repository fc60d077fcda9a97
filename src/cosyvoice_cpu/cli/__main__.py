"""``python -m cosyvoice_cpu.cli`` runs the command-line interface."""

from cosyvoice_cpu.cli.main import main

raise SystemExit(main())
