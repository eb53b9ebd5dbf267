"""Issue 29 in a real WebUI: every job type, in a given order, against the uncapped plain pictures.

Talks to a running AUTOMATIC1111 WebUI (``--api``) by HTTP only. Two modes:

* ``ref`` — a WebUI with the extension on a card nothing fills (or none) and no placement: each job
  type once with VRAM Guard's accordion off (the plain WebUI); the pictures go to ``--out``.
* ``run`` — the same WebUI started on an emulated card below the checkpoint with
  ``--vram-guard-place-checkpoint`` (or without it, on a card that holds the checkpoint but not
  everything at once): the job types in ``--order`` (comma separated; a type may repeat), each with
  VRAM Guard on. The prompt alternates between two texts from job to job (the reference has both),
  so no job reuses the previous job's conditioning and every job wakes the text encoders. Each
  picture is compared with the reference's (max level difference, PSNR); the status route's
  ``models`` (where each model is after the job), ``card`` and ``moves`` are recorded. One JSON line
  per job in ``--out/run.jsonl``, one printed line per job.

Extras requests run with the Settings page's VRAM Guard defaults (the API has no accordion there).
Job types: txt2img, img2img, inpaint, hires_esrgan, hires_latent, sdupscale, extras, batch_count,
batch_size, previews (live previews decoded during the job: the request carries ``force_task_id``, the
client polls ``/internal/progress`` with that task id and sets the Settings a preview needs —
every step, "Full" — for the job, then puts the previous values back), xyz (an X/Y/Z plot over
two sizes).
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import sys
import threading
import time
from pathlib import Path

import numpy as np
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parent))
from webui_acceptance import call, decode, init_image, psnr  # noqa: E402

TYPES = (
    "txt2img", "img2img", "inpaint", "hires_esrgan", "hires_latent", "sdupscale", "extras",
    "batch_count", "batch_size", "previews", "xyz",
)  # fmt: skip
PROMPTS = ("a red apple on a wooden table", "a red apple on a wooden table,")


def mask_image(size: int) -> str:
    m = np.zeros((size, size), np.uint8)
    m[size // 4 : 3 * size // 4, size // 4 : 3 * size // 4] = 255
    buf = io.BytesIO()
    Image.fromarray(m).save(buf, "PNG")
    return base64.b64encode(buf.getvalue()).decode()


def job(kind: str, a: argparse.Namespace, prompt: str, vg: bool) -> tuple[str, dict]:
    s = a.size
    base = {"prompt": prompt, "negative_prompt": "", "cfg_scale": 7, "sampler_name": "Euler a", "seed": 1234,
            "steps": a.steps, "width": s, "height": s, "batch_size": 1, "n_iter": 1}  # fmt: skip
    base["alwayson_scripts"] = {"VRAM Guard": {"args": [{"enabled": vg}]}}
    hires = dict(base, enable_hr=True, hr_scale=2, hr_second_pass_steps=1, denoising_strength=0.5)
    img2img = dict(base, init_images=[init_image(s)], denoising_strength=0.6)
    if kind == "txt2img":
        return "/sdapi/v1/txt2img", base
    if kind == "img2img":
        return "/sdapi/v1/img2img", img2img
    if kind == "inpaint":
        return "/sdapi/v1/img2img", dict(
            img2img, mask=mask_image(s), inpainting_fill=1, inpaint_full_res=False
        )
    if kind == "hires_esrgan":
        return "/sdapi/v1/txt2img", dict(hires, hr_upscaler=a.upscaler)
    if kind == "hires_latent":
        return "/sdapi/v1/txt2img", dict(hires, hr_upscaler="Latent")
    if kind == "sdupscale":
        return "/sdapi/v1/img2img", dict(
            img2img, script_name="sd upscale", script_args=["", 64, a.upscaler, 2.0], denoising_strength=0.3
        )
    if kind == "extras":
        extras = {"image": init_image(s + 8), "resize_mode": 0, "upscaling_resize": 2, "upscaler_1": a.upscaler,
                  "upscaler_2": "None", "extras_upscaler_2_visibility": 0}  # fmt: skip
        return "/sdapi/v1/extra-single-image", extras
    if kind == "batch_count":
        return "/sdapi/v1/txt2img", dict(base, n_iter=2)
    if kind == "batch_size":
        return "/sdapi/v1/txt2img", dict(base, batch_size=2)
    if kind == "previews":
        return "/sdapi/v1/txt2img", dict(base, steps=max(a.steps, 3))
    if kind == "xyz":
        # X/Y/Z plot: X = Size over two sizes (its axis type index for "Size" in v1.10.1 is found by name)
        return "/sdapi/v1/txt2img", dict(base, script_name="x/y/z plot", script_args=xyz_args(a))
    raise SystemExit(f"unknown job type {kind!r}; one of {', '.join(TYPES)}")


def xyz_args(a: argparse.Namespace) -> list:
    """v1.10.1's X/Y/Z plot ``run`` arguments: x_type, x_values, x_values_dropdown, y..., z...,
    draw_legend, include_lone_images, include_sub_grids, no_fixed_seeds, vary_seeds_x/y/z,
    margin_size, csv_mode. Axis type 'Size' is looked up by the caller's ``--xyz-size-index``."""
    s = a.size
    return [a.xyz_size_index, f"{s}x{s}, {s + 64}x{s}", [], 0, "", [], 0, "", [], True, False, False, False,
            False, False, False, 0, False]  # fmt: skip


PREVIEW_OPTS = {"live_previews_enable": True, "show_progress_every_n_steps": 1, "show_progress_type": "Full",
                "live_preview_content": "Prompt", "live_previews_image_format": "png"}  # fmt: skip
"""The Settings a live preview needs: every step, decoded by the checkpoint's own VAE ("Full")."""


def poll_previews(url: str, task: str, stop: threading.Event, seen: list) -> None:
    """Poll ``/internal/progress`` for ``task`` (the job's ``force_task_id``: v1.10.1 answers the
    preview only for the task that is running) and keep each new preview's size (bytes, px)."""
    n, last = 0, -1
    while not stop.is_set() and n < 1200:
        n += 1
        try:
            body, _ = call(url, "/internal/progress", {"id_task": task, "id_live_preview": last, "live_preview": True},
                           timeout=60)  # fmt: skip
            if body.get("live_preview"):
                raw = base64.b64decode(body["live_preview"].split(",", 1)[1])
                seen.append({"id": body.get("id_live_preview"), "bytes": len(raw),
                             "size": list(Image.open(io.BytesIO(raw)).size)})  # fmt: skip
                last = body.get("id_live_preview", last)
        except (RuntimeError, OSError, ValueError):
            pass
        time.sleep(0.3)


def images_of(body: dict) -> list[np.ndarray]:
    imgs = body.get("images") or [body.get("image")]
    return [decode(i) for i in imgs if i]


def run_one(a: argparse.Namespace, kind: str, prompt: str, vg: bool) -> dict:
    path, payload = job(kind, a, prompt, vg)
    stop, seen, saved = threading.Event(), [], None
    poller = None
    if kind == "previews":
        task = f"task(vg-previews-{time.time_ns()})"
        payload = dict(payload, force_task_id=task)
        cur, _ = call(a.url, "/sdapi/v1/options", timeout=60)
        saved = {k: cur.get(k) for k in PREVIEW_OPTS}
        call(a.url, "/sdapi/v1/options", PREVIEW_OPTS, timeout=60)
        poller = threading.Thread(target=poll_previews, args=(a.url, task, stop, seen))
        poller.start()
    t0 = time.time()
    try:
        body, _ = call(a.url, path, payload)
        error = None
    except RuntimeError as exc:
        body, error = {}, str(exc)[:400]
    finally:
        stop.set()
        if poller is not None:
            poller.join()
        if saved is not None:
            call(a.url, "/sdapi/v1/options", saved, timeout=60)
    rec = {"type": kind, "prompt": prompt, "vram_guard": vg, "seconds": round(time.time() - t0, 1), "ok": error is None,
           "error": error, "previews_seen": len(seen) if poller is not None else None}  # fmt: skip
    if poller is not None:
        rec["previews"] = seen
    rec["images"] = images_of(body) if error is None else []
    try:
        st, _ = call(a.url, "/vram-guard/v1/status", timeout=60)
        rec["models"] = st.get("models")
        rec["card"] = st.get("card")
        rec["moves"] = st.get("moves")
    except RuntimeError as exc:
        rec["status_error"] = str(exc)[:200]
    return rec


def save(out: Path, name: str, images: list[np.ndarray]) -> list[str]:
    names = []
    for i, img in enumerate(images):
        p = out / f"{name}-{i}.png"
        Image.fromarray(img).save(p)
        names.append(p.name)
    return names


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("mode", choices=("ref", "run"))
    ap.add_argument("--url", default="http://127.0.0.1:7861")
    ap.add_argument("--out", required=True)
    ap.add_argument("--ref", help="run: the ref mode's --out")
    ap.add_argument("--order", default=",".join(TYPES))
    ap.add_argument("--size", type=int, default=128)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--plain", action="store_true", help="run: VRAM Guard's accordion off (the plain WebUI)")
    ap.add_argument("--upscaler", default="ESRGAN_x4-tiny-random")
    ap.add_argument(
        "--parity",
        help="run: the prompt of each job (0/1, comma separated) instead of alternating: a sub-sequence "
        "of another run's order, each job with that run's prompt",
    )
    ap.add_argument(
        "--xyz-size-index",
        type=int,
        default=41,
        help="the 'Size' axis type's index in this WebUI's txt2img "
        "(v1.10.1: 41, checked against GET /sdapi/v1/script-info)",
    )
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    if a.mode == "ref":
        for kind in a.order.split(","):
            for k, prompt in enumerate(PROMPTS):
                rec = run_one(a, kind, prompt, vg=False)
                rec["files"] = save(out, f"{kind}-p{k}", rec.pop("images"))
                print(
                    json.dumps({k2: v for k2, v in rec.items() if k2 not in ("models", "moves")}), flush=True
                )
        return 0
    ref = Path(a.ref)
    parity = a.parity.split(",") if a.parity else None
    if parity is not None and len(parity) != len(a.order.split(",")):
        raise SystemExit("--parity: one 0/1 per job of --order")
    rows = []
    with (out / "run.jsonl").open("a") as log:
        for n, kind in enumerate(a.order.split(",")):
            # the prompt alternates: no job reuses the previous job's conditioning (--parity: given)
            k = int(parity[n]) if parity else n % 2
            rec = run_one(a, kind, PROMPTS[k], vg=not a.plain)
            imgs = rec.pop("images")
            rec["index"] = n
            rec["after"] = a.order.split(",")[n - 1] if n else "(start)"
            rec["files"] = save(out, f"{n:03d}-{kind}", imgs)
            diffs = []
            for i, img in enumerate(imgs):
                rp = ref / f"{kind}-p{k}-{i}.png"
                if not rp.is_file():
                    diffs.append(None)
                    continue
                r = np.asarray(Image.open(rp).convert("RGB"))
                same_shape = r.shape == img.shape
                diffs.append({"max_levels": int(np.abs(r.astype(int) - img.astype(int)).max()) if same_shape else None,
                              "psnr": None if not same_shape else (lambda v: None if v == float("inf") else round(v, 1))(psnr(r, img))})  # fmt: skip
            rec["vs_ref"] = diffs
            log.write(json.dumps(rec) + "\n")
            log.flush()
            rows.append(rec)
            worst = max((d["max_levels"] for d in diffs if d and d["max_levels"] is not None), default=None)
            where = ", ".join(f"{m['name']} {m['where']}" for m in rec.get("models") or [])
            peak = (rec.get("card") or {}).get("peak_bytes")
            extra = f" previews={rec['previews_seen']}" if rec["previews_seen"] is not None else ""
            print(f"{n:3d} {kind:13s} after {rec['after']:13s} ok={rec['ok']} {rec['seconds']:6.1f}s "
                  f"max_levels={worst} peak={None if peak is None else round(peak / 2**20)}MiB{extra} | {where} | "
                  f"{rec['error'] or ''}", flush=True)  # fmt: skip
    bad = [r for r in rows if not r["ok"]]
    print(f"{len(rows)} jobs, {len(bad)} failed")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
