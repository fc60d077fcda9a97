"""Fun-CosyVoice3-0.5B: the DiT flow (its time table computed at load), streamed on cached keys/values; the causal
HiFT continued chunk by chunk; long silent-token runs never reach the flow (the facts' ``silent_tokens``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from cosyvoice_cpu.backends.base import SessionConfig
from cosyvoice_cpu.config import EngineConfig
from cosyvoice_cpu.facts import FamilyFacts, facts
from cosyvoice_cpu.families.cosyvoice2 import CosyVoice2
from cosyvoice_cpu.flow.stage import FlowStage
from cosyvoice_cpu.flow.stage_v3 import FlowStageV3
from cosyvoice_cpu.flow.stream_v3 import FlowStreamV3, PromptCacheV3
from cosyvoice_cpu.vocoder.causal_stream import CausalVocoderStream
from cosyvoice_cpu.vocoder.hift import Vocoder


class CosyVoice3(CosyVoice2):
    """CosyVoice2's chunked stream recipe with the DiT's stream and the causal vocoder (no join needed)."""

    facts: ClassVar[FamilyFacts] = facts("cosyvoice3")
    flow_stage: ClassVar[type[FlowStage]] = FlowStageV3
    prompt_cache: ClassVar[type | None] = PromptCacheV3
    flow_stream: ClassVar[type] = FlowStreamV3

    def load_flow(self, model_dir: Path, config: EngineConfig, sessions: SessionConfig) -> FlowStage:
        """The DiT stage; with its stream graph, the time table of the default Euler schedule is made now, while
        little else is in memory (:meth:`~cosyvoice_cpu.flow.stage_v3.FlowStageV3.time_table`)."""
        flow = super().load_flow(model_dir, config, sessions)
        if isinstance(flow, FlowStageV3) and flow.can_stream:
            flow.time_table(flow.schedule(flow.settings.n_timesteps))
        return flow

    def vocoder_stream(self, vocoder: Vocoder, rng: np.random.Generator) -> Any:
        """The causal HiFT continued exactly from chunk to chunk."""
        return CausalVocoderStream(vocoder, rng=rng)
