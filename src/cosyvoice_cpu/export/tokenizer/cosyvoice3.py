"""Export the Fun-CosyVoice3 text tokenizer as one ``tokenizer.json`` the torch-free runtime reads unchanged.

``CosyVoice-BlankEN/`` (Qwen2 ``vocab.json`` + ``merges.txt`` + ``tokenizer_config.json``) is loaded with
``transformers`` exactly as the reference :class:`~cosyvoice_cpu.reference.tokenizer.CosyVoice3Tokenizer` (and the
official ``CosyVoice3Tokenizer``) does, the 280 CosyVoice3 specials are added (278 new ids: ``<|endofprompt|>``
151646 ... ``[mn]`` 151662, ``<|endofsystem|>`` 151663, 84 ARPAbet phones, 176 pinyin units), and the backend
tokenizer is saved in the Hugging Face ``tokenizers`` format::

    CosyVoice-BlankEN/ --transformers + specials--> out_dir/tokenizer.json --TextTokenizer.from_file--> ids

The returned dict is the manifest's ``text`` section (as ``exporter._export_tokenizer`` writes for CosyVoice2):
``tokenizer`` (file name), ``vocab_size`` (151924 with the real vocabulary), ``special_ids`` (token -> id for
``<|endoftext|>`` and all 280 specials).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from cosyvoice_cpu.errors import ConfigError, ExportError

logger = logging.getLogger(__name__)

TOKENIZER_FILE = "tokenizer.json"  # = cosyvoice_cpu.text.tokenizer.TOKENIZER_FILE
ENDOFPROMPT = "<|endofprompt|>"


def export_tokenizer(blank_en_dir: str | Path, out_dir: str | Path) -> dict[str, Any]:
    """Write ``out_dir/tokenizer.json`` (Qwen2 BPE + the CosyVoice3 specials); return the manifest ``text`` section.

    Raises:
        ModelDirError: ``blank_en_dir`` lacks the Qwen2 tokenizer files.
        ExportError: ``<|endofprompt|>`` does not get the id the official CosyVoice3 LM hard-codes (151646), i.e.
            the vocabulary is not the released Qwen2 one, or the saved file reads back with different ids.
    """
    from cosyvoice_cpu.reference.lm.cosyvoice3 import ENDOFPROMPT_ID
    from cosyvoice_cpu.reference.tokenizer import COSYVOICE3_SPECIALS, CosyVoice3Tokenizer

    blank_en_dir, out_dir = Path(blank_en_dir), Path(out_dir)
    tok = CosyVoice3Tokenizer(blank_en_dir)
    specials = {t: tok.token_id(t) for t in ("<|endoftext|>", *COSYVOICE3_SPECIALS)}
    if specials[ENDOFPROMPT] != ENDOFPROMPT_ID:
        raise ExportError(
            f"{blank_en_dir} gives {ENDOFPROMPT} the id {specials[ENDOFPROMPT]}, but the CosyVoice3 LM hard-codes "
            f"{ENDOFPROMPT_ID}: use the CosyVoice-BlankEN directory shipped with Fun-CosyVoice3 (151,643 BPE entries)"
        )
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / TOKENIZER_FILE
    tok.save(path)
    _check_written(path, specials)
    logger.info("wrote %s (%d tokens, %d CosyVoice3 specials)", path, len(tok), len(COSYVOICE3_SPECIALS))
    return {"tokenizer": TOKENIZER_FILE, "vocab_size": len(tok), "special_ids": specials}


def _check_written(path: Path, specials: dict[str, int]) -> None:
    """Read ``path`` back with the runtime tokenizer; raise ExportError if a special id or its matching differs."""
    from cosyvoice_cpu.text.tokenizer import TextTokenizer

    runtime = TextTokenizer.from_file(path)
    try:
        runtime.check_manifest(specials)
    except ConfigError as e:
        raise ExportError(f"the written {path.name} does not reproduce the CosyVoice3 special ids: {e}") from e
    probe = f"[HH][AH0]{ENDOFPROMPT}[j][ǐ]"
    want = [specials["[HH]"], specials["[AH0]"], specials[ENDOFPROMPT], specials["[j]"], specials["[ǐ]"]]
    if runtime.encode(probe) != want:
        raise ExportError(
            f"the written {path.name} splits {probe!r} into {runtime.encode(probe)}, expected {want}; "
            "upgrade the tokenizers package and export again"
        )
