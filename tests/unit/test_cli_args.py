"""Every ``cosyvoice-cpu`` sub-command takes its options before, between and after its positionals (issue #28)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from cosyvoice_cpu.cli.main import build_parser, main

# per sub-command: argv variants (options first, options last, mixed) and the values they must all parse to
CASES: dict[str, tuple[list[list[str]], dict[str, object]]] = {
    "fixture": ([["fixture", "--seed", "3", "--out", "D"], ["fixture", "--out", "D", "--seed", "3"]],
                {"out": Path("D"), "seed": 3}),
    "export": ([["export", "--to", "B", "--from", "A"], ["export", "--from", "A", "--to", "B"]],
               {"src": Path("A"), "dst": Path("B")}),
    "say": (
        [
            ["say", "-m", "M", "-o", "x.wav", "hello", "world"],
            ["say", "hello", "world", "-m", "M", "-o", "x.wav"],
            ["say", "hello", "-m", "M", "world", "-o", "x.wav"],
            ["say", "-m", "M", "hello", "-o", "x.wav", "world"],
        ],
        {"text": ["hello", "world"], "model": Path("M"), "out": Path("x.wav")},
    ),
    "voice": (
        [
            ["voice", "-m", "D", "--prompt-wav", "a.wav", "add", "alice"],
            ["voice", "add", "-m", "D", "alice", "--prompt-wav", "a.wav"],  # the command of the issue
            ["voice", "add", "alice", "-m", "D", "--prompt-wav", "a.wav"],
            ["voice", "-m", "D", "add", "--prompt-wav", "a.wav", "alice"],
        ],
        {"action": "add", "name": "alice", "model": Path("D"), "prompt_wav": Path("a.wav")},
    ),
    "bench": ([["bench", "--runs", "1", "-m", "D"], ["bench", "-m", "D", "--runs", "1"]],
              {"model": Path("D"), "runs": 1}),
    "serve": ([["serve", "--port", "9", "-m", "D"], ["serve", "-m", "D", "--port", "9"]],
              {"model": Path("D"), "port": 9}),
    "wyoming": ([["wyoming", "--zeroconf", "-m", "D"], ["wyoming", "-m", "D", "--zeroconf", "hall"]],
                {"model": Path("D")}),
    "doctor": ([["doctor", "--quick", "-m", "D"], ["doctor", "-m", "D", "--quick"]],
               {"model": Path("D"), "quick": True}),
    "demo": ([["demo", "--seed", "2", "-o", "x.wav"], ["demo", "-o", "x.wav", "--seed", "2"]],
             {"seed": 2, "out": Path("x.wav")}),
}  # fmt: skip


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    raise AssertionError("the cosyvoice-cpu parser has no sub-commands")


def test_every_subcommand_is_covered() -> None:
    """A new sub-command must be added to CASES (with its options placed first)."""
    assert set(_subcommands(build_parser())) == set(CASES)


@pytest.mark.parametrize("command", sorted(CASES))
def test_options_anywhere(command: str) -> None:
    variants, expected = CASES[command]
    for argv in variants:
        args = build_parser().parse_args(argv)
        assert args.command == command
        got = {k: getattr(args, k) for k in expected}
        assert got == expected, f"{argv} parsed to {got}"


def test_subcommands_with_positionals_accept_options_first() -> None:
    """Each parser with positionals parses when every option precedes them (the shape of the bug)."""
    with_positionals = {name for name, p in _subcommands(build_parser()).items() if p._get_positional_actions()}
    assert with_positionals == {"say", "voice"}
    for name in with_positionals:
        assert CASES[name][0][0][1].startswith("-"), f"the first {name} case must start with an option"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["voice", "add", "-m", "D", "--prompt-wav", "a.wav"], "voice add needs a NAME"),
        (["voice", "rm"], "voice rm needs a NAME"),
        (["voice", "list", "alice"], "voice list takes no NAME"),
    ],
)
def test_voice_name_errors(argv: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main([*argv, "--voices", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err


def test_say_text_after_double_dash() -> None:
    """Text that starts with '-' still needs '--' (and still works with options first)."""
    args = build_parser().parse_args(["say", "-m", "M", "--", "-5", "degrees"])
    assert args.text == ["-5", "degrees"]


def test_unknown_option_still_refused(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["voice", "add", "alice", "--bogus"])
    assert e.value.code == 2 and "unrecognized arguments: --bogus" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["serve", "wyoming"])
def test_the_servers_take_the_voice_cache_budget(command: str, capsys: pytest.CaptureFixture) -> None:
    """Both servers build their engine's options alike; ``--prompt-cache-mb`` reaches them (docs/server.md)."""
    from cosyvoice_cpu.cli.common import server_engine_config
    from cosyvoice_cpu.config import EngineConfig

    parser = build_parser()
    lean = server_engine_config(parser.parse_args([command, "-m", "D", "--prompt-cache-mb", "0"]), 2)
    assert lean.prompt_cache_mb == 0 and lean.lm_batch_rows == 2
    default = server_engine_config(parser.parse_args([command, "-m", "D", "--prompt-cache-fp16"]), 3)
    assert default.prompt_cache_mb == EngineConfig().prompt_cache_mb and default.prompt_cache_fp16
    for bad in ("-5", "2000000", "1.5"):
        with pytest.raises(SystemExit):
            parser.parse_args([command, "-m", "D", "--prompt-cache-mb", bad])
        err = capsys.readouterr().err
        assert "--prompt-cache-mb" in err and "from 0 to 1048576" in err, err


@pytest.mark.parametrize("command", ["serve", "wyoming"])
def test_the_servers_take_a_default_step_count(command: str, capsys: pytest.CaptureFixture) -> None:
    """``--flow-steps`` sets what a request without its own ``flow_steps`` gets (a Wyoming client cannot send one);
    out-of-range values are refused on the command line with the range."""
    from cosyvoice_cpu.cli.common import synthesis_defaults

    parser = build_parser()
    assert synthesis_defaults(parser.parse_args([command, "-m", "D"])).flow_steps == 10  # the official setting
    assert synthesis_defaults(parser.parse_args([command, "-m", "D", "--flow-steps", "5"])).flow_steps == 5
    for bad in ("0", "101", "2.5", "five"):
        with pytest.raises(SystemExit):
            parser.parse_args([command, "-m", "D", "--flow-steps", bad])
        err = capsys.readouterr().err
        assert "--flow-steps" in err and "from 1 to 100" in err, err


@pytest.mark.parametrize("command", ["say", "voice", "serve", "wyoming", "doctor", "demo"])
def test_every_engine_command_takes_no_split_rows(command: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """``--no-split-rows`` (``EngineConfig.split_rows``) reaches the engine each command loads: through
    ``backend_options`` for all, through ``server_engine_config`` for the servers, and to ``Engine.load`` for the
    commands that speak."""
    from cosyvoice_cpu.cli.common import backend_options, server_engine_config

    positional = {"say": ["hi"], "voice": ["list"]}.get(command, [])
    parser = build_parser()
    default = parser.parse_args([command, "-m", "D", *positional])
    one_call = parser.parse_args([command, "-m", "D", "--no-split-rows", *positional])
    assert backend_options(default)["split_rows"] is True and backend_options(one_call)["split_rows"] is False
    if command in ("serve", "wyoming"):
        assert server_engine_config(default, 2).split_rows and not server_engine_config(one_call, 2).split_rows
    if command == "say":
        from cosyvoice_cpu.cli.speech import _engine
        from cosyvoice_cpu.engine import Engine

        seen = []
        monkeypatch.setattr(Engine, "load", classmethod(lambda cls, model, config: seen.append(config)))
        _engine(default)
        _engine(one_call)
        assert [c.split_rows for c in seen] == [True, False]


def test_doctor_and_demo_pass_no_split_rows_on(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """``doctor`` prints the pools of the engine as configured (no row thread with ``--no-split-rows``); ``demo``
    loads its engine with it."""
    from cosyvoice_cpu.engine import Engine
    from cosyvoice_cpu.hardware import pools

    asked: list[bool] = []
    real = pools.pool_lines
    monkeypatch.setattr(pools, "pool_lines", lambda *a, **k: asked.append(k["split_rows"]) or real(*a, **k))
    main(["doctor"])  # its exit status says how fit this machine is: not asked here
    main(["doctor", "--no-split-rows"])
    assert asked == [True, False]

    class Loaded(Exception):
        pass

    def load(cls: type, model: object, config: object) -> None:
        asked.append(config.split_rows)  # type: ignore[attr-defined]
        raise Loaded

    monkeypatch.setattr(Engine, "load", classmethod(load))
    with pytest.raises(Loaded):
        main(["demo", "--no-split-rows", "-o", str(tmp_path / "x.wav")])
    assert asked[-1] is False
