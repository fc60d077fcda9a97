"""The LM stage of the PyTorch reference: one module per family (``cosyvoice``: the transformer LM with its text
encoder; ``cosyvoice2``: the Qwen2 LM; ``cosyvoice3``: the Qwen2 LM with its own head and stop tokens), the Qwen2
backbone they share (:mod:`.qwen2`) and the Qwen2 LMs' common code (:mod:`.common`)."""
