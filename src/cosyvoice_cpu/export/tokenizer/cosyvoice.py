"""Convert a Whisper-style tiktoken vocabulary into a Hugging Face ``tokenizer.json`` (CosyVoice-300M, v1).

The v1 models encode text with a tiktoken BPE and ``encode(text, allowed_special="all")``. Two assets exist:

* ``multilingual.tiktoken`` (openai-whisper): what the released CosyVoice-300M/-SFT/-Instruct use; their
  ``cosyvoice.yaml`` names ``whisper.tokenizer.get_tokenizer`` (multilingual, 100 languages). 50257 ranks plus
  1609 specials give the LM's ``text_token_size`` of 51866.
* ``multilingual_zh_ja_yue_char_del.tiktoken`` (the CosyVoice repository): only for the CosyVoice-300M-25Hz
  recipe (``cosyvoice.tokenizer.tokenizer.get_tokenizer``), with a longer special list (audio events, emotions,
  ``<|SPECIAL_TOKEN_n|>``, ``<|TTS/...|>``); 58836 ranks plus 1674 specials.

Both use the same pre-tokenizer regex; special ids follow the ranks in the list order below. The conversion is
exact: vocabulary = ranks, merges = every split of a token into two tokens (ordered by the token's rank), the
regex as a ``Split`` pre-tokenizer, then ``ByteLevel`` without its own regex, and tiktoken's "a whole piece that
is a token is that token" rule as the BPE's ``ignore_merges``. The v1 instruct marker ``<endofprompt>`` is *not*
a special token in either list: the official frontend appends it to the instruct text as plain text.
The runtime then loads the file with :class:`cosyvoice_cpu.text.tokenizer.TextTokenizer` (no tiktoken, no torch).
"""

from __future__ import annotations

import base64
import binascii
import importlib.util
import logging
import os
from pathlib import Path
from typing import Any

from cosyvoice_cpu.errors import ExportError

logger = logging.getLogger(__name__)

WHISPER_ASSET = "multilingual.tiktoken"
COSYVOICE_25HZ_ASSET = "multilingual_zh_ja_yue_char_del.tiktoken"
TIKTOKEN_ENV = "COSYVOICE_TIKTOKEN"
TOKENIZER_FILE = "tokenizer.json"
INSTRUCT_SUFFIX = "<endofprompt>"  # v1 instruct: appended to the instruct text, tokenized as ordinary text

# The pre-tokenizer of both assets (GPT-2's pattern).
PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""

# Whisper's language codes in id order; CosyVoice's configs take the first 100 (up to "yue").
LANGUAGE_CODES = (
    "en zh de es ru ko fr ja pt tr pl ca nl ar sv it id hi fi vi he uk el ms cs ro da hu ta no th ur hr bg lt la "
    "mi ml cy sk te fa lv bn sr az sl kn et mk br eu is hy ne mn bs kk sq sw gl mr pa si km sn yo so af oc ka be "
    "tg sd gu am yi lo uz fo ht ps tk nn mt sa lb my bo tl mg as tt haw ln ha ba jw su yue"
).split()
NUM_LANGUAGES = 100
MANIFEST_LANGUAGES = ("zh", "en", "ja", "yue", "ko")

_TASKS = ("translate", "transcribe", "startoflm", "startofprev", "nospeech", "notimestamps")
_AUDIO_EVENTS = (
    "ASR",
    "AED",
    "SER",
    "Speech",
    "/Speech",
    "BGM",
    "/BGM",
    "Laughter",
    "/Laughter",
    "Applause",
    "/Applause",
)
_EMOTIONS = ("HAPPY", "SAD", "ANGRY", "NEUTRAL")
_TTS = ("TTS/B", "TTS/O", "TTS/Q", "TTS/A", "TTS/CO", "TTS/CL", "TTS/H", *(f"TTS/SP{i:02d}" for i in range(1, 14)))
FLAVOURS = ("whisper", "cosyvoice-25hz")


def special_tokens(flavour: str = "whisper", num_languages: int = NUM_LANGUAGES) -> list[str]:
    """The special tokens in id order (the first gets id ``len(ranks)``) for ``flavour`` in :data:`FLAVOURS`."""
    if flavour not in FLAVOURS:
        raise ExportError(f"unknown tiktoken flavour {flavour!r}; use one of {', '.join(FLAVOURS)}")
    if not 1 <= num_languages <= len(LANGUAGE_CODES):
        raise ExportError(f"num_languages must be in 1..{len(LANGUAGE_CODES)}, got {num_languages}")
    langs = [f"<|{code}|>" for code in LANGUAGE_CODES[:num_languages]]
    tasks = [f"<|{t}|>" for t in _TASKS]
    if flavour == "whisper":
        middle = tasks
    else:
        middle = [
            *(f"<|{e}|>" for e in (*_AUDIO_EVENTS, *_EMOTIONS)),
            *tasks,
            *(f"<|SPECIAL_TOKEN_{i}|>" for i in range(1, 31)),
            *(f"<|{t}|>" for t in _TTS),
        ]
    stamps = [f"<|{i * 0.02:.2f}|>" for i in range(1501)]
    return ["<|endoftext|>", "<|startoftranscript|>", *langs, *middle, *stamps]


def flavour_of(path: Path) -> str:
    """The special-token flavour an asset's file name implies (the CosyVoice 25 Hz asset, else Whisper's)."""
    return "cosyvoice-25hz" if "char_del" in Path(path).name else "whisper"


def asset_name_for(src: Path) -> str:
    """The asset a source directory's ``cosyvoice.yaml`` asks for (Whisper's unless it names CosyVoice's own)."""
    yaml = Path(src) / "cosyvoice.yaml"
    if yaml.is_file() and "cosyvoice.tokenizer.tokenizer.get_tokenizer" in yaml.read_text(encoding="utf-8"):
        return COSYVOICE_25HZ_ASSET
    return WHISPER_ASSET


def _package_asset(name: str) -> Path | None:
    """The asset inside an installed openai-whisper / official cosyvoice package, found without importing it."""
    package, sub = ("cosyvoice", ("tokenizer", "assets")) if name == COSYVOICE_25HZ_ASSET else ("whisper", ("assets",))
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for root in spec.submodule_search_locations:
        candidate = Path(root).joinpath(*sub, name)
        if candidate.is_file():
            return candidate
    return None


def find_tiktoken(src: Path, name: str | None = None) -> Path:
    """Locate the tiktoken asset for the v1 model directory ``src``.

    Order: ``src/<name>``; the only ``*.tiktoken`` in ``src``; the file named by ``$COSYVOICE_TIKTOKEN``; the
    asset of an installed package (openai-whisper for ``multilingual.tiktoken``, the official ``cosyvoice`` for
    the 25 Hz asset). ``name`` defaults to what ``src/cosyvoice.yaml`` asks for (:func:`asset_name_for`).
    The official model downloads do not contain the asset, hence the fallbacks.
    """
    src = Path(src)
    name = name or asset_name_for(src)
    direct = src / name
    if direct.is_file():
        return direct
    found = sorted(src.glob("*.tiktoken")) if src.is_dir() else []
    if len(found) == 1:
        logger.info("using %s as the v1 text tokenizer asset", found[0])
        return found[0]
    env = os.environ.get(TIKTOKEN_ENV)
    if env:
        if not Path(env).is_file():
            raise ExportError(f"${TIKTOKEN_ENV} is set to {env}, which is not a file; point it at {name} or unset it")
        return Path(env)
    packaged = _package_asset(name)
    if packaged is not None:
        logger.info("using %s from an installed package", packaged)
        return packaged
    if name == COSYVOICE_25HZ_ASSET:
        where = "the FunAudioLLM/CosyVoice repository, cosyvoice/tokenizer/assets/" + name
    else:
        where = "the openai/whisper repository, whisper/assets/" + name + " (or `pip install openai-whisper`)"
    many = f" ({len(found)} *.tiktoken files there, expected one)" if len(found) > 1 else ""
    raise ExportError(
        f"the v1 text tokenizer asset {name} was not found in {src}{many}: get it from {where}, then copy it "
        f"to {direct} or set ${TIKTOKEN_ENV} to its path"
    )


def read_ranks(path: Path) -> dict[bytes, int]:
    """Parse a ``.tiktoken`` file (``<base64 token> <rank>`` per line) and validate it.

    The real assets end with ``= <rank>``: base64 of the empty string, a placeholder no text can produce (it puts
    ``<|endoftext|>`` one id after it); it is kept, as the official loader keeps it.

    Ranks must be the distinct integers ``0..n-1`` (specials are numbered from ``n``) and every single byte must
    be a token (BPE starts from bytes). Raises ExportError naming the line on any violation.
    """
    path = Path(path)
    try:
        lines = path.read_text(encoding="ascii").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise ExportError(f"cannot read {path} as a tiktoken file ({e}); re-download the asset") from e
    ranks: dict[bytes, int] = {}
    seen: set[int] = set()
    for no, line in enumerate(lines, 1):
        if not line.strip():
            continue
        fields = line.split()
        bad = f"{path}:{no} is not '<base64 token> <rank>' ({line[:60]!r})"
        if len(fields) != 2 or not fields[1].isdigit():
            raise ExportError(f"{bad}; the file is corrupt or not a tiktoken vocabulary, re-download it")
        try:  # a bare "=" is the assets' placeholder: the empty token, which only keeps its rank occupied
            token = b"" if fields[0] == "=" else base64.b64decode(fields[0], validate=True)
        except (binascii.Error, ValueError) as e:
            raise ExportError(f"{bad}: bad base64 ({e}); re-download the asset") from e
        rank = int(fields[1])
        if token in ranks or rank in seen:
            raise ExportError(f"{path}:{no} repeats a token or a rank; re-download the asset")
        ranks[token] = rank
        seen.add(rank)
    if not ranks:
        raise ExportError(f"{path} holds no tokens; re-download the asset")
    if max(seen) != len(ranks) - 1:
        raise ExportError(f"{path}: ranks are not 0..{len(ranks) - 1} (max {max(seen)}); re-download the asset")
    missing = [b for b in range(256) if bytes([b]) not in ranks]
    if missing:
        raise ExportError(f"{path} lacks {len(missing)} single-byte tokens (e.g. {missing[:5]}); re-download it")
    return ranks


def byte_chars() -> list[str]:
    """The byte-level alphabet: byte ``b`` is written as ``byte_chars()[b]`` in vocab and merges (GPT-2's map)."""
    printable = {*range(33, 127), *range(161, 173), *range(174, 256)}
    out, extra = [], 0
    for b in range(256):
        if b in printable:
            out.append(chr(b))
        else:
            out.append(chr(256 + extra))
            extra += 1
    return out


def bpe_model(ranks: dict[bytes, int]) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """(vocab, merges) of the byte-level BPE that reproduces tiktoken's merging for ``ranks``.

    tiktoken merges the adjacent pair whose concatenation has the lowest rank; a merge ``(l, r)`` is possible
    whenever ``l``, ``r`` and ``l + r`` are all tokens, so every such split is listed, ordered by ``rank[l + r]``.
    """
    table = byte_chars()

    def text(token: bytes) -> str:
        return "".join(table[b] for b in token)

    vocab = {text(t): r for t, r in ranks.items()}
    merges: list[tuple[int, int, int, str, str]] = []
    for token, rank in ranks.items():
        for i in range(1, len(token)):
            left, right = token[:i], token[i:]
            if left in ranks and right in ranks:
                merges.append((rank, ranks[left], ranks[right], text(left), text(right)))
    merges.sort()
    return vocab, [(m[3], m[4]) for m in merges]


def build_tokenizer(ranks: dict[bytes, int], specials: list[str]) -> Any:
    """A ``tokenizers.Tokenizer`` equal to tiktoken's ``encode(text, allowed_special="all")`` for these inputs."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    vocab, merges = bpe_model(ranks)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=True, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    clash = [s for s in specials if s in vocab]
    if clash:
        raise ExportError(f"special tokens {clash[:3]} are also BPE tokens of the asset; it is not a tiktoken vocab")
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    wrong = [s for i, s in enumerate(specials) if tok.token_to_id(s) != len(ranks) + i]
    if wrong:
        raise ExportError(f"special tokens {wrong[:3]} did not get their official ids; report this as a bug")
    return tok


def write_whisper_tokenizer(tiktoken_path: Path, out_dir: Path, flavour: str | None = None) -> dict[str, Any]:
    """Convert ``tiktoken_path`` into ``out_dir/tokenizer.json``; return the manifest ``text`` section.

    Args:
        tiktoken_path: the ``.tiktoken`` asset (see :func:`find_tiktoken`).
        out_dir: the model directory being written (must exist).
        flavour: which special-token list follows the ranks; default from the file name (:func:`flavour_of`).

    Returns:
        ``{"tokenizer": "tokenizer.json", "kind": "whisper", "vocab_size": N, "special_ids": {...}}`` where
        ``special_ids`` holds ``<|endoftext|>`` and the ``<|zh|>``, ``<|en|>``, ``<|ja|>``, ``<|yue|>``,
        ``<|ko|>`` tags (there is no special instruct marker in v1; see :data:`INSTRUCT_SUFFIX`).
    """
    tiktoken_path, out_dir = Path(tiktoken_path), Path(out_dir)
    flavour = flavour or flavour_of(tiktoken_path)
    ranks = read_ranks(tiktoken_path)
    specials = special_tokens(flavour)
    tok = build_tokenizer(ranks, specials)
    if not out_dir.is_dir():
        raise ExportError(f"{out_dir} is not a directory; create it first")
    tok.save(str(out_dir / TOKENIZER_FILE))
    size = len(ranks) + len(specials)
    wanted = ["<|endoftext|>", *(f"<|{code}|>" for code in MANIFEST_LANGUAGES)]
    special_ids = {s: len(ranks) + specials.index(s) for s in wanted}
    logger.info(
        "wrote %s from %s (%d ranks + %d %s specials)",
        out_dir / TOKENIZER_FILE,
        tiktoken_path.name,
        len(ranks),
        len(specials),
        flavour,
    )
    return {"tokenizer": TOKENIZER_FILE, "kind": "whisper", "vocab_size": size, "special_ids": special_ids}
