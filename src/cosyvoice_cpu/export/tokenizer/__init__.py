"""The text tokenizer written into a model directory (``tokenizer.json``), per family."""
