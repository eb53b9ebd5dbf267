"""A random-weight YOLOv8n detector for ADetailer on the offline host (run with the host venv).

Built from ultralytics' own ``yolov8n.yaml`` (the package's model config; nothing is downloaded) with
PyTorch's default initialisation from a fixed seed, and saved with ultralytics' own checkpoint
writer as ``models/adetailer/vg-yolov8n-random.pt``, where ADetailer lists ``.pt`` files
(``models/adetailer``; start the WebUI with ``--ad-no-huggingface`` so it does not reach for its
hub models). A random detector finds nothing at ADetailer's default confidence; at confidence 0
it always returns boxes, so ADetailer's inpaint pass always runs. ``--check`` loads the file the way
ADetailer does and prints what it detects on a synthetic picture at confidence 0.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("YOLO_OFFLINE", "true")  # no online checks (ultralytics reads it at import)

import numpy as np  # noqa: E402
import torch  # noqa: E402

NAME = "vg-yolov8n-random.pt"


def build(out: Path, seed: int = 5) -> None:
    from ultralytics import YOLO

    torch.manual_seed(seed)
    model = YOLO("yolov8n.yaml")  # the package's yaml: random weights, 80 classes
    model.save(str(out))
    n = sum(p.numel() for p in model.model.parameters())
    print(f"{out}: yolov8n.yaml, {n / 1e6:.2f} M parameters, {out.stat().st_size / 2**20:.1f} MiB")


def check(path: Path) -> None:
    from PIL import Image
    from ultralytics import YOLO

    rng = np.random.default_rng(7)
    img = Image.fromarray(rng.integers(0, 255, (256, 256, 3), dtype=np.uint8))
    pred = YOLO(str(path))(img, conf=0.0, device="cpu", verbose=False)
    boxes = pred[0].boxes.xyxy.cpu().numpy()
    print(
        f"{path.name}: {len(boxes)} box(es) at confidence 0 on a 256x256 picture; first {boxes[:1].tolist()}"
    )
    if len(boxes) == 0:
        raise SystemExit("the detector found nothing at confidence 0: ADetailer would not run its pass")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--webui", default="/work/webui")
    ap.add_argument("--force", action="store_true")
    ap.add_argument("--no-check", action="store_true")
    a = ap.parse_args()
    out_dir = Path(a.webui) / "models" / "adetailer"
    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / NAME
    if out.exists() and not a.force:
        print(f"{out}: kept (--force rebuilds)")
    else:
        build(out)
    if not a.no_check:
        check(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
