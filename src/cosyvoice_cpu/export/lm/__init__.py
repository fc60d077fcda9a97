"""The LM graphs per family (one module each) and the Qwen2 LM graph code two of them share (:mod:`.common`)."""
