"""Issue 30 in a real WebUI: ControlNet (sd-webui-controlnet) jobs against the uncapped pictures.

Talks to a running AUTOMATIC1111 WebUI (``--api``) with sd-webui-controlnet installed, by HTTP only.
Each case is a txt2img/img2img request with ControlNet units (preprocessor ``none``: the control
image is the hint as it is, so no annotator download and no preprocessor rounding):

* ``one`` — one unit; ``two``, ``three`` — two and three units with their own model files;
* ``two_hires`` — hires fix (Latent) with two units on both passes; ``two_img2img`` — img2img;
* ``lowres`` — hires fix (Latent) with the unit on "Low res only" (the hires pass does not use it);
  ``hires`` — the same with the unit on "Both";
* ``img2img`` — img2img with one unit; ``off`` — a job without ControlNet (run it after one with);
* ``one_lowvram``, ``two_lowvram``, ``three_lowvram`` — the units with ControlNet's own Low VRAM
  (compared with the case's picture without it; ``--lowvram-probe FILE``: a WebUI started with
  ``--lowvram`` and ``webui_lowvram_probe/``: the bytes it and ControlNet moved per step);
* ``ip`` / ``ip_plus`` — one IP-Adapter unit (``ip-adapter(-plus)_sd15_random``, made by
  ``host/make_ipadapter.py``) whose CLIP vision output comes through the API's ``ipadapter_input``
  (random, seed fixed: no encoder model needed); ``ip_sdxl`` / ``ip_plus_sdxl`` the same with
  ``ip-adapter_sdxl_random`` (ViT-bigG's embedding) and ``ip-adapter-plus_sdxl_vit-h_random``;
  ``ip_faceid``: ``ip-adapter-faceid_sd15_random`` given a random insightface embedding (512).

``--models A,B``: the ControlNet model files (default the three SD1.5 ones; an SDXL checkpoint takes
``control_sdxl_mid_random``, the status's placement and notes are kept). ``--batch N``: N images
per job (the UNet's batch is 2N with cond and uncond; where its whole batch
does not fit VRAM Guard micro-batches through ControlNet's hook); the first image is compared.

Modes: ``ref`` (a WebUI with nothing capped: VRAM Guard's accordion off; the pictures go to
``--out``) and ``run`` (``--cases`` in order, with VRAM Guard on, or off with ``--plain``): each
picture against the reference's (max level difference), the status route's card peak and the
moves the owner made during the job (and how many bytes they moved). One JSON line per case in
``--out/run.jsonl``, one printed line per case.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parent))
from webui_acceptance import _probe_delta, _read_json, call, decode, init_image  # noqa: E402

CASES = (
    "one",
    "two",
    "three",
    "two_hires",
    "two_img2img",
    "lowres",
    "hires",
    "img2img",
    "off",
    "one_lowvram",
    "two_lowvram",
    "three_lowvram",
    "ip",
    "ip_plus",
    "ip_sdxl",
    "ip_plus_sdxl",
    "ip_faceid",
)
MODELS = ("control_sd15_random", "control_sd15_random-b", "control_sd15_random-c")
IP_MODELS = {"ip": "ip-adapter_sd15_random", "ip_plus": "ip-adapter-plus_sd15_random",
             "ip_sdxl": "ip-adapter_sdxl_random", "ip_plus_sdxl": "ip-adapter-plus_sdxl_vit-h_random",
             "ip_faceid": "ip-adapter-faceid_sd15_random"}  # fmt: skip


def clip_output(embed: int = 1024) -> str:
    """A CLIP vision output as sd-webui-controlnet's encoder returns it (``image_embeds``: ViT-H's
    1024, ViT-bigG's 1280; ViT-H's hidden states, of which plus reads the second last), or
    ``embed=512``: insightface's face embedding alone; torch-saved and base64-encoded."""
    import base64
    import io

    import torch

    g = torch.Generator().manual_seed(7)
    out = {"image_embeds": torch.randn(1, embed, generator=g),
           "hidden_states": [torch.randn(1, 257, 1280, generator=g) for _ in range(2)]}  # fmt: skip
    out = out["image_embeds"] if embed == 512 else out
    buf = io.BytesIO()
    torch.save(out, buf)
    return base64.b64encode(buf.getvalue()).decode()


def unit(a: argparse.Namespace, model: str, *, hr_option: str = "Both", low_vram: bool = False) -> dict:
    return {
        "enabled": True, "module": "none", "model": model, "weight": 1.0,
        "image": init_image(a.size), "resize_mode": "Crop and Resize", "low_vram": low_vram,
        "processor_res": a.size, "guidance_start": 0.0, "guidance_end": 1.0, "control_mode": "Balanced",
        "pixel_perfect": False, "hr_option": hr_option,
    }  # fmt: skip


def job(case: str, a: argparse.Namespace, vg: bool, models: list[str]) -> tuple[str, dict]:
    s = a.size
    base = {"prompt": "a red apple on a wooden table", "negative_prompt": "", "cfg_scale": 7,
            "sampler_name": "Euler a", "seed": 1234, "steps": a.steps, "width": s, "height": s,
            "batch_size": a.batch}  # fmt: skip
    scripts: dict = {"VRAM Guard": {"args": [{"enabled": vg}]}}
    units: list[dict] = []
    path = "/sdapi/v1/txt2img"
    low_vram = case.endswith("_lowvram")
    case = case.removesuffix("_lowvram")
    hires = dict(
        enable_hr=True, hr_scale=2, hr_second_pass_steps=1, denoising_strength=0.5, hr_upscaler="Latent"
    )
    if case in ("one", "img2img"):
        units = [unit(a, models[0], low_vram=low_vram)]
    elif case in ("two", "three", "two_hires", "two_img2img"):
        units = [unit(a, m, low_vram=low_vram) for m in models[: 3 if case == "three" else 2]]
        base.update(hires if case == "two_hires" else {})
    elif case in ("lowres", "hires"):
        units = [unit(a, models[0], hr_option="Low res only" if case == "lowres" else "Both")]
        base.update(hires)
    elif case in IP_MODELS:
        hit = next((n for n in models if n.split(" [")[0] == IP_MODELS[case]), IP_MODELS[case])
        units = [
            dict(
                unit(a, hit), ipadapter_input=clip_output({"ip_sdxl": 1280, "ip_faceid": 512}.get(case, 1024))
            )
        ]
    elif case != "off":
        raise SystemExit(f"unknown case {case!r}; one of {', '.join(CASES)}")
    if case.endswith("img2img"):
        path = "/sdapi/v1/img2img"
        base.update(init_images=[init_image(s)], denoising_strength=0.6)
    if units:
        scripts["controlnet"] = {"args": units}
    base["alwayson_scripts"] = scripts
    return path, base


def model_names(url: str, wanted: list[str]) -> list[str]:
    body, _ = call(url, "/controlnet/model_list", method="GET", timeout=60)
    names = body.get("model_list") or []
    out = []
    for want in wanted:
        hit = next((n for n in names if n.split(" [")[0] == want), None)
        if hit is None:
            print(f"ControlNet model {want!r} not listed by the WebUI (its cases fail): {names}", flush=True)
        out.append(hit or want)
    return out + [n for n in names if n.split(" [")[0] in IP_MODELS.values()]


def status(url: str) -> dict:
    try:
        st, _ = call(url, "/vram-guard/v1/status", timeout=60)
        return st
    except RuntimeError as exc:
        return {"error": str(exc)[:200]}


def run_case(a: argparse.Namespace, case: str, vg: bool, models: list[str]) -> dict:
    path, payload = job(case, a, vg, models)
    before = status(a.url).get("moves") or []
    probe0 = _read_json(a.lowvram_probe)
    t0 = time.time()
    try:
        body, _ = call(a.url, path, payload)
        error = None
    except RuntimeError as exc:
        body, error = {}, str(exc)[:400]
    rec = {
        "case": case,
        "vram_guard": vg,
        "ok": error is None,
        "error": error,
        "seconds": round(time.time() - t0, 1),
    }
    imgs = [decode(i) for i in (body.get("images") or [])[:1]]  # (ControlNet appends its control images)
    rec["images"] = imgs
    st = status(a.url)
    moves = st.get("moves") or []
    new = moves[len(before) :] if moves[: len(before)] == before else moves
    rec["moves"] = new
    rec["card"] = st.get("card")
    rec["models"] = st.get("models")
    rec["stages"] = [{k: s.get(k) for k in ("stage", "plan", "peak_bytes")} for s in st.get("stages") or []]
    rec["placement"], rec["notes"] = st.get("placement"), st.get("notes")
    if a.lowvram_probe:
        rec["lowvram"] = _probe_delta(probe0, _read_json(a.lowvram_probe))
    return rec


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("mode", choices=("ref", "run"))
    ap.add_argument("--url", default="http://127.0.0.1:7863")
    ap.add_argument("--out", required=True)
    ap.add_argument("--ref", help="run: the ref mode's --out")
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--size", type=int, default=128)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument(
        "--models", default=",".join(MODELS), help="ControlNet model names (the first for one unit)"
    )
    ap.add_argument("--batch", type=int, default=1, help="images per job (the first one is compared)")
    ap.add_argument("--plain", action="store_true", help="run: VRAM Guard's accordion off (the plain WebUI)")
    ap.add_argument("--lowvram-probe", help="the lowvram probe's counter file (its VG_LOWVRAM_PROBE)")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    models = model_names(a.url, a.models.split(","))
    failed = 0
    with (out / "run.jsonl").open("a") as log:
        for n, case in enumerate(a.cases.split(",")):
            rec = run_case(a, case, vg=a.mode == "run" and not a.plain, models=models)
            imgs = rec.pop("images")
            rec["index"] = n
            if imgs:
                Image.fromarray(imgs[0]).save(out / f"{n:02d}-{case}.png")
                if a.mode == "ref":
                    Image.fromarray(imgs[0]).save(out / f"{case}.png")
            diff = None
            ref = Path(a.ref or "") / f"{case}.png"
            if not ref.is_file():
                ref = ref.with_name(case.removesuffix("_lowvram") + ".png")
            if a.mode == "run" and imgs and a.ref and ref.is_file():
                r = np.asarray(Image.open(ref).convert("RGB")).astype(int)
                diff = int(np.abs(r - imgs[0].astype(int)).max()) if r.shape == imgs[0].shape else None
            rec["max_levels_vs_ref"] = diff
            log.write(json.dumps(rec) + "\n")
            log.flush()
            failed += not rec["ok"]
            peak = (rec.get("card") or {}).get("peak_bytes")
            cn = [m for m in rec["moves"] if m.startswith("ControlNet")]
            moved = (rec.get("lowvram") or {}).get("moved_mib_per_step")
            print(f"{n:2d} {case:12s} ok={rec['ok']} {rec['seconds']:6.1f}s max_levels={diff} "
                  f"card_peak={peak} controlnet_moves={len(cn)} moved_mib_per_step={moved} | {(rec['error'] or '')[:160]}", flush=True)  # fmt: skip
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
