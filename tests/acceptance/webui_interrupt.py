"""Issue 31 item 3 in a real WebUI: Interrupt and Skip in the middle of VRAM Guard's stages.

Talks to a running AUTOMATIC1111 WebUI (``--api``) by HTTP only. Each case starts a job in a thread,
polls ``/sdapi/v1/progress`` until the job is in the stage the case names, then posts
``/sdapi/v1/interrupt`` (or ``/sdapi/v1/skip``):

* ``sampling`` — in the sampling pass (with ``--vram-guard-place-checkpoint`` on a card below the
  checkpoint: the streamed UNet), once the first step is done;
* ``decode`` — in a tiled decode (Tiled VAE "Always", a 16-latent-pixel tile: many tiles), once
  sampling is done;
* ``upscale`` — in a tiled Extras upscale of a large picture (VRAM Guard's upscaling on), after a
  delay;
* ``skip`` — Skip instead of Interrupt in the sampling pass;
* ``microbatch`` — in a micro-batched sampling pass (``--mb-size`` px, ``--mb-batch`` images, on a
  card where VRAM Guard splits the forward's batch: the log says ``micro-batch``), once the first
  step is done.

The WebUI checks for an interrupt once per sampling step, before the step's forward, and reports
a step as done after it: an interrupt seen at "step 1" lands in the pass only with more steps than
three (``--steps``); ``landed`` says whether the interrupted picture differs from the uninterrupted
one (``--ref``). The Extras upscale keeps its last pictures (``upscaling_max_images_in_cache``): a
run with the ``upscale`` case sets it to 0 while it runs (and back after), so that each upscale runs.

After each interrupted job: what the WebUI returned (HTTP status, how many images), where every
model is (the status route's ``models``: at rest, as after a job that ran to the end) and the card
at rest; then the same job once more without interruption, whose picture must equal a fresh run's
(``--ref``: the ref mode's pictures; max level difference 0). One JSON line per case in
``--out/run.jsonl``.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path

import numpy as np
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parent))
from webui_acceptance import call, decode, init_image  # noqa: E402

CASES = ("sampling", "decode", "upscale", "skip", "microbatch")


def job(case: str, a: argparse.Namespace) -> tuple[str, dict]:
    if case == "upscale":
        return "/sdapi/v1/extra-single-image", {
            "image": init_image(a.upscale_px), "resize_mode": 0, "upscaling_resize": 4, "upscaler_1": a.upscaler,
            "upscaler_2": "None", "extras_upscaler_2_visibility": 0,
        }  # fmt: skip
    size = {"decode": a.decode_size, "microbatch": a.mb_size}.get(case, a.size)
    args = {"enabled": True}
    if case == "decode":
        args.update(vae_tiling="Always", vae_tile=16)
    return "/sdapi/v1/txt2img", {
        "prompt": "a red apple on a wooden table", "negative_prompt": "", "sampler_name": "Euler a", "seed": 1234,
        "steps": a.steps, "width": size, "height": size, "cfg_scale": 7,
        "batch_size": a.mb_batch if case == "microbatch" else 1,
        "alwayson_scripts": {"VRAM Guard": {"args": [args]}},
    }  # fmt: skip


def progress(url: str) -> dict:
    try:
        body, _ = call(url, "/sdapi/v1/progress?skip_current_image=true", timeout=30)
        return body
    except RuntimeError:
        return {}


def wait_for(case: str, a: argparse.Namespace, done: threading.Event) -> str:
    """Poll until the job is where the case interrupts it; returns what was seen then."""
    t0 = time.time()
    while not done.is_set() and time.time() - t0 < 900:
        st = progress(a.url).get("state") or {}
        step, steps = st.get("sampling_step", 0), st.get("sampling_steps", 0)
        if case in ("sampling", "skip", "microbatch") and step >= 1:
            return f"sampling step {step} of {steps}"
        if (
            case == "decode"
            and steps
            and step >= steps - 1
            and st.get("job_no", 0) >= 0
            and time.time() - t0 > 5
        ):
            time.sleep(a.decode_delay)
            return f"after sampling ({step} of {steps}) + {a.decode_delay} s"
        if case == "upscale" and time.time() - t0 > a.upscale_delay:
            return f"{a.upscale_delay} s into the upscale"
        time.sleep(0.3)
    return "the job ended first"


def run(a: argparse.Namespace, case: str, interrupt: bool) -> dict:
    path, payload = job(case, a)
    result: dict = {}
    done = threading.Event()

    def send() -> None:
        t0 = time.time()
        try:
            body, _ = call(a.url, path, payload)
            result.update(
                ok=True, images=[decode(i) for i in (body.get("images") or [body.get("image")]) if i]
            )
        except RuntimeError as exc:
            result.update(ok=False, error=str(exc)[:300], images=[])
        result["seconds"] = round(time.time() - t0, 1)
        done.set()

    th = threading.Thread(target=send)
    th.start()
    seen = None
    if interrupt:
        time.sleep(1.0)
        seen = wait_for(case, a, done)
        route = "/sdapi/v1/skip" if case == "skip" else "/sdapi/v1/interrupt"
        if not done.is_set():
            call(a.url, route, {}, timeout=30)
    th.join()
    st, _ = call(a.url, "/vram-guard/v1/status", timeout=60)
    return {
        "case": case, "interrupted": interrupt, "when": seen, "ok": result.get("ok"), "error": result.get("error"),
        "images": result.get("images", []), "seconds": result.get("seconds"),
        "models": [f"{m['name']} {m['where']}" for m in st.get("models") or []],
        "card_used_bytes": (st.get("card") or {}).get("used_bytes"),
    }  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("mode", choices=("ref", "run"))
    ap.add_argument("--url", default="http://127.0.0.1:7863")
    ap.add_argument("--out", required=True)
    ap.add_argument("--ref")
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--size", type=int, default=128)
    ap.add_argument("--decode-size", type=int, default=384)
    ap.add_argument("--decode-delay", type=float, default=2.0)
    ap.add_argument("--upscale-px", type=int, default=256)
    ap.add_argument("--upscale-delay", type=float, default=3.0)
    ap.add_argument("--upscaler", default="ESRGAN_x4-wide-random")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--mb-size", type=int, default=448)
    ap.add_argument("--mb-batch", type=int, default=1)
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    cache = None
    if "upscale" in a.cases.split(","):
        opts, _ = call(a.url, "/sdapi/v1/options", timeout=60)
        cache = opts.get("upscaling_max_images_in_cache", 5)
        call(a.url, "/sdapi/v1/options", {"upscaling_max_images_in_cache": 0}, timeout=60)
    try:
        run_cases(a, out)
    finally:
        if cache is not None:
            call(a.url, "/sdapi/v1/options", {"upscaling_max_images_in_cache": cache}, timeout=60)
    return 0


def run_cases(a: argparse.Namespace, out: Path) -> None:
    with (out / "run.jsonl").open("a") as log:
        for case in a.cases.split(","):
            recs = (
                [run(a, case, interrupt=False)]
                if a.mode == "ref"
                else [run(a, case, True), run(a, case, False)]
            )
            for rec in recs:
                imgs = rec.pop("images")
                tag = f"{case}-{'interrupted' if rec['interrupted'] else 'after'}"
                if imgs:
                    Image.fromarray(imgs[0]).save(out / (f"{case}.png" if a.mode == "ref" else f"{tag}.png"))
                rec["n_images"] = len(imgs)
                if a.mode == "run" and imgs and a.ref:
                    same = "sampling" if case == "skip" else case  # (the same job)
                    r = np.asarray(Image.open(Path(a.ref) / f"{same}.png").convert("RGB")).astype(int)
                    d = int(np.abs(r - imgs[0].astype(int)).max()) if r.shape == imgs[0].shape else None
                    rec["landed" if rec["interrupted"] else "after_vs_fresh"] = (
                        (d is None or d > 0) if rec["interrupted"] else d
                    )
                log.write(json.dumps(rec) + "\n")
                log.flush()
                print(f"{tag:22s} ok={rec['ok']} {rec['seconds']}s when={rec['when']} images={rec['n_images']} "
                      f"landed={rec.get('landed')} vs_fresh={rec.get('after_vs_fresh')} | {'; '.join(rec['models'])} | "
                      f"{(rec['error'] or '')[:120]}", flush=True)  # fmt: skip


if __name__ == "__main__":
    raise SystemExit(main())
