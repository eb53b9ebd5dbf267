"""The core of lib_vram never imports the WebUI, gradio, ldm or sgm (fresh interpreter)."""

from __future__ import annotations

import json
import pkgutil
import subprocess
import sys
from pathlib import Path

import lib_vram

ROOT = Path(__file__).resolve().parents[1]
FORBIDDEN = ("modules", "launch", "gradio", "ldm", "sgm")
# Only these may touch the host or gradio; scripts/ is their only importer.
NON_CORE_PREFIXES = ("lib_vram.webui", "lib_vram.webui.ui")


def core_modules() -> list[str]:
    names = ["lib_vram"]
    for info in pkgutil.walk_packages(lib_vram.__path__, prefix="lib_vram."):
        if info.name.startswith(NON_CORE_PREFIXES):
            continue
        names.append(info.name)
    return sorted(names)


PROBE = """
import importlib, json, sys
forbidden = {forbidden!r}
bad = {{}}
for name in {names!r}:
    before = set(sys.modules)
    importlib.import_module(name)
    new = {{m.split(".")[0] for m in set(sys.modules) - before}}
    hit = sorted(new & set(forbidden))
    if hit:
        bad[name] = hit
print(json.dumps(bad))
"""


def test_core_modules_found():
    names = core_modules()
    assert "lib_vram.core.device" in names and "lib_vram.core.tracker" in names


def test_core_imports_no_host_modules():
    names = core_modules()
    code = PROBE.format(forbidden=FORBIDDEN, names=names)
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True, timeout=300
    )
    bad = json.loads(out.stdout.strip().splitlines()[-1])
    assert bad == {}, f"core modules import host/gradio/ldm/sgm modules: {bad}"


def test_probe_detects_a_forbidden_import(tmp_path):
    """The probe itself can fail: a module that imports a forbidden name is reported."""
    pkg = tmp_path / "fakecore"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "bad.py").write_text("import modules\n")
    (tmp_path / "modules").mkdir()
    (tmp_path / "modules" / "__init__.py").write_text("")
    code = PROBE.format(forbidden=FORBIDDEN, names=["fakecore.bad"])
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True, timeout=120
    )
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {"fakecore.bad": ["modules"]}
