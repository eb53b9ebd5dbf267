"""``plan --ip-adapter``'s encoder stage against transformers' CLIP vision forward (host venv).

sd-webui-controlnet's CLIP vision configs (ViT-H, ViT-bigG: read from its ``annotator/clipvision``
in the WebUI checkout) built on the meta device with transformers (4.30.2 in the host venv),
run with ``output_hidden_states=True`` as the extension runs it, on fake tensors under the
live-byte counter: the peak and what the output keeps, against ``ip_adapter_bytes``.

  PYTHONPATH=. /work/webui-venv/bin/python tests/acceptance/ipadapter_encoder_check.py
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import CLIPVisionConfig, CLIPVisionModelWithProjection

from lib_vram.cli.stageplan import ip_adapter_bytes
from lib_vram.core.livebytes import LiveBytesCounter
from lib_vram.core.predict import fake_call, fake_state, new_fake_mode

SRC = "/work/webui/extensions/sd-webui-controlnet/annotator/clipvision/__init__.py"


def main() -> None:
    src = Path(SRC).read_text()
    configs: dict = {}
    exec(src[src.index("config_clip_g") : src.index("configs = ")], configs)  # (plain dict literals)
    for kind, name in (("sd15", "config_clip_h"), ("sdxl", "config_clip_g")):
        with torch.device("meta"):
            model = CLIPVisionModelWithProjection(CLIPVisionConfig(**configs[name])).eval()
        mode = new_fake_mode()
        call = fake_call(model, fake_state(model, mode, torch.float32))
        with mode:
            x = torch.empty(1, 3, 224, 224)
        counter = LiveBytesCounter(None)
        with torch.no_grad(), mode, counter:
            out = call(pixel_values=x, output_hidden_states=True)
            kept = counter.live_bytes
        del out
        b = ip_adapter_bytes(kind, kind)
        want = b["encode"] - x.numel() * 4  # (the image is the input here)
        print(f"{kind}: activations measured {counter.peak_bytes:,} predicted {want:,} "
              f"({100 * (want / counter.peak_bytes - 1):+.1f} %); output kept {kept:,} vs {b['output']:,}")  # fmt: skip


if __name__ == "__main__":
    main()
