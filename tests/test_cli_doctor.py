from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest

from lib_vram.cli import doctor as _cli_doctor
from lib_vram.cli import main

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _restore_lib_vram_logger():
    """main() configures the lib_vram logger (handler, level, propagate); undo it for other tests."""
    logger = logging.getLogger("lib_vram")
    saved = (list(logger.handlers), logger.level, logger.propagate)
    yield
    logger.handlers[:] = saved[0]
    logger.setLevel(saved[1])
    logger.propagate = saved[2]


# The documented, stable keys of `doctor --json` (docs/command-line.md, "`doctor --json` keys").
TOP_KEYS = {
    "schema",
    "vram_guard_version",
    "device",
    "backend",
    "name",
    "cpu_only",
    "memory",
    "torch",
    "precision",
    "tier",
    "recommended_preset",
    "notes",
}
MEMORY_KEYS = {
    "basis",
    "total_bytes",
    "free_bytes",
    "allocated_bytes",
    "reserved_bytes",
    "peak_allocated_bytes",
    "peak_reserved_bytes",
    "process_rss_bytes",
    "system_total_bytes",
    "system_available_bytes",
}


def test_doctor_json_has_stable_keys(capsys):
    assert main(["doctor", "--json", "--device", "cpu"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert set(report) >= TOP_KEYS
    assert set(report["memory"]) == MEMORY_KEYS
    assert set(report["torch"]) == {"version", "cuda", "hip", "sdpa", "xformers"}
    assert set(report["precision"]) == {"fp16", "bf16"}
    assert set(report["tier"]) == {"gb", "label"}
    assert report["cpu_only"] is True and report["backend"] == "cpu"
    assert report["notes"] and "No GPU" in report["notes"][0]


def test_doctor_keys_are_documented():
    text = (ROOT / "docs" / "command-line.md").read_text()
    start = text.index("### `doctor --json` keys")
    section = text[start : text.index("\n## ", start)]
    for key in TOP_KEYS | MEMORY_KEYS:
        assert f"`{key}`" in section, f"doctor key {key!r} missing from docs/command-line.md"


def test_doctor_table_mentions_cpu_only(capsys):
    assert main(["doctor", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "memory tier" in out and "No GPU found" in out


def test_doctor_as_module_subprocess():
    out = subprocess.run(
        [sys.executable, "-m", "lib_vram", "doctor", "--json"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    assert json.loads(out.stdout)["schema"] == _cli_doctor.SCHEMA_VERSION


def test_bad_log_level_is_an_error(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--log-level", "LOUD", "doctor"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "LOUD" in err and err.count("\n") == 1  # one line, no usage block


@pytest.mark.parametrize(
    "command", [["doctor"], ["plan", "--arch", "sd15", "--width", "512", "--height", "512"]]
)
@pytest.mark.parametrize(("device", "words"), [("banana", "not a device name"), ("cuda", "no CUDA GPU")])
def test_bad_device_is_one_line(capsys, command, device, words):
    import torch

    if device == "cuda" and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert main([*command, "--device", device]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: `--device {device}`") and words in err and err.count("\n") == 1


def test_unexpected_error_is_one_line_and_debug_shows_the_traceback(capsys, monkeypatch):
    def boom(device=None):
        raise RuntimeError("probe failed\nsecond line")

    monkeypatch.setattr(_cli_doctor, "collect", boom)
    assert main(["doctor"]) == 1
    err = capsys.readouterr().err
    assert err == "error: RuntimeError: probe failed (run with --debug for the traceback)\n"
    assert main(["doctor", "--debug"]) == 1
    assert "Traceback" in capsys.readouterr().err
    assert main(["--debug", "doctor"]) == 1
    assert "Traceback" in capsys.readouterr().err
