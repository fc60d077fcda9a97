"""What differs between the model families, as data: one row per family (the way gpt-fast keeps its
``transformer_configs``), read by the runtime, the manifest, voices, the reference and the exporter alike.

This table is the one list of supported families. Behaviour that differs (stage loading, the LM's prompt rules,
the stream recipe) lives in the family classes (:mod:`cosyvoice_cpu.families.registry`), which read these facts.
Importing this module imports nothing else of the package (the PyTorch side reads it too).
"""

from __future__ import annotations

from dataclasses import dataclass

from cosyvoice_cpu.errors import ModelDirError


@dataclass(frozen=True)
class FamilyFacts:
    """The facts of one model family.

    Attributes:
        name: the family's key in manifests, voices and the CLI (``cosyvoice2``, ``cosyvoice``, ``cosyvoice3``).
        title: the released models it covers.
        sample_rate: output and prompt-mel rate (Hz).
        mel_hop: samples per mel frame at ``sample_rate``.
        token_rate: speech tokens per second.
        speech_vocab: speech-token ids a voice may hold (``[0, speech_vocab)``).
        mel_per_token: prompt mel frames per speech token, or None where a length regulator stretches the tokens
            (CosyVoice-300M).
        speech_tokenizer: the front-end model that turns prompt audio into speech tokens.
        end_of_prompt: the marker the LM's text takes after an instruction (CosyVoice-300M: plain text).
        system_prompt: put before ``end_of_prompt`` when the text has none (Fun-CosyVoice3's LM needs the marker),
            or None.
        lm_speaker: the LM takes the voice's x-vector (outside instruct mode).
        silent_tokens: speech tokens that are silence, whose long runs never reach the flow (empty: no filter).
        max_silent_run: the longest run of ``silent_tokens`` kept.
        builtin_speakers: the released directories may carry ``spk2info.pt`` speakers (exported as ``voices/``).
        oldest_readable: the oldest model-directory format version the runtime reads for this family.
        text_tokenizer: ``qwen2`` (BPE from ``CosyVoice-BlankEN``) or ``whisper`` (tiktoken, converted at export).
        model_names: the names a client may ask for this family by (lower case; the server's ``model`` field).
        mix_ratio: (text, speech) tokens per group of the LM's interleaved text stream (the official
            ``inference_bistream``: 5 text tokens, then 15 speech tokens), or None: the LM was not trained for a
            text stream (CosyVoice-300M), whose text streams are spoken a sentence at a time.
        fill_offset: the LM emits ``speech_token_size + fill_offset`` (its fill token) when it needs the next text
            group (2 for CosyVoice2, 3 for Fun-CosyVoice3), or None.
        languages: the languages its released models speak, as ISO 639 codes (``yue``: Cantonese), from the
            official model cards; what the Wyoming server advertises and checks a request's language against.
        openvino_lm: the LM is the Qwen2 LM, which ``export --openvino`` also writes as a stateful OpenVINO model
            (manifest key ``lm_ov``; :mod:`cosyvoice_cpu.export.lm.openvino_stateful`); CosyVoice-300M's LM is
            another network and has none.
    """

    name: str
    title: str
    sample_rate: int
    mel_hop: int
    token_rate: int
    speech_vocab: int
    mel_per_token: int | None
    speech_tokenizer: str
    end_of_prompt: str
    system_prompt: str | None
    lm_speaker: bool
    silent_tokens: frozenset[int]
    max_silent_run: int
    builtin_speakers: bool
    oldest_readable: int
    text_tokenizer: str
    model_names: tuple[str, ...]
    mix_ratio: tuple[int, int] | None = None
    fill_offset: int | None = None
    languages: tuple[str, ...] = ()
    openvino_lm: bool = False

    @property
    def mel_rate(self) -> float:
        """Mel frames per second."""
        return self.sample_rate / self.mel_hop


# Fun-CosyVoice3's silent speech tokens (FSQ silence/breath codes): the official ``llm_job`` hands at most 5 of
# them in a row to the flow (:mod:`cosyvoice_cpu.lm.silence`)
V3_SILENT_TOKENS = frozenset({1, 2, 28, 29, 55, 248, 494, 2241, 2242, 2322, 2323})
V3_MAX_SILENT_RUN = 5

FACTS: tuple[FamilyFacts, ...] = (
    FamilyFacts(
        name="cosyvoice2",
        title="CosyVoice2-0.5B",
        sample_rate=24000,
        mel_hop=480,
        token_rate=25,
        speech_vocab=6561,
        mel_per_token=2,
        speech_tokenizer="speech_tokenizer_v2.onnx",
        end_of_prompt="<|endofprompt|>",
        system_prompt=None,
        lm_speaker=False,
        silent_tokens=frozenset(),
        max_silent_run=0,
        builtin_speakers=False,
        oldest_readable=3,
        text_tokenizer="qwen2",
        model_names=("cosyvoice2", "cosyvoice2-0.5b"),
        mix_ratio=(5, 15),
        fill_offset=2,
        languages=("zh", "en", "ja", "ko", "yue"),
        openvino_lm=True,
    ),
    FamilyFacts(
        name="cosyvoice",
        title="CosyVoice-300M (base, -SFT, -Instruct)",
        sample_rate=22050,
        mel_hop=256,
        token_rate=50,
        speech_vocab=4096,
        mel_per_token=None,
        speech_tokenizer="speech_tokenizer_v1.onnx",
        end_of_prompt="<endofprompt>",
        system_prompt=None,
        lm_speaker=True,
        silent_tokens=frozenset(),
        max_silent_run=0,
        builtin_speakers=True,
        oldest_readable=3,
        text_tokenizer="whisper",
        model_names=("cosyvoice", "cosyvoice-300m", "cosyvoice-300m-sft", "cosyvoice-300m-instruct"),
        languages=("zh", "en", "ja", "ko", "yue"),  # the LM's language tags <|zh|> <|en|> <|ja|> <|ko|> <|yue|>
    ),
    FamilyFacts(
        name="cosyvoice3",
        title="Fun-CosyVoice3-0.5B",
        sample_rate=24000,
        mel_hop=480,
        token_rate=25,
        speech_vocab=6561,
        mel_per_token=2,
        speech_tokenizer="speech_tokenizer_v3.onnx",
        end_of_prompt="<|endofprompt|>",
        system_prompt="You are a helpful assistant.",
        lm_speaker=False,
        silent_tokens=V3_SILENT_TOKENS,
        max_silent_run=V3_MAX_SILENT_RUN,
        builtin_speakers=False,
        oldest_readable=5,
        text_tokenizer="qwen2",
        model_names=("cosyvoice3", "fun-cosyvoice3", "fun-cosyvoice3-0.5b", "fun-cosyvoice3-0.5b-2512"),
        mix_ratio=(5, 15),
        fill_offset=3,
        languages=("zh", "en", "ja", "ko", "de", "es", "fr", "it", "ru", "yue"),
        openvino_lm=True,
    ),
)

FAMILIES: tuple[str, ...] = tuple(f.name for f in FACTS)
_BY_NAME = {f.name: f for f in FACTS}


def facts(family: str) -> FamilyFacts:
    """The row of ``family``; :class:`ModelDirError` naming the supported families for anything else."""
    row = _BY_NAME.get(family)
    if row is None:
        raise ModelDirError(f"model family {family!r} is not supported (supported: {', '.join(FAMILIES)})")
    return row
