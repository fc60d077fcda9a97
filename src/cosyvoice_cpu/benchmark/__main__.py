"""``python -m cosyvoice_cpu.benchmark MODEL_DIR --task T``: one bench task in this process, JSON on stdout."""

from cosyvoice_cpu.benchmark.tasks import main

raise SystemExit(main())
