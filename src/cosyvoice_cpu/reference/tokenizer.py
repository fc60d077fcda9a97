"""The CosyVoice2 text tokenizer: Qwen2 BPE from ``CosyVoice-BlankEN/`` plus CosyVoice's special tokens.

Loaded through Hugging Face ``transformers`` (the ``[export]`` world, like the official code). The torch-free
runtime reads the same files with the ``tokenizers`` library; both are checked against the official
``QwenTokenizer`` in tests/parity.
"""

from __future__ import annotations

import logging
from pathlib import Path

from cosyvoice_cpu.errors import ModelDirError

logger = logging.getLogger(__name__)

# Added by the official CosyVoice2 tokenizer, in this order (ids follow the base vocabulary's specials).
COSYVOICE2_SPECIALS = (
    "<|im_start|>", "<|im_end|>", "<|endofprompt|>", "[breath]", "<strong>", "</strong>", "[noise]",
    "[laughter]", "[cough]", "[clucking]", "[accent]", "[quick_breath]", "<laughter>", "</laughter>",
    "[hissing]", "[sigh]", "[vocalized-noise]", "[lipsmack]", "[mn]",
)  # fmt: skip


class CosyVoice2Tokenizer:
    """Text -> Qwen2 token ids, special tokens such as ``[laughter]`` or ``<|endofprompt|>`` recognised."""

    def __init__(self, blank_en_dir: str | Path) -> None:
        from transformers import AutoTokenizer

        path = Path(blank_en_dir)
        for name in ("vocab.json", "merges.txt", "tokenizer_config.json"):
            if not (path / name).is_file():
                raise ModelDirError(f"{path / name} is missing: CosyVoice-BlankEN/ must hold the Qwen2 tokenizer")
        self._tok = AutoTokenizer.from_pretrained(str(path))
        self._tok.add_special_tokens(
            {
                "eos_token": "<|endoftext|>",
                "pad_token": "<|endoftext|>",
                "additional_special_tokens": list(COSYVOICE2_SPECIALS),
            }
        )

    def __len__(self) -> int:
        return len(self._tok)

    def token_id(self, token: str) -> int:
        """The id of a special token (e.g. ``"<|endofprompt|>"``)."""
        return int(self._tok.convert_tokens_to_ids(token))

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (no BOS/EOS added, as the official encoder)."""
        return list(self._tok([text])["input_ids"][0])

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)
