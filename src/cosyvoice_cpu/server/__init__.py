"""The HTTP server (``cosyvoice-cpu serve``): an OpenAI-compatible speech API over one shared engine."""
