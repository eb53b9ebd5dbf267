"""Build the VRAM Guard accordion and Extras section inside whatever gradio is installed.

The unit tests build the UI in gradio 3.41.2 (AUTOMATIC1111's version). Forge runs gradio 4.x; run
this script in an environment with that gradio (plus torch) to check the same code builds there:

    python tests/acceptance/ui_build_check.py

It builds both tabs (plain accordion and a WebUI-style ``InputAccordion``), the Extras section,
wires the "Free memory now" button and the preset-change event, checks the input order against
``API_ARG_ORDER`` and prints one JSON line. Exit status 0 = built and consistent.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import gradio as gr  # noqa: E402

from lib_vram.webui import ui  # noqa: E402
from lib_vram.webui.options import API_ARG_ORDER, VRAMGuardOptions  # noqa: E402


def main() -> int:
    defaults = VRAMGuardOptions()
    built: dict[str, object] = {"gradio": gr.__version__}
    with gr.Blocks() as demo:
        for tab in ("txt2img", "img2img"):
            w = ui.build_ui(tab=tab, defaults=defaults, on_free=lambda: "<p>freed</p>")
            ok = [id(c) for c in w.inputs] == [id(w.controls[n]) for n in API_ARG_ORDER]
            built[tab] = {"inputs": len(w.inputs), "order_ok": ok}
            if not ok:
                print(json.dumps(built))
                return 1
        ex = ui.build_extras_ui(defaults)
        built["extras"] = sorted(ex) if isinstance(ex, dict) else type(ex).__name__
    built["blocks"] = type(demo).__name__
    built["components"] = len(demo.blocks)
    print(json.dumps(built))
    return 0


if __name__ == "__main__":
    sys.exit(main())
