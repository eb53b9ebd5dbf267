"""Issue 42 item 1 in a real WebUI: ControlNet's preprocessor models on an emulated card.

Talks to a running AUTOMATIC1111 WebUI (``--api``, sd-webui-controlnet v1.1.455 with the random
annotator models of ``host/make_preprocessors.py`` under ``--controlnet-annotator-models-path``)
by HTTP only. Cases, in the order given (``--cases``):

* ``ip`` — txt2img with one IP-Adapter unit (``ip-adapter_sd15_random``) whose preprocessor
  ``ip-adapter_clip_sd15`` runs IP-Adapter's CLIP vision encoder (ViT-H, 2.5 GB in FP32);
* ``depth`` — txt2img with one ControlNet unit (``control_sd15_random``) and the ``depth_midas``
  preprocessor (DPT-Hybrid, 0.5 GB);
* ``ip2`` — ``ip`` with another control image (the picture flipped): ControlNet's preprocessor
  cache misses, so the encoder runs again (with VRAM Guard: woken from host memory, no disk load);
* ``ipdepth`` — both units in one job;
* ``off`` — txt2img without ControlNet.

Modes: ``ref`` (VRAM Guard's accordion off, a card nothing runs out of: the pictures go to
``--out``) and ``run`` (VRAM Guard on, or off with ``--plain``): each picture against the
reference's (max level difference), the job's wall time, the card after it (resident bytes: what
stays on it between jobs) and the models the status route lists. One JSON line per case in
``--out/run.jsonl``, one printed line per case.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import sys
import time
from pathlib import Path

import numpy as np
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parent))
from webui_acceptance import call, decode, init_image  # noqa: E402
from webui_controlnet import model_names, status  # noqa: E402

UNITS = {
    "ip": ("ip-adapter_clip_sd15", "ip-adapter_sd15_random"),
    "depth": ("depth_midas", "control_sd15_random"),
}


def job(case: str, a: argparse.Namespace, vg: bool, names: dict[str, str]) -> dict:
    s = a.size
    body = {"prompt": "a red apple on a wooden table", "negative_prompt": "", "cfg_scale": 7,
            "sampler_name": "Euler a", "seed": 1234, "steps": a.steps, "width": s, "height": s}  # fmt: skip
    scripts: dict = {"VRAM Guard": {"args": [{"enabled": vg}]}}
    units = {"ip": ["ip"], "ip2": ["ip"], "depth": ["depth"], "ipdepth": ["ip", "depth"], "off": []}.get(case)
    if units is None:
        raise SystemExit(f"unknown case {case!r}: ip, ip2, depth, ipdepth or off")
    image = init_image(s)
    if case == "ip2":
        flipped = Image.open(io.BytesIO(base64.b64decode(image))).transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        buf = io.BytesIO()
        flipped.save(buf, "PNG")
        image = base64.b64encode(buf.getvalue()).decode()
    if units:
        scripts["controlnet"] = {"args": [{
            "enabled": True, "module": UNITS[u][0], "model": names[UNITS[u][1]], "weight": 1.0,
            "image": image, "resize_mode": "Crop and Resize", "processor_res": s,
            "control_mode": "Balanced", "pixel_perfect": False,
        } for u in units]}  # fmt: skip
    body["alwayson_scripts"] = scripts
    return body


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("mode", choices=("ref", "run"))
    ap.add_argument("--url", default="http://127.0.0.1:7872")
    ap.add_argument("--out", required=True)
    ap.add_argument("--ref", help="run: the ref mode's --out")
    ap.add_argument("--cases", default="depth,ip,ip2,ipdepth,off")
    ap.add_argument("--size", type=int, default=256)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--plain", action="store_true", help="run: VRAM Guard's accordion off (the plain WebUI)")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    wanted = [m for _, m in UNITS.values()]
    names = dict(zip(wanted, model_names(a.url, wanted)[: len(wanted)], strict=True))
    failed = 0
    with (out / "run.jsonl").open("a") as log:
        for n, case in enumerate(a.cases.split(",")):
            t0 = time.time()
            try:
                body, _ = call(
                    a.url, "/sdapi/v1/txt2img", job(case, a, a.mode == "run" and not a.plain, names)
                )
                error = None
            except RuntimeError as exc:
                body, error = {}, str(exc)[:400]
            rec = {
                "case": case,
                "index": n,
                "ok": error is None,
                "error": error,
                "seconds": round(time.time() - t0, 1),
            }
            st = status(a.url)
            rec["card"] = st.get("card")
            rec["models"] = [(m["name"], m["where"], m["mib"]) for m in st.get("models") or []]
            rec["moves"] = (st.get("moves") or [])[-6:]
            imgs = [decode(i) for i in (body.get("images") or [])[:1]]  # (ControlNet appends its maps)
            diff = None
            if imgs:
                Image.fromarray(imgs[0]).save(out / f"{n:02d}-{case}.png")
                if a.mode == "ref":
                    Image.fromarray(imgs[0]).save(out / f"{case}.png")
                elif a.ref and (Path(a.ref) / f"{case}.png").is_file():
                    r = np.asarray(Image.open(Path(a.ref) / f"{case}.png").convert("RGB")).astype(int)
                    diff = int(np.abs(r - imgs[0].astype(int)).max()) if r.shape == imgs[0].shape else None
            rec["max_levels_vs_ref"] = diff
            log.write(json.dumps(rec) + "\n")
            log.flush()
            failed += not rec["ok"]
            card = rec["card"] or {}
            mib = {k: round(card.get(k, 0) / 2**20) for k in ("resident_bytes", "peak_bytes")}
            on_card = [m[0] for m in rec["models"] if m[1] == "card"]
            print(f"{n:2d} {case:6s} ok={rec['ok']} {rec['seconds']:6.1f}s max_levels={diff} "
                  f"resident_after={mib['resident_bytes']} MiB peak={mib['peak_bytes']} MiB "
                  f"on_card={on_card} | {(rec['error'] or '')[:200]}", flush=True)  # fmt: skip
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
