"""Acceptance of VRAM Guard beside the extensions that change the UNet's forward or run passes of
their own (issue 41), against a running AUTOMATIC1111 v1.10.1 (``--api``); see
docs/webui-extensions.md for the host, the commands and the results.

usage: webui_extensions.py table --out DIR   (the last record of each case/card/mode, as Markdown)
       webui_extensions.py ref|run [--plain] --cases base,td_multi,... [--url URL] [--out DIR]
       [--log WEBUI_LOG] [--size PX] [--steps N]

* ``ref`` — the plain WebUI without VRAM Guard (a ``--data-dir`` without the ``vram-guard`` link,
  ``tests/acceptance/host/datadir.sh``): each case's pictures, saved to ``OUT/ref/``.
* ``run --plain`` — the WebUI with VRAM Guard and an emulated card (``--vram-guard-emulate-vram``),
  the accordion off (``"VRAM Guard": {"args": [false]}``): the plain WebUI on that card. Records
  whether the job finished (or its error), the card's peak for the job, the pictures' difference
  from ``ref``.
* ``run`` — the same start, VRAM Guard on (every field at its shipped default): finished or not,
  peak, the readout's notes and stage plans, the VRAM Guard lines of the WebUI log during the job
  (``--log``), the difference from ``ref`` and from the plain run on the same card (when it ran
  before and finished).

Pictures are compared by their largest difference in 8-bit levels over every picture of the job
(0 = identical; AnimateDiff's frames all count). One JSON line per job is appended to
``OUT/results.jsonl``; pictures go to ``OUT/<mode>/<case>-<card>-N.png``.

Cases (txt2img unless said; seed 1234, Euler a, CFG 7, ``--size``/``--steps``):
  base        the stock forward
  td_multi    Tiled Diffusion, MultiDiffusion (``--td-size``, ``--td-tile`` latent tiles, overlap 8,
              tile batch ``--td-batch``)
  td_mixture  Tiled Diffusion, Mixture of Diffusers (same)
  hypertile   the WebUI's HyperTile U-Net (``override_settings``: max tile ``--hypertile-tile``)
  tome        the WebUI's token merging (``override_settings``: ratio 0.5)
  adetailer   ADetailer with the random YOLOv8n at confidence 0 (always detects: its inpaint pass
              always runs), mask top 1, inpaint at ``--ad-inpaint`` px
  usdu        img2img of a synthetic ``--size`` picture with Ultimate SD Upscale x2 (``--usdu-upscaler``,
              256-px tiles, denoising 0.35); with the fixed-RNG helper (``VG_FIXED_RNG``)
  kohya       Kohya Hires.fix (Deep Shrink), its defaults (depth 3 / 4, stop at 0.15 / 0.3)
  freeu       FreeU version 2 (b 1.2 / 1.4, s 0.9 / 0.2)
  sag         Self-Attention Guidance (scale 0.75, threshold 1.0)
  ad8, ad16   AnimateDiff, V2 random motion module, 8 / 16 frames (``--ad-size``)
  ad8v1       AnimateDiff, V1 random motion module (its GroupNorm32 patch), 8 frames
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

import numpy as np
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parent))
from webui_acceptance import DEFAULTS, call, decode, init_image  # noqa: E402

PROMPT = {"prompt": "a red apple on a wooden table", "negative_prompt": "", "cfg_scale": 7,
          "sampler_name": "Euler a", "seed": 1234, "batch_size": 1, "n_iter": 1}  # fmt: skip
MIB = 2**20
VG_LINE = re.compile(r"VRAM Guard|Traceback|Error|error:|\*\*\* ")


def cases(a: argparse.Namespace, upscalers: list[str]) -> dict[str, tuple[str, dict]]:
    base = dict(PROMPT, steps=a.steps, width=a.size, height=a.size)

    def alwayson(payload: dict, name: str, args: list) -> dict:
        scripts = dict(payload.get("alwayson_scripts") or {}, **{name: {"args": args}})
        return dict(payload, alwayson_scripts=scripts)

    def tiled(method: str) -> dict:
        p = dict(base, width=a.td_size, height=a.td_size)
        # enabled, method, overwrite_size, keep_input_size, image w/h, tile w/h (latent), overlap,
        # tile batch, upscaler, scale, noise inversion (5), control_tensor_cpu, bbox control,
        # draw_background, causal_layers
        return alwayson(p, "Tiled Diffusion", [True, method, False, True, a.td_size, a.td_size, a.td_tile,
                                               a.td_tile, 8, a.td_batch, "None", 2.0, False, 10, 1.0, 1.0, 64,
                                               False, False, False, False])  # fmt: skip

    def animatediff(frames: int, model: str) -> dict:
        p = dict(base, width=a.ad_size, height=a.ad_size)
        return alwayson(p, "AnimateDiff", [{"model": model, "enable": True, "video_length": frames,
                                            "batch_size": frames, "fps": 8, "format": ["PNG"]}])  # fmt: skip

    usdu_index = upscalers.index(a.usdu_upscaler) if a.usdu_upscaler in upscalers else -1
    ad = {"ad_model": "vg-yolov8n-random.pt", "ad_confidence": 0.0, "ad_mask_k": 1}
    if a.ad_inpaint:  # ADetailer's own "use separate width/height" (its default size is 512)
        ad.update(
            ad_use_inpaint_width_height=True, ad_inpaint_width=a.ad_inpaint, ad_inpaint_height=a.ad_inpaint
        )
    freeu = {"enable": True, "start_ratio": 0.0, "stop_ratio": 1.0, "transition_smoothness": 0.0, "version": "2",
             "stage_infos": [{"backbone_factor": 1.2, "skip_factor": 0.9}, {"backbone_factor": 1.4, "skip_factor": 0.2},
                             {}]}  # fmt: skip
    hypertile = {"hypertile_enable_unet": True, "hypertile_max_tile_unet": a.hypertile_tile}
    # info, tile w/h, mask blur, padding, seams fix width/denoise/padding, upscaler index, save the
    # upscaled picture, redraw "Linear", save seams, seams mask blur, seams fix "None", target size
    # "Scale from image size", custom w/h, scale
    usdu_args = [None, 256, 256, 8, 32, 64, 0.35, 16, usdu_index, False, 0, False, 4, 0, 2, 2048, 2048, 2.0]
    usdu = dict(base, init_images=[init_image(a.size)], denoising_strength=0.35, script_name="ultimate sd upscale",
                script_args=usdu_args)  # fmt: skip
    kohya = [True, True, 3, 4, 0.15, 0.3, "bicubic", 0.5, 2.0, True, False]
    return {
        "base": ("/sdapi/v1/txt2img", base),
        "td_multi": ("/sdapi/v1/txt2img", tiled("MultiDiffusion")),
        "td_mixture": ("/sdapi/v1/txt2img", tiled("Mixture of Diffusers")),
        "hypertile": ("/sdapi/v1/txt2img", dict(base, override_settings=hypertile)),
        "tome": ("/sdapi/v1/txt2img", dict(base, override_settings={"token_merging_ratio": 0.5})),
        "adetailer": ("/sdapi/v1/txt2img", alwayson(base, "ADetailer", [True, False, ad])),
        "usdu": ("/sdapi/v1/img2img", usdu),
        "kohya": ("/sdapi/v1/txt2img", alwayson(base, "Kohya Hires.fix", kohya)),
        "freeu": ("/sdapi/v1/txt2img", alwayson(base, "FreeU", [freeu])),
        "sag": ("/sdapi/v1/txt2img", alwayson(base, "Self Attention Guidance", [True, 0.75, 1.0])),
        "ad8": ("/sdapi/v1/txt2img", animatediff(8, "mm_vg_random_v2.safetensors")),
        "ad16": ("/sdapi/v1/txt2img", animatediff(16, "mm_vg_random_v2.safetensors")),
        "ad8v1": ("/sdapi/v1/txt2img", animatediff(8, "mm_vg_random_v1.safetensors")),
    }


def _log_size(path: str | None) -> int:
    return Path(path).stat().st_size if path and Path(path).exists() else 0


def _log_since(path: str | None, offset: int, every: bool = False) -> list[str]:
    """The WebUI log's lines after ``offset``: VRAM Guard's and the errors' (every line with
    ``every``: a failed job's traceback frames)."""
    if not path or not Path(path).exists():
        return []
    with open(path, "rb") as fh:
        fh.seek(offset)
        text = fh.read().decode(errors="replace")
    return [ln.rstrip() for ln in text.splitlines() if every or VG_LINE.search(ln)]


def max_levels(imgs: list[np.ndarray], ref: list[np.ndarray]) -> int | None:
    """The largest difference in 8-bit levels over every picture (None: not comparable)."""
    if len(imgs) != len(ref) or any(x.shape != y.shape for x, y in zip(imgs, ref)):
        return None
    return max(int(np.abs(x.astype(int) - y.astype(int)).max()) for x, y in zip(imgs, ref))


def load_pngs(folder: Path, stem: str) -> list[np.ndarray]:
    files = sorted(folder.glob(f"{stem}-*.png"), key=lambda f: int(f.stem.rsplit("-", 1)[1]))
    return [np.asarray(Image.open(f).convert("RGB")) for f in files]


def table(out: Path) -> int:
    """The last record of each (case, card, mode) in ``OUT/results.jsonl`` as a Markdown table."""
    last: dict = {}
    for line in (out / "results.jsonl").read_text().splitlines():
        r = json.loads(line)
        last[(r["case"], r["card"], r["mode"])] = r
    print("| case | card | mode | result | peak MiB | levels vs ref | vs plain same card | s |")
    print("|---|---|---|---|---|---|---|---|")
    for (case, card, mode), r in sorted(last.items()):
        err = r["error"].split('"errors":"', 1)[-1]
        res = "finished" if r["finished"] else "failed: " + re.sub(r"\s+", " ", err)[:90]
        if r.get("wrong_picture_count"):
            res += f" ({r['wrong_picture_count']})"
        same = ""
        if mode == "vg":  # the plain run on the same card, whichever ran first
            vg, plain = load_pngs(out / "vg", f"{case}-{card}"), load_pngs(out / "plain", f"{case}-{card}")
            same = (
                max_levels(vg, plain)
                if vg and plain and (case, card, "plain") in last and last[(case, card, "plain")]["finished"]
                else ""
            )
        print(f"| {case} | {card} | {mode} | {res} | {r.get('peak_mib', '')} | {r.get('max_levels_vs_ref', '')} "
              f"| {same} | {r['seconds']} |")  # fmt: skip
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", choices=["ref", "run", "table"])
    ap.add_argument(
        "--plain", action="store_true", help="run: the accordion off (the plain WebUI on the card)"
    )
    ap.add_argument("--cases", default="")
    ap.add_argument("--url", default="http://127.0.0.1:7861")
    ap.add_argument("--out", default="/tmp/vg-ext")
    ap.add_argument("--log", help="the WebUI's log file: the job's VRAM Guard / error lines are recorded")
    ap.add_argument("--size", type=int, default=256)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--td-size", type=int, default=640)
    ap.add_argument("--td-tile", type=int, default=32)
    ap.add_argument("--td-batch", type=int, default=4)
    ap.add_argument("--hypertile-tile", type=int, default=128)
    ap.add_argument("--ad-size", type=int, default=128)
    ap.add_argument(
        "--ad-inpaint", type=int, default=384, help="ADetailer's inpaint width/height (0: the image's)"
    )
    ap.add_argument("--usdu-upscaler", default="ESRGAN_x4-large-random")
    ap.add_argument("--tag", default="", help="a label for this run in results.jsonl")
    a = ap.parse_args()
    out = Path(a.out)
    if a.mode == "table":
        return table(out)
    upscalers = [u["name"] for u in call(a.url, "/sdapi/v1/upscalers")[0]]
    jobs = cases(a, upscalers)
    names = [c for c in a.cases.split(",") if c]
    unknown = [c for c in names if c not in jobs]
    if unknown:
        raise SystemExit(f"unknown case(s) {unknown}; known: {sorted(jobs)}")
    if "usdu" in names and a.usdu_upscaler not in upscalers:
        raise SystemExit(f"upscaler {a.usdu_upscaler!r} not in {upscalers}")
    status = None
    if a.mode == "run":
        status = call(a.url, "/vram-guard/v1/status")[0]
        if not status.get("card"):
            raise SystemExit("run: this WebUI has no emulated card (start it with --vram-guard-emulate-vram)")
    card = "uncapped" if status is None else f"{round(status['card']['capacity_bytes'] / MIB)}MiB"
    mode = "ref" if a.mode == "ref" else "plain" if a.plain else "vg"
    folder = out / mode
    folder.mkdir(parents=True, exist_ok=True)
    ok_all = True
    for name in names:
        path, payload = jobs[name]
        if a.mode == "run":
            args = [False] if a.plain else [dict(DEFAULTS)]
            payload = dict(payload, alwayson_scripts=dict(payload.get("alwayson_scripts") or {},
                                                          **{"VRAM Guard": {"args": args}}))  # fmt: skip
        log0 = _log_size(a.log)
        t0 = time.time()
        err, imgs, info = None, [], None
        try:
            body, _ = call(a.url, path, payload, timeout=7200)
            imgs = [decode(b) for b in body.get("images") or []]
            info = body.get("info")
        except RuntimeError as exc:
            err = str(exc)
        seconds = round(time.time() - t0, 1)
        time.sleep(1)  # the job's last lines reach the log
        rec: dict = {"case": name, "mode": mode, "card": card, "tag": a.tag, "finished": err is None,
                     "seconds": seconds, "images": len(imgs), "error": (err or "")[:600]}  # fmt: skip
        if imgs:
            stem = f"{name}-{card}"
            for f in folder.glob(f"{stem}-*.png"):
                f.unlink()
            for i, img in enumerate(imgs):
                Image.fromarray(img).save(folder / f"{stem}-{i}.png")
            rec["shape"] = list(imgs[0].shape)
        if isinstance(info, str) and info.startswith("{"):
            infotexts = json.loads(info).get("infotexts") or [""]
            rec["infotext_tail"] = infotexts[0].split("\n")[-1][:600]
        ref = load_pngs(out / "ref", f"{name}-uncapped")
        if imgs and ref and len(imgs) != len(ref):
            # e.g. AnimateDiff's before_process failed (the WebUI logs it and goes on): one picture
            rec["wrong_picture_count"] = f"{len(imgs)} picture(s), the reference has {len(ref)}"
        if imgs and ref and mode != "ref":
            rec["max_levels_vs_ref"] = max_levels(imgs, ref)
        if mode == "vg" and imgs:
            plain = load_pngs(out / "plain", f"{name}-{card}")
            if plain:
                rec["max_levels_vs_plain_same_card"] = max_levels(imgs, plain)
        if a.mode == "run":
            st = call(a.url, "/vram-guard/v1/status")[0]
            c = st.get("card") or {}
            rec.update(peak_mib=round((c.get("peak_bytes") or 0) / MIB, 1), cap_mib=round((c.get("capacity_bytes") or 0) / MIB, 1),
                       resident_mib=round((c.get("resident_bytes") or 0) / MIB, 1), ooms=c.get("ooms"))  # fmt: skip
            if mode == "vg":
                rec["notes"] = st.get("notes")
                rec["stages"] = [(s["stage"], s.get("plan"), round((s.get("peak_bytes") or 0) / MIB, 1))
                                 for s in st.get("stages", []) if not s.get("missing")]  # fmt: skip
        rec["log"] = _log_since(a.log, log0, every=err is not None)[-80:]
        with open(out / "results.jsonl", "a") as fh:
            fh.write(json.dumps(rec) + "\n")
        short = {k: rec.get(k) for k in ("case", "mode", "card", "finished", "seconds", "images", "peak_mib",
                                         "max_levels_vs_ref", "max_levels_vs_plain_same_card", "wrong_picture_count")}  # fmt: skip
        print(json.dumps(short), flush=True)
        if err:
            print(f"  error: {err[:400]}", flush=True)
        ok_all &= err is None and "wrong_picture_count" not in rec
    return 0 if ok_all else 1


if __name__ == "__main__":
    sys.exit(main())
