"""Greedy-token agreement between two forms of the same LM (e.g. the ONNX ``lm.onnx`` on ONNX Runtime and the
stateful OpenVINO ``lm.ov.xml``), on random prompts: what ``export --openvino`` records as the ``lm_ov`` entry's
``agreement`` (:mod:`cosyvoice_cpu.export.openvino_lm`) and what ``bench/ov_lm_probe.py agree`` reports.

A *form* decodes rows of one batch: ``start(prompts)`` prefills one prompt (T, D) per row from an empty cache and
returns logp (B, V) after each row's last position; ``step(tokens)`` feeds one speech token per row and returns
logp (B, V). Random weights give near-flat distributions, so argmax flips far more easily than on a trained
checkpoint: an agreement measured on a random-weight fixture is a floor, not a refusal criterion.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from cosyvoice_cpu.backends.openvino import import_openvino
from cosyvoice_cpu.export.lm.common import kl_rows
from cosyvoice_cpu.lm.prompt import assemble
from cosyvoice_cpu.lm.session import LMSession

logger = logging.getLogger(__name__)


class DecodeForm(Protocol):
    """One LM form, rows decoded together (see the module docstring)."""

    def start(self, prompts: Sequence[np.ndarray]) -> np.ndarray: ...

    def step(self, tokens: Sequence[int]) -> np.ndarray: ...


class SessionForm:
    """:class:`~cosyvoice_cpu.lm.session.LMSession` (the runtime's LM: the ONNX graph, or a stateful OpenVINO
    model opened through the backend seam) as a :class:`DecodeForm`."""

    def __init__(self, session: LMSession) -> None:
        self.session = session
        self.cache: Any = None

    def start(self, prompts: Sequence[np.ndarray]) -> np.ndarray:
        self.cache = self.session.new_cache(len(prompts))
        return np.stack([self.session.prefill(self.cache, i, p) for i, p in enumerate(prompts)])

    def step(self, tokens: Sequence[int]) -> np.ndarray:
        return self.session.decode(self.cache, list(range(len(tokens))), list(tokens))


class OvStatefulForm:
    """A stateful OpenVINO LM (contract: :mod:`cosyvoice_cpu.export.lm.openvino_stateful`) called directly, not
    through the runtime, as a :class:`DecodeForm`: every row prefilled together (prompts of one length), the KV
    cache in the request's state (``bench/ov_lm_probe.py``'s ``ov-*`` forms, whose compile properties it varies).

    Args:
        path: the ``.ov.xml``.
        embed: speech token ids -> their embeddings (B, D) (e.g. :meth:`LMSession.embed_speech`).
        threads: ``INFERENCE_NUM_THREADS``.
        config: more compile properties (default precision: OpenVINO's for this CPU, bf16 where it has it).
    """

    def __init__(
        self,
        path: str | Path,
        embed: Callable[[Sequence[int]], np.ndarray],
        threads: int = 2,
        config: Mapping[str, Any] | None = None,
    ) -> None:
        ov = import_openvino()
        props = {"INFERENCE_NUM_THREADS": threads, "NUM_STREAMS": 1, "PERFORMANCE_HINT": "LATENCY", **(config or {})}
        self.compiled = ov.Core().compile_model(str(path), "CPU", props)
        self.request = self.compiled.create_infer_request()
        self.embed = embed
        self.positions = 0

    def _run(self, embeds: np.ndarray) -> np.ndarray:
        b, s, _ = embeds.shape
        self.positions += s
        feeds = {
            "inputs_embeds": np.ascontiguousarray(embeds, np.float32),
            "attention_mask": np.ones((b, self.positions), np.int64),
            "position_ids": np.ascontiguousarray(
                np.broadcast_to(np.arange(self.positions - s, self.positions, dtype=np.int64), (b, s))
            ),
            "beam_idx": np.arange(b, dtype=np.int32),
        }
        return self.request.infer(feeds)["logp"].copy()

    def start(self, prompts: Sequence[np.ndarray]) -> np.ndarray:
        if len({len(p) for p in prompts}) != 1:
            raise ValueError("OvStatefulForm prefills rows together: give prompts of one length")
        self.request.reset_state()
        self.positions = 0
        return self._run(np.stack(prompts))

    def step(self, tokens: Sequence[int]) -> np.ndarray:
        return self._run(np.asarray(self.embed(list(tokens)), np.float32)[:, None])


def random_prompts(session: LMSession, count: int, length: int, seed: int) -> list[np.ndarray]:
    """``count`` random CosyVoice2-style prompts of ``length`` positions each, (length, D): sos, a quarter of them
    random text ids, task_id, the rest random speech ids (:func:`cosyvoice_cpu.lm.prompt.assemble`)."""
    rng = np.random.default_rng(seed)
    spec = session.spec
    n_text = max(1, length // 4)
    out = []
    for _ in range(count):
        text = rng.integers(0, spec.text_vocab, n_text)
        speech = rng.integers(0, spec.speech_rows, length - 2 - n_text)
        out.append(assemble(session, text, speech))
    return out


def greedy(form: DecodeForm, prompt: np.ndarray, steps: int, rows: int | None = None) -> list[int]:
    """``steps`` greedy tokens of one row after ``prompt`` (argmax over the first ``rows`` entries of logp, the ids
    that can be fed back; all when None)."""
    logp = form.start([prompt])[0]
    tokens = [int(logp[:rows].argmax())]
    for _ in range(steps - 1):
        tokens.append(int(form.step(tokens[-1:])[0][:rows].argmax()))
    return tokens


def forced(form: DecodeForm, prompt: np.ndarray, tokens: Sequence[int]) -> np.ndarray:
    """logp (len(tokens), V) of one row fed ``tokens`` after ``prompt`` (teacher-forced: the prefill's, then each
    step's but the last token's)."""
    out = [form.start([prompt])[0]]
    out += [form.step([t])[0] for t in list(tokens)[:-1]]
    return np.stack(out)


@dataclass(frozen=True)
class Agreement:
    """Teacher-forced comparison of a form against a reference form over ``prompts`` x ``steps`` positions:
    ``agreement`` the fraction of equal argmax, ``mean_kl`` KL(reference || form) in nats."""

    agreement: float
    mean_kl: float
    prompts: int
    steps: int


def teacher_forced_agreement(
    form: DecodeForm, reference: DecodeForm, prompts: Sequence[np.ndarray], steps: int, rows: int | None = None
) -> Agreement:
    """The reference decodes each prompt greedily (``steps`` tokens, argmax over the first ``rows`` ids); both are
    fed those tokens; the argmax of every position is compared (``steps`` per prompt)."""
    same, kls = [], []
    for p in prompts:
        tokens = greedy(reference, p, steps, rows)
        want, got = forced(reference, p, tokens), forced(form, p, tokens)
        same.append(got.argmax(-1) == want.argmax(-1))
        kls.append(kl_rows(want, got))
    return Agreement(
        float(np.mean(np.concatenate(same))), float(np.mean(np.concatenate(kls))), len(prompts), int(steps)
    )
