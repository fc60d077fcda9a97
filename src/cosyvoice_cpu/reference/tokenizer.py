"""The CosyVoice2/3 text tokenizers: Qwen2 BPE from ``CosyVoice-BlankEN/`` plus CosyVoice's special tokens.

Ids: the Qwen2 base vocabulary ends with ``<|endoftext|>`` 151643, ``<|im_start|>`` 151644, ``<|im_end|>``
151645; the added specials follow in list order (``<|im_start|>``/``<|im_end|>`` already exist and keep their
ids). CosyVoice2 adds 17 (151646 ``<|endofprompt|>`` ... 151662 ``[mn]``); CosyVoice3 adds the same 17, then
``<|endofsystem|>`` 151663, 84 CMU phones ``[AA]`` ... ``[ZH]`` (151664-151747) and 176 pinyin units ``[a]`` ...
``[ǜ]`` (151748-151923): 278 new ids, all below the LM's 151936 text-embedding rows.

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
    "<|im_start|>",
    "<|im_end|>",
    "<|endofprompt|>",
    "[breath]",
    "<strong>",
    "</strong>",
    "[noise]",
    "[laughter]",
    "[cough]",
    "[clucking]",
    "[accent]",
    "[quick_breath]",
    "<laughter>",
    "</laughter>",
    "[hissing]",
    "[sigh]",
    "[vocalized-noise]",
    "[lipsmack]",
    "[mn]",
)


# CosyVoice3 (``CosyVoice3Tokenizer``) continues the list: <|endofsystem|>, the ARPAbet phones (alphabetical; the
# 15 vowels followed by their stress variants 0/1/2), then the pinyin units in code-point order.
_CMU_VOWELS = ("AA", "AE", "AH", "AO", "AW", "AY", "EH", "ER", "EY", "IH", "IY", "OW", "OY", "UH", "UW")
_CMU_CONSONANTS = (
    "B",
    "CH",
    "D",
    "DH",
    "F",
    "G",
    "HH",
    "JH",
    "K",
    "L",
    "M",
    "N",
    "NG",
    "P",
    "R",
    "S",
    "SH",
    "T",
    "TH",
    "V",
    "W",
    "Y",
    "Z",
    "ZH",
)
CMU_PHONES = tuple(
    v
    for p in sorted(_CMU_VOWELS + _CMU_CONSONANTS)
    for v in ((p, p + "0", p + "1", p + "2") if p in _CMU_VOWELS else (p,))
)
PINYIN_UNITS = tuple(
    sorted(
        """
    a ai an ang ao b c ch d e ei en eng f g h i ian in ing iu ià iàn iàng iào iá ián iáng iáo iè ié iòng ióng iù iú
    iā iān iāng iāo iē iě iōng iū iǎ iǎn iǎng iǎo iǒng iǔ j k l m n o ong ou p q r s sh t u uang ue un uo uà uài uàn
    uàng uá uái uán uáng uè ué uì uí uò uó uā uāi uān uāng uē uě uī uō uǎ uǎi uǎn uǎng uǐ uǒ vè w x y z zh à ài àn
    àng ào á ái án áng áo è èi èn èng èr é éi én éng ér ì ìn ìng í ín íng ò òng òu ó óng óu ù ùn ú ún ā āi ān āng
    āo ē ēi ēn ēng ě ěi ěn ěng ěr ī īn īng ō ōng ōu ū ūn ǎ ǎi ǎn ǎng ǎo ǐ ǐn ǐng ǒ ǒng ǒu ǔ ǔn ǘ ǚ ǜ
""".split()
    )
)
COSYVOICE3_SPECIALS = (
    *COSYVOICE2_SPECIALS,
    "<|endofsystem|>",
    *(f"[{p}]" for p in CMU_PHONES),
    *(f"[{p}]" for p in PINYIN_UNITS),
)


class QwenTextTokenizer:
    """Text -> Qwen2 token ids with a family's special tokens (:attr:`SPECIALS`) recognised, e.g. ``[laughter]``
    or ``<|endofprompt|>``; each family's tokenizer is a subclass naming its specials."""

    SPECIALS: tuple[str, ...] = ()

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
                "additional_special_tokens": list(self.SPECIALS),
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

    def save(self, path: str | Path) -> None:
        """Write the tokenizer, specials included, as one Hugging Face ``tokenizer.json`` (what the torch-free
        runtime reads)."""
        self._tok.backend_tokenizer.save(str(path))


class CosyVoice2Tokenizer(QwenTextTokenizer):
    """The CosyVoice2 text tokenizer: Qwen2 BPE + the 19 CosyVoice2 specials."""

    SPECIALS: tuple[str, ...] = COSYVOICE2_SPECIALS


class CosyVoice3Tokenizer(QwenTextTokenizer):
    """The Fun-CosyVoice3 text tokenizer: the CosyVoice2 specials + ``<|endofsystem|>``, CMU phones, pinyin units.

    Phones and pinyin are written inline as ``[HH][AH0]`` or ``[j][ǐ]`` (pronunciation hotfixes).
    """

    SPECIALS: tuple[str, ...] = COSYVOICE3_SPECIALS
