"""`cosyvoice-cpu say` and `voice` on an exported tiny model; `say` end to end with torch blocked."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from cosyvoice_cpu.cli.main import main


@pytest.fixture(scope="module")
def prompt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    t = np.arange(16000 * 3) / 16000
    path = tmp_path_factory.mktemp("prompt") / "p.wav"
    sf.write(path, (0.3 * np.sin(2 * np.pi * 200 * t)).astype(np.float32), 16000)
    return path


def test_voice_add_list_say_rm(tiny_export_dir: Path, prompt: Path, tmp_path: Path, capsys) -> None:
    voices = ["--voices", str(tmp_path / "voices")]
    m = ["-m", str(tiny_export_dir)]
    add = ["voice", "add", "alice", *m, "--prompt-wav", str(prompt)]
    assert main([*add, "--prompt-text", "Good morning.", *voices]) == 0
    assert main([*add, *voices]) == 2  # exists, no --force
    assert "--force" in capsys.readouterr().err
    assert main(["voice", "list", *voices]) == 0
    assert "alice\tcosyvoice2\t3.0 s\tGood morning." in capsys.readouterr().out
    out = tmp_path / "o.wav"
    assert main(["say", *m, "--voice", "alice", *voices, "--seed", "1", "--flow-steps", "2", "Hello there.",
                 "-o", str(out)]) == 0  # fmt: skip
    wave, sr = sf.read(out)
    assert sr == 24000 and len(wave) > 0
    assert "RTF" in capsys.readouterr().err
    assert main(["voice", "rm", "alice", *voices]) == 0
    assert main(["say", *m, "--voice", "alice", *voices, "Hi."]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no voice named 'alice'" in err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--prompt-wav", "{prompt}", "--speed", "5", "x"], "speed = 5.0 is out of range"),
        (["x"], "give --voice NAME or --prompt-wav FILE"),
        (["--prompt-wav", "{prompt}", "   "], "text is empty"),
        (["--prompt-wav", "{missing}", "x"], "does not exist"),
        (["--voice", "../etc", "x"], "is not allowed"),
    ],
)
def test_say_errors_are_one_line(tiny_export_dir: Path, prompt: Path, tmp_path: Path, capsys, argv, message) -> None:
    argv = [a.format(prompt=prompt, missing=tmp_path / "nope.wav") for a in argv]
    assert main(["say", "-m", str(tiny_export_dir), "--voices", str(tmp_path), *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err and "Traceback" not in err


def test_say_runs_with_torch_blocked_and_streams_pcm(tiny_export_dir: Path, prompt: Path) -> None:
    code = ("import sys; sys.modules['torch'] = None\n"
            "from cosyvoice_cpu.cli.main import main\n"
            "raise SystemExit(main(sys.argv[1:]))\n")  # fmt: skip
    argv = ["say", "-m", str(tiny_export_dir), "--prompt-wav", str(prompt), "--prompt-text", "Good morning.",
            "--seed", "2", "--flow-steps", "2", "-o", "-"]  # fmt: skip
    r = subprocess.run([sys.executable, "-c", code, *argv], input=b"First line.\n?!\nSecond line.\n",
                       capture_output=True, timeout=300)  # fmt: skip
    assert r.returncode == 1, r.stderr.decode()  # the punctuation-only line is skipped, the others are spoken
    assert b"skipped '?!'" in r.stderr
    pcm = np.frombuffer(r.stdout, "<i2")
    assert len(pcm) > 0 and len(pcm) % 960 == 0  # whole tokens: 2 mel frames x 480 samples
    assert b"First line." in r.stderr and b"Second line." in r.stderr


def test_say_stream_with_torch_blocked_gives_the_same_length_as_whole_sentences(
    tiny_export_dir: Path, prompt: Path
) -> None:
    code = ("import sys; sys.modules['torch'] = None\n"
            "from cosyvoice_cpu.cli.main import main\n"
            "raise SystemExit(main(sys.argv[1:]))\n")  # fmt: skip
    argv = ["say", "-m", str(tiny_export_dir), "--prompt-wav", str(prompt), "--prompt-text", "Good morning.",
            "--seed", "5", "--flow-steps", "2", "-o", "-", "Streaming from the command line works."]  # fmt: skip
    runs, chunks = {}, {}
    for extra in ([], ["--stream", "--first-chunk-tokens", "8"]):
        r = subprocess.run([sys.executable, "-c", code, *argv, *extra], capture_output=True, timeout=300)
        assert r.returncode == 0, r.stderr.decode()
        runs[bool(extra)] = np.frombuffer(r.stdout, "<i2")
        found = re.search(rb"of audio in (\d+) chunks", r.stderr)
        assert found, r.stderr.decode()
        chunks[bool(extra)] = int(found.group(1))
    assert len(runs[True]) == len(runs[False]) > 0  # the same speech tokens, streamed in chunks
    assert chunks[True] >= chunks[False] + 2  # several chunks per sentence
