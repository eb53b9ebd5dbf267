"""Issue 31 item 1 in a real WebUI: LoRA (the built-in Lora extension) with VRAM Guard's placement.

Talks to a running AUTOMATIC1111 WebUI (``--api``) by HTTP only. The WebUI's built-in Lora extension
merges a LoRA into the UNet's and text encoder's weights in place (keeping a CPU backup of the
unmerged weight) when the prompt names it, and restores the backup when the next prompt does not;
with the checkpoint placed, the UNet's streamed blocks and the parked text encoders / VAE live in
host memory, so a merge left behind in a streamed or parked copy would show in the next job.

Jobs (``--sequence``, comma separated; each ``kind[+kind]``):

* ``none`` — no LoRA; ``attn`` — ``<lora:vg-lora-attn:1>``; ``mix`` — ``<lora:vg-lora-mix:1>``;
  ``two`` — both at 0.8; ``hires_only`` — hires fix (Latent) with the LoRA only in the hires prompt;
  ``batch2`` — ``attn`` with batch size 2 (two images per forward); ``fp16`` — ``attn`` with
  VRAM Guard's FP16 UNet option; ``hr_ckpt`` — hires fix (Latent) with a hires checkpoint
  (``--hr-checkpoint``: the WebUI loads it for the hires pass; the next job loads the first one
  back, so the ``none`` after it shows whether the checkpoint was placed again as before; issue 31
  item 2); ``refiner`` — the WebUI's Refiner: the ``--hr-checkpoint`` checkpoint takes over at half
  of the steps (``refiner_switch_at`` 0.5: the WebUI swaps checkpoints inside the sampling pass).

Modes: ``ref`` (each kind once, VRAM Guard's accordion off, on an uncapped WebUI; pictures to
``--out``) and ``run`` (the sequence with VRAM Guard on): each picture against the reference's
(max level difference: 0 is the criterion, the same picture to the bit), and each ``none`` job
also against the sequence's first ``none`` (nothing of a merge left behind). One JSON line per job
in ``--out/run.jsonl``.
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
from webui_acceptance import call, decode  # noqa: E402

PROMPT = "a red apple on a wooden table"
KINDS = ("none", "attn", "mix", "two", "hires_only", "batch2", "fp16", "hr_ckpt", "refiner")
SEQUENCE = "none,attn,none,mix,none,two,none,attn,mix,none"


def job(kind: str, a: argparse.Namespace, vg: bool) -> dict:
    s = a.size
    lora = {"attn": " <lora:vg-lora-attn:1>", "mix": " <lora:vg-lora-mix:1>", "batch2": " <lora:vg-lora-attn:1>",
            "fp16": " <lora:vg-lora-attn:1>", "two": " <lora:vg-lora-attn:0.8> <lora:vg-lora-mix:0.8>"}  # fmt: skip
    body = {"prompt": PROMPT + lora.get(kind, ""), "negative_prompt": "", "cfg_scale": 7, "sampler_name": "Euler a",
            "seed": 1234, "steps": a.steps, "width": s, "height": s, "batch_size": 2 if kind == "batch2" else 1}  # fmt: skip
    args: dict = {"enabled": vg}
    if kind == "fp16" and vg:
        args["unet_fp16"] = True
    body["alwayson_scripts"] = {"VRAM Guard": {"args": [args]}}
    if kind == "hires_only":
        body.update(enable_hr=True, hr_scale=2, hr_second_pass_steps=1, denoising_strength=0.5, hr_upscaler="Latent",
                    hr_prompt=PROMPT + " <lora:vg-lora-attn:1>", hr_negative_prompt="")  # fmt: skip
    if kind == "hr_ckpt":
        body.update(enable_hr=True, hr_scale=2, hr_second_pass_steps=1, denoising_strength=0.5, hr_upscaler="Latent",
                    hr_checkpoint_name=a.hr_checkpoint)  # fmt: skip
    if kind == "refiner":
        body.update(refiner_checkpoint=a.hr_checkpoint, refiner_switch_at=0.5)
    if kind not in KINDS:
        raise SystemExit(f"unknown kind {kind!r}; one of {', '.join(KINDS)}")
    return body


def run_job(a: argparse.Namespace, kind: str, vg: bool) -> tuple[dict, list[np.ndarray]]:
    t0 = time.time()
    try:
        body, _ = call(a.url, "/sdapi/v1/txt2img", job(kind, a, vg))
        error = None
    except RuntimeError as exc:
        body, error = {}, str(exc)[:400]
    rec = {
        "kind": kind,
        "vram_guard": vg,
        "ok": error is None,
        "error": error,
        "seconds": round(time.time() - t0, 1),
    }
    try:
        st, _ = call(a.url, "/vram-guard/v1/status", timeout=60)
        rec["card_peak"] = (st.get("card") or {}).get("peak_bytes")
        rec["models"] = [f"{m['name']} {m['where']}" for m in st.get("models") or []]
        rec["plans"] = [s.get("plan") for s in st.get("stages") or []]
    except RuntimeError as exc:
        rec["status_error"] = str(exc)[:200]
    return rec, [decode(i) for i in body.get("images") or []]


def max_levels(x: np.ndarray, y: np.ndarray) -> int | None:
    return int(np.abs(x.astype(int) - y.astype(int)).max()) if x.shape == y.shape else None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("mode", choices=("ref", "run"))
    ap.add_argument("--url", default="http://127.0.0.1:7863")
    ap.add_argument("--out", required=True)
    ap.add_argument("--ref", help="run: the ref mode's --out")
    ap.add_argument("--sequence", default=SEQUENCE)
    ap.add_argument("--size", type=int, default=128)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument(
        "--hr-checkpoint",
        default="sd15-random-b",
        help="hr_ckpt: the hires pass's checkpoint; refiner: the Refiner",
    )
    ap.add_argument(
        "--plain", action="store_true", help="run: VRAM Guard's accordion off (the plain sequence)"
    )
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    kinds = a.sequence.split(",") if a.mode == "run" else list(dict.fromkeys(a.sequence.split(",")))
    first_none: list[np.ndarray] | None = None
    failed = 0
    with (out / "run.jsonl").open("a") as log:
        for n, kind in enumerate(kinds):
            rec, imgs = run_job(a, kind, vg=a.mode == "run" and not a.plain)
            rec["index"] = n
            for i, img in enumerate(imgs):
                Image.fromarray(img).save(
                    out / (f"{kind}-{i}.png" if a.mode == "ref" else f"{n:02d}-{kind}-{i}.png")
                )
            if a.mode == "run" and a.ref:
                refs = [
                    np.asarray(Image.open(p).convert("RGB"))
                    for p in sorted(Path(a.ref).glob(f"{kind}-*.png"))
                ]
                rec["vs_ref"] = [max_levels(r, g) for r, g in zip(refs, imgs)] if refs else None
            if kind == "none" and imgs:
                if first_none is None:
                    first_none = imgs
                rec["vs_first_none"] = [max_levels(r, g) for r, g in zip(first_none, imgs)]
            log.write(json.dumps(rec) + "\n")
            log.flush()
            failed += not rec["ok"]
            print(f"{n:2d} {kind:10s} ok={rec['ok']} {rec['seconds']:6.1f}s vs_ref={rec.get('vs_ref')} "
                  f"vs_first_none={rec.get('vs_first_none')} peak={rec.get('card_peak')} "
                  f"| {'; '.join(rec.get('models') or [])} | {(rec['error'] or '')[:160]}", flush=True)  # fmt: skip
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
