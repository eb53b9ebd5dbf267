from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"vram_guard_{name}", ROOT / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_preload_adds_namespaced_flags():
    parser = argparse.ArgumentParser()
    _load("preload").preload(parser)
    args = parser.parse_args(["--vram-guard-preset", "6GB", "--vram-guard-log-level", "DEBUG"])
    assert args.vram_guard_preset == "6GB" and args.vram_guard_log_level == "DEBUG"
    assert args.vram_guard_disable is False
    assert all(a.dest.startswith("vram_guard_") for a in parser._actions if a.dest != "help")


def test_preload_is_import_light():
    code = (
        "import importlib.util, sys; "
        f"spec = importlib.util.spec_from_file_location('p', {str(ROOT / 'preload.py')!r}); "
        "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m); "
        "print(sorted({'torch','gradio','lib_vram'} & set(sys.modules)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_install_is_idempotent_and_silent_when_complete():
    for _ in range(2):
        out = subprocess.run(
            [sys.executable, str(ROOT / "install.py")], capture_output=True, text=True, check=True, cwd="/"
        )
        assert out.stdout == ""


def test_install_reports_missing_package(monkeypatch, capsys):
    install = _load("install")
    monkeypatch.setitem(install.REQUIRED, "surely_not_a_module_xyz", "Surely-not")
    assert install.main() == 1
    assert "Surely-not" in capsys.readouterr().out
