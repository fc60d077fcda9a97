"""The types of values read from JSON (the manifest, calibration files, voice metadata): what ``json.load`` returns.

Ground floor: imports nothing. ``attrs: JsonObject`` says "a JSON object, check before use", where ``Any`` said
nothing.
"""

from __future__ import annotations

from typing import TypeAlias

# a JSON value: what json.load may return for any part of a document
JsonValue: TypeAlias = str | int | float | bool | list["JsonValue"] | dict[str, "JsonValue"] | None
JsonObject = dict[str, JsonValue]
