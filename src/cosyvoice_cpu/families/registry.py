"""The runtime's family classes by name: the one place that maps a manifest's family to its class."""

from __future__ import annotations

from cosyvoice_cpu.facts import facts
from cosyvoice_cpu.families.base import Family
from cosyvoice_cpu.families.cosyvoice import CosyVoice
from cosyvoice_cpu.families.cosyvoice2 import CosyVoice2
from cosyvoice_cpu.families.cosyvoice3 import CosyVoice3
from cosyvoice_cpu.manifest import Manifest

CLASSES: dict[str, type[Family]] = {cls.facts.name: cls for cls in (CosyVoice2, CosyVoice, CosyVoice3)}


def family_for(manifest: Manifest) -> Family:
    """The family object of a loaded manifest (ModelDirError for a family without a runtime class)."""
    facts(manifest.family)  # an unknown family: the message lists the supported ones
    return CLASSES[manifest.family](manifest)
