"""The runtime text tokenizer: CosyVoice2's Qwen2 BPE read from an exported ``tokenizer.json``.

Uses the Rust ``tokenizers`` library only (no ``transformers``, no torch). Special tokens such as
``<|endofprompt|>``, ``[laughter]`` or ``<strong>`` are added tokens in ``tokenizer.json`` and are matched
before BPE, exactly as the official ``QwenTokenizer`` does; no BOS/EOS is ever added.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from pathlib import Path

from cosyvoice_cpu.errors import ConfigError

logger = logging.getLogger(__name__)

TOKENIZER_FILE = "tokenizer.json"


class TextTokenizer:
    """Text -> token ids for the CosyVoice2 LM, identical to the reference (transformers) tokenizer.

    Build it with :meth:`from_dir` (an exported model directory) or :meth:`from_file`.
    """

    def __init__(self, tokenizer: object, source: str = "<memory>") -> None:
        """Wrap a loaded ``tokenizers.Tokenizer``; ``source`` names where it came from (for messages)."""
        self._tok = tokenizer
        self._source = source
        self._specials: dict[str, int] = {}
        for token in tokenizer.get_added_tokens_decoder().values():  # type: ignore[attr-defined]
            if token.special:
                self._specials[token.content] = int(tokenizer.token_to_id(token.content))  # type: ignore[attr-defined]

    @classmethod
    def from_file(cls, path: str | Path) -> TextTokenizer:
        """Load a Hugging Face ``tokenizer.json`` file; ConfigError if it is missing or unreadable."""
        from tokenizers import Tokenizer

        path = Path(path)
        if not path.is_file():
            raise ConfigError(
                f"{path} is missing: pass an exported model directory (it holds {TOKENIZER_FILE}), "
                "or re-run `cosyvoice-cpu export` to write it"
            )
        try:
            tok = Tokenizer.from_file(str(path))
        except Exception as exc:  # tokenizers raises a plain Exception on bad JSON / schema
            raise ConfigError(
                f"{path} is not a valid tokenizers JSON file ({exc}); re-run `cosyvoice-cpu export` to rewrite it"
            ) from exc
        # Never add BOS/EOS: the official CosyVoice2 frontend encodes text without them.
        tok.no_padding()
        tok.no_truncation()
        logger.debug("loaded tokenizer %s (vocab %d)", path, tok.get_vocab_size(with_added_tokens=True))
        return cls(tok, str(path))

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> TextTokenizer:
        """Load ``tokenizer.json`` from an exported model directory."""
        return cls.from_file(Path(model_dir) / TOKENIZER_FILE)

    @property
    def vocab_size(self) -> int:
        """Vocabulary size including added (special) tokens."""
        return int(self._tok.get_vocab_size(with_added_tokens=True))  # type: ignore[attr-defined]

    @property
    def special_tokens(self) -> dict[str, int]:
        """Special token -> id (a copy)."""
        return dict(self._specials)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``: special tokens recognised, no BOS/EOS added."""
        if not isinstance(text, str):
            raise ConfigError(f"text must be a str, got {type(text).__name__}")
        return list(self._tok.encode(text, add_special_tokens=False).ids)  # type: ignore[attr-defined]

    def count(self, text: str) -> int:
        """Number of tokens of ``text`` (same as ``len(encode(text))``)."""
        return len(self.encode(text))

    def special_id(self, token: str) -> int:
        """The id of a special token such as ``"<|endofprompt|>"``; ConfigError if the vocabulary lacks it."""
        tid = self._specials.get(token)
        if tid is None:
            tid = self._tok.token_to_id(token)  # type: ignore[attr-defined]
        if tid is None:
            known = ", ".join(sorted(self._specials)[:12])
            raise ConfigError(f"{token!r} is not a token of {self._source}; known special tokens include: {known}")
        return int(tid)

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """Text of token ids (special tokens dropped unless ``skip_special_tokens=False``)."""
        ids = [int(i) for i in ids]
        size = self.vocab_size
        bad = [i for i in ids if not 0 <= i < size]
        if bad:
            raise ConfigError(f"token ids {bad[:5]} are outside the vocabulary (size {size}) of {self._source}")
        return str(self._tok.decode(ids, skip_special_tokens=skip_special_tokens))  # type: ignore[attr-defined]

    def check_manifest(self, special_ids: dict[str, int]) -> None:
        """Raise ConfigError if the manifest's ``text.special_ids`` disagree with this tokenizer."""
        wrong = {t: i for t, i in special_ids.items() if self._tok.token_to_id(t) != int(i)}  # type: ignore[attr-defined]
        if wrong:
            raise ConfigError(
                f"{self._source} disagrees with the manifest on special ids {json.dumps(wrong)[:200]}; "
                "the model directory is inconsistent, re-run `cosyvoice-cpu export`"
            )
