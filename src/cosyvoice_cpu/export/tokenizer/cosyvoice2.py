"""Export the CosyVoice2 text tokenizer as one ``tokenizer.json`` the torch-free runtime reads unchanged: the Qwen2
BPE of ``CosyVoice-BlankEN/`` with the 19 CosyVoice2 specials
(:class:`~cosyvoice_cpu.reference.tokenizer.CosyVoice2Tokenizer`, the official ``QwenTokenizer``'s ids)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

TOKENIZER_FILE = "tokenizer.json"  # = cosyvoice_cpu.text.tokenizer.TOKENIZER_FILE


def export_tokenizer(blank_en_dir: str | Path, out_dir: str | Path) -> dict[str, Any]:
    """Write ``out_dir/tokenizer.json``; return the manifest's ``text`` section (``tokenizer``, ``vocab_size``,
    ``special_ids`` for ``<|endoftext|>`` and the CosyVoice2 specials)."""
    from cosyvoice_cpu.reference.tokenizer import COSYVOICE2_SPECIALS, CosyVoice2Tokenizer

    tok = CosyVoice2Tokenizer(blank_en_dir)
    tok.save(Path(out_dir) / TOKENIZER_FILE)
    specials = {t: tok.token_id(t) for t in ("<|endoftext|>", *COSYVOICE2_SPECIALS)}
    return {"tokenizer": TOKENIZER_FILE, "vocab_size": len(tok), "special_ids": specials}
