"""VRAM Guard install check, run by the WebUI launcher at every start.

VRAM Guard needs only what the WebUI already ships (torch, numpy, pillow, safetensors, psutil,
spandrel, gradio), so this script installs nothing: it checks, quickly and without importing the
heavy packages, that they are present, and says clearly what is missing.
"""

from __future__ import annotations

import importlib.util
import sys

REQUIRED = {
    "torch": "PyTorch",
    "numpy": "numpy",
    "PIL": "Pillow",
    "safetensors": "safetensors",
    "psutil": "psutil",
    "spandrel": "spandrel (tiled upscaling of ESRGAN-family models)",
    "gradio": "gradio (the VRAM Guard accordion)",
}


def missing_modules() -> list[str]:
    return [label for module, label in REQUIRED.items() if importlib.util.find_spec(module) is None]


def main() -> int:
    missing = missing_modules()
    if missing:
        sys.stdout.write(
            "[VRAM Guard] missing packages the WebUI normally ships: "
            + ", ".join(missing)
            + ". Re-run the WebUI installer (webui.sh / webui-user.bat) without --skip-install.\n"
        )
        return 1
    return 0


if __name__ == "__main__":
    main()
