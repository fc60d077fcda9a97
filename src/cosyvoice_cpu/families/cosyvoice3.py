"""Fun-CosyVoice3-0.5B: the DiT flow (its time table computed at load), streamed on cached keys/values; the causal
HiFT continued chunk by chunk; long silent-token runs never reach the flow (the facts' ``silent_tokens``)."""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

import numpy as np

from cosyvoice_cpu.backends.base import SessionConfig
from cosyvoice_cpu.config import EngineConfig
from cosyvoice_cpu.facts import FamilyFacts, facts
from cosyvoice_cpu.families.common import ChunkedFamily, FlowStreamKind
from cosyvoice_cpu.flow.base import FlowStage
from cosyvoice_cpu.flow.cosyvoice3 import CosyVoice3Flow
from cosyvoice_cpu.flow.cosyvoice3_stream import CosyVoice3FlowStream, CosyVoice3PromptCache
from cosyvoice_cpu.flow.prompt_caches import PromptCacheKind
from cosyvoice_cpu.sentence import AudioStream
from cosyvoice_cpu.vocoder.causal_stream import CausalVocoderStream
from cosyvoice_cpu.vocoder.hift import Vocoder


class CosyVoice3(ChunkedFamily):
    """The chunked stream recipe (as CosyVoice2's) with the DiT's stream and the causal vocoder (no join needed)."""

    facts: ClassVar[FamilyFacts] = facts("cosyvoice3")
    flow_stage: ClassVar[type[FlowStage]] = CosyVoice3Flow
    prompt_cache: ClassVar[PromptCacheKind | None] = CosyVoice3PromptCache
    flow_stream: ClassVar[FlowStreamKind] = CosyVoice3FlowStream

    def load_flow(self, model_dir: Path, config: EngineConfig, sessions: SessionConfig) -> FlowStage:
        """The DiT stage; with its stream graph, the time table of the default Euler schedule is made now, while
        little else is in memory (:meth:`~cosyvoice_cpu.flow.cosyvoice3.CosyVoice3Flow.time_table`)."""
        flow = super().load_flow(model_dir, config, sessions)
        if isinstance(flow, CosyVoice3Flow) and flow.can_stream:
            flow.time_table(flow.schedule(flow.settings.n_timesteps))
        return flow

    def vocoder_stream(self, vocoder: Vocoder, rng: np.random.Generator) -> AudioStream:
        """The causal HiFT continued exactly from chunk to chunk."""
        return CausalVocoderStream(vocoder, rng=rng)
