"""The servers' view of an engine (``server/engine_api.SpeechEngine``) is what the engine and the ``--unload-after``
engine really give: every member exists on both, methods with the Protocol's parameters in its order."""

from __future__ import annotations

import inspect

import pytest

from cosyvoice_cpu.engine import Engine
from cosyvoice_cpu.server.engine_api import SpeechEngine
from cosyvoice_cpu.server.unload import UnloadingEngine

MEMBERS = [n for n in vars(SpeechEngine) if not n.startswith("_") or n == "__iter__"]
PROPERTIES = {n for n in MEMBERS if isinstance(vars(SpeechEngine)[n], property)}
SET_IN_INIT = {  # plain attributes the classes set in __init__ rather than define on the class
    Engine: {"model_dir", "manifest", "sample_rate", "scheduler", "prompt_caches"},
    UnloadingEngine: {"model_dir", "manifest", "sample_rate", "token_rate", "kv_cache_positions"},
}


def test_the_protocol_names_what_the_servers_use() -> None:
    assert {"synthesize", "open_text_stream", "make_voice", "loaded", "scheduler"} <= set(MEMBERS)


@pytest.mark.parametrize("cls", [Engine, UnloadingEngine], ids=lambda c: c.__name__)
def test_the_engines_give_every_member_with_its_parameters(cls: type) -> None:
    for name in MEMBERS:
        if name in SET_IN_INIT[cls]:
            assert name in inspect.getsource(cls.__init__), f"{cls.__name__}.__init__ does not set {name}"
            continue
        assert hasattr(cls, name), f"{cls.__name__} lacks {name}"
        if name in PROPERTIES:
            assert isinstance(inspect.getattr_static(cls, name), property), f"{cls.__name__}.{name} is no property"
            continue
        want = list(inspect.signature(vars(SpeechEngine)[name]).parameters)
        got = list(inspect.signature(getattr(cls, name)).parameters)
        assert got[: len(want)] == want, f"{cls.__name__}.{name}{got} differs from the protocol's {want}"
        extra = [inspect.signature(getattr(cls, name)).parameters[p] for p in got[len(want) :]]
        assert all(p.default is not inspect.Parameter.empty for p in extra), f"{cls.__name__}.{name}: {got}"
