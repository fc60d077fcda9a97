"""The file names and graph metadata keys of an exported LM, shared by the runtime, the manifest and the exporter.

Ground floor (imports nothing of the package): the manifest, below the LM, reads these names too.
"""

from __future__ import annotations

GRAPH_FILE = "lm.onnx"
EMBEDDING_FILES = {
    "text": "lm_text_embedding.npy",  # (text_vocab, D): Qwen2 embed_tokens
    "speech": "lm_speech_embedding.npy",  # (speech_vocab, D): speech tokens + 3 stop ids
    "special": "lm_special_embedding.npy",  # (2, D): llm_embedding rows below
}
SPECIALS = {"sos": 0, "task_id": 1}
TEXT_ENCODER_FILE = "lm_text_encoder.onnx"  # v1 only: the Conformer text encoder (runtime: lm.prompt.TextEncoder)
EXPORT_HINT = "re-export the model directory with `cosyvoice-cpu export`"
MIN_ROWS_KEY = "min_rows"  # lm.onnx metadata: see LMSession's min_rows
