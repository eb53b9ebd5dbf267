"""Acceptance run of VRAM Guard against a running AUTOMATIC1111 WebUI (started with ``--api``).

Talks to the WebUI's HTTP API only (urllib + numpy + Pillow). Two phases, each against a WebUI
instance you start yourself:

* ``baseline`` — a WebUI *without* the extension (e.g. started with ``--disable-extra-extensions``):
  saves txt2img, hires fix, img2img and Extras results to ``--out``.
* ``extension`` — the same WebUI *with* ``extensions/vram-guard``: runs the same calls with VRAM
  Guard off (must be bit-identical to the baseline), on (positional and name-keyed
  ``alwayson_scripts``), pastes an infotext through the API's ``infotext`` field, checks the status
  route, and compares pixels (identical / PSNR). Prints one line per check and a JSON summary.

usage: webui_acceptance.py baseline|extension|auth|emulate-ref|emulate [--url URL] [--out DIR] [--upscaler NAME]
        [--only txt2img,hires,img2img,extras,sdupscale,previews,savehires,unet,readme,badoption,stale]
        [--log WEBUI_LOG] [--user U --password P]
(``sdupscale``, ``previews``, ``savehires``, ``unet``, ``readme``, ``badoption`` and ``stale`` run
only when named in ``--only``.)

* ``readme`` runs the documented API examples exactly as written (extracted from docs/api.md, which
  the README links; only the host:port is replaced by ``--url``).
* ``auth`` — against a WebUI started with ``--api-auth USER:PASSWORD``: VRAM Guard's API routes
  answer 401 without (or with wrong) credentials, like ``/sdapi/v1/*``, and 200 with them.

Emulated card (``--vram-guard-emulate-vram``), two more phases:

* ``emulate-ref`` — a WebUI started with the extension and a card nothing fills (e.g.
  ``--vram-guard-emulate-vram 64GB``): the plain WebUI's (accordion off) txt2img, hires fix and
  Extras results and each job's peak on the card, plus the per-stage peaks of the same txt2img with
  VRAM Guard on and tiling off (what sampling and the decode need); saved to ``--out``.
* ``emulate`` — the same WebUI started with a card between those peaks (``emulate-ref`` prints one):
  each job with the accordion off (the plain WebUI: must end with an out-of-memory error) and on
  (must complete and match the uncapped plain result: PSNR, peak/cap, plan, time).

Both emulate phases set the WebUI's own ESRGAN tile (Settings → Upscaling) to ``--esrgan-tile``
(default 0: untiled, the reference picture; the default 192 cuts a smaller image from a black-padded
tile) and put the previous value back. With ``--stage-dump DIR`` and the stage probe
(``webui_stage_probe/``, linked into ``extensions/`` and started with ``VG_STAGE_DUMP=DIR``), each
VAE stage's input and output (first-pass decode, the hires encode whose input is the hires
upscale's output, the final decode) is compared call by call with the uncapped plain run's.

``emulate`` with ``--only offload`` (run only when named): the txt2img job with VRAM Guard forcing one
decode tile of ``--offload-tile`` latent px (32 = the whole latent of a 256² image: the untiled
working set, which does not fit beside the resident checkpoint on that cap). VRAM Guard must move
the idle UNet and text encoders off the card for that pass (a note on the status route, an
``offload`` timeline event), finish with the uncapped plain picture (<= 1 level), and leave the
card's resident bytes as they were. ``--only offload-medvram``: the same job on a WebUI started
with ``--medvram`` (the host swaps models itself): nothing may move.

Sampling (issues 21/22): every VRAM Guard job of both emulate phases records its sampling passes
(:func:`sampling_readings`: the pass's prediction from its note beside the measured stage peak and
activations = peak - resident weights); ``emulate-ref --vg-only`` runs only VRAM Guard's untiled
jobs (a restart with another ``--opt-*-attention`` flag: that attention's predictions);
``emulate --only stopped``: the hires job on a card too small for its hires pass even at
micro-batch 1 must end with VRAM Guard's one-line named error, the first pass's picture saved
(the WebUI's "save a copy before highres fix", switched on for the job), then the plain WebUI's
raw out-of-memory error on the same job (skipped with ``--vg-only``). ``--attention TITLE``
switches the WebUI's cross-attention optimization for the run without a restart (v1.10.1
re-hijacks on the option's change) and checks that VRAM Guard's pass notes name it. ``--webui-pid`` adds each job's CPU
seconds, ``--lowvram-probe`` (a WebUI started with ``--lowvram`` and ``webui_lowvram_probe/``
linked into ``extensions/``, ``VG_LOWVRAM_PROBE=FILE``) the bytes the host's own swapping moved
per sampler step.

Checkpoint placement (issue 22 item 3: a WebUI started with ``--vram-guard-place-checkpoint`` on a
card below the checkpoint): with ``--log``, each VRAM Guard job of ``emulate`` records the placement
(status route ``placement``, the load's "checkpoint placed by VRAM Guard" log line) and the job's
"placed UNet: K forward(s) this pass, X MiB copied ..." line: bytes copied to the card per sampler
step (``--steps``) and whether prefetch ran; ``--lowvram-ref`` (a ``--lowvram`` start's
``emulate-ref`` OUT, made with ``--lowvram-probe``) puts them beside ``--lowvram``'s counted bytes
and CPU seconds. ``emulate-ref --compare-to REF_OUT`` compares each plain job of this start (e.g.
``--lowvram``'s) with another start's uncapped plain pictures and stage dumps.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import re
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
from PIL import Image

PROMPT = {"prompt": "a red apple on a wooden table", "negative_prompt": "", "cfg_scale": 7,
          "sampler_name": "Euler a", "seed": 1234, "batch_size": 1, "n_iter": 1}  # fmt: skip
ARG_ORDER = ["enabled", "preset", "vae_tiling", "vae_mode", "vae_tile", "upscale_tiling", "upscale_tile",
             "upscale_batch", "precision_vae", "precision_upscale", "unet_fp16", "release_between_stages"]  # fmt: skip


def call(url: str, path: str, payload: dict | None = None, timeout: float = 1800, *, method: str | None = None,
         auth: tuple[str, str] | None = None) -> tuple[dict, float]:  # fmt: skip
    data = None if payload is None else json.dumps(payload).encode()
    headers = {"Content-Type": "application/json"}
    if auth is not None:
        headers["Authorization"] = "Basic " + base64.b64encode(f"{auth[0]}:{auth[1]}".encode()).decode()
    req = urllib.request.Request(url.rstrip("/") + path, data=data, headers=headers,
                                 method=method or ("GET" if payload is None else "POST"))  # fmt: skip
    t0 = time.time()
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read().decode()), time.time() - t0
    except urllib.error.HTTPError as e:
        raise RuntimeError(f"{path}: HTTP {e.code}: {e.read().decode(errors='replace')[:800]}") from None


def init_image(size: int) -> str:
    rng = np.random.default_rng(7)
    y, x = np.mgrid[0:size, 0:size] / size
    img = np.stack([x, y, 0.5 + 0.5 * np.sin(6 * x * y)], -1) * 200 + rng.integers(0, 40, (size, size, 3))
    buf = io.BytesIO()
    Image.fromarray(img.clip(0, 255).astype(np.uint8)).save(buf, "PNG")
    return base64.b64encode(buf.getvalue()).decode()


FORGE_HIRES = {"hr_additional_modules": ["Use same choices"]}
"""Forge's txt2img API fails a hires-fix request without it (``'NoneType' is not iterable`` in
``processing.py``: the field defaults to None there, and the UI always sends a list)."""


def requests(
    upscaler: str, size: int, steps: int, extras_scale: int = 2, forge: bool = False
) -> dict[str, tuple[str, dict]]:
    base = dict(PROMPT, steps=steps, width=size, height=size)
    hires_extra = FORGE_HIRES if forge else {}
    return {
        "txt2img": ("/sdapi/v1/txt2img", base),
        "hires": (
            "/sdapi/v1/txt2img",
            dict(
                base,
                enable_hr=True,
                hr_scale=2,
                hr_upscaler=upscaler,
                hr_second_pass_steps=1,
                denoising_strength=0.5,
                **hires_extra,
            ),
        ),  # fmt: skip
        "img2img": ("/sdapi/v1/img2img", dict(base, init_images=[init_image(size)], denoising_strength=0.6)),
        "extras": (
            "/sdapi/v1/extra-single-image",
            {
                "image": init_image(size + 8),
                "resize_mode": 0,
                "upscaling_resize": extras_scale,
                "upscaler_1": upscaler,
                "upscaler_2": "None",
                "extras_upscaler_2_visibility": 0,
            },
        ),  # fmt: skip
    }


def decode(b64: str) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(b64.split(",", 1)[-1]))).convert("RGB"))


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    if a.shape != b.shape:
        return float("nan")
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return float("inf") if mse == 0 else 10 * np.log10(255.0**2 / mse)


def http_status(url: str, path: str, method: str = "GET", auth: tuple[str, str] | None = None) -> int:
    try:
        call(url, path, {} if method == "POST" else None, timeout=120, method=method, auth=auth)
        return 200
    except RuntimeError as exc:
        m = re.search(r"HTTP (\d+)", str(exc))
        if m:
            return int(m.group(1))
        raise


API_DOC = Path(__file__).resolve().parents[2] / "docs" / "api.md"
"""Where the API examples live (the README links it)."""


def readme_api_examples() -> list[tuple[str, str, dict]]:
    """The documented API examples as (label, path, payload), exactly as written in docs/api.md:
    every ``curl ... -d '{...}'`` block of its "## `alwayson_scripts`" section, and its "Positional
    form" line applied to the same request."""
    text = API_DOC.read_text()
    section = text[text.index("## `alwayson_scripts`") : text.index("## Access control")]
    out = []
    for block in re.findall(r"```bash\n(.*?)```", section, flags=re.S):
        m = re.search(r"curl -s http://127\.0\.0\.1:7860(/sdapi/v1/\S+) .*?-d '(.*)'", block, flags=re.S)
        if m:
            out.append(("docs/api.md curl example", m.group(1), json.loads(m.group(2))))
    pos = re.search(r"Positional form of the same: `\"args\": (\[.*?\])`", section)
    if out and pos:
        label, path, payload = out[0]
        scripts = json.loads(json.dumps(payload["alwayson_scripts"]))
        scripts["VRAM Guard"]["args"] = json.loads(pos.group(1))
        out.append(("docs/api.md positional form", path, dict(payload, alwayson_scripts=scripts)))
    if len(out) < 2:
        raise SystemExit("docs/api.md: the API examples were not found (section '## `alwayson_scripts`')")
    return out


def run(url: str, name: str, path: str, payload: dict) -> dict:
    body, dt = call(url, path, payload)
    imgs = body.get("images") or [body.get("image")]
    info = body.get("info")
    info = json.loads(info) if isinstance(info, str) and info.startswith("{") else info
    text = (info.get("infotexts") or [""])[0] if isinstance(info, dict) else (body.get("html_info") or "")
    return {"name": name, "seconds": round(dt, 1), "image": decode(imgs[0]), "infotext": text}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("phase", choices=["baseline", "extension", "auth", "emulate-ref", "emulate"])
    ap.add_argument("--url", default="http://127.0.0.1:7860")
    ap.add_argument("--out", default="/tmp/vram-guard-acceptance")
    ap.add_argument("--upscaler", default="ESRGAN_x4-tiny-random")
    ap.add_argument("--size", type=int, default=128)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--extras-scale", type=int, default=2, help="Extras upscale factor")
    ap.add_argument("--forge", action="store_true", help="the server is Forge (hires requests need a field)")
    ap.add_argument("--only", default="")
    ap.add_argument("--log", default=None, help="the WebUI's console log (to count error lines)")
    ap.add_argument("--user", default="user")
    ap.add_argument("--password", default="pass")
    ap.add_argument("--hires-size", type=int, default=128, help="emulate phases: hires fix first pass")
    ap.add_argument("--extras-size", type=int, default=128, help="emulate phases: Extras input (x4)")
    ap.add_argument("--esrgan-tile", type=int, default=0,
                    help="emulate phases: the WebUI's own ESRGAN tile (Settings) for the run, restored "
                    "afterwards (0 = untiled: its reference picture; 192 pads a small image into a black tile)")  # fmt: skip
    ap.add_argument("--stage-dump", default=None,
                    help="emulate phases: the folder the WebUI's stage probe writes to (its VG_STAGE_DUMP, "
                    "tests/acceptance/webui_stage_probe); each job's files are moved to OUT/stages/<job>")  # fmt: skip
    ap.add_argument("--offload-tile", type=int, default=32,
                    help="emulate --only offload: the forced decode tile (latent px) of the idle-model check")  # fmt: skip
    ap.add_argument("--webui-pid", default=None,
                    help="emulate phases: the WebUI's pid file (launch.sh's run/webui-PORT.pid): each job's CPU seconds")  # fmt: skip
    ap.add_argument("--lowvram-probe", default=None,
                    help="emulate phases: the lowvram probe's counter file (its VG_LOWVRAM_PROBE, "
                    "tests/acceptance/webui_lowvram_probe): --lowvram's bytes moved per step")  # fmt: skip
    ap.add_argument("--hires-scale", type=float, default=2, help="emulate phases: the hires job's scale")
    ap.add_argument("--compare-to", default=None,
                    help="emulate-ref: another emulate-ref OUT (e.g. the uncapped plain run's) whose pictures "
                    "and stage dumps each plain job is compared with (e.g. a --lowvram start's)")  # fmt: skip
    ap.add_argument("--lowvram-ref", default=None,
                    help="emulate: the emulate-ref.json of a --lowvram start with --lowvram-probe (its OUT): "
                    "VRAM Guard's streamed bytes and CPU seconds per job against --lowvram's counted ones")  # fmt: skip
    ap.add_argument(
        "--plain-only",
        action="store_true",
        help="emulate-ref: only the plain WebUI's pictures (e.g. a --lowvram start)",
    )
    ap.add_argument("--vg-only", action="store_true",
                    help="emulate-ref: only VRAM Guard's untiled runs (stage peaks and sampling predictions: "
                    "another attention), no plain reference pictures")  # fmt: skip
    ap.add_argument("--attention", default=None,
                    help="emulate phases: the WebUI's cross-attention optimization for the run, switched without "
                    "a restart (POST /sdapi/v1/options cross_attention_optimization: its title, e.g. 'sdp - "
                    "scaled dot product', 'V1 - original v1', 'None'); VRAM Guard's pass notes must name it; "
                    "put back afterwards")  # fmt: skip
    ap.add_argument("--outputs", default="/work/webui/outputs",
                    help="emulate --only stopped: the WebUI's outputs folder (the first pass's saved copy)")  # fmt: skip
    a = ap.parse_args()
    if a.phase.startswith("emulate"):
        return emulate_phase(a)
    import os

    os.makedirs(a.out, exist_ok=True)
    reqs = requests(a.upscaler, a.size, a.steps, a.extras_scale, a.forge)
    only = set(filter(None, a.only.split(",")))
    results: list[dict] = []

    def record(check: str, ok: bool, **data) -> None:
        results.append({"check": check, "ok": ok, **data})
        print(f"{'PASS' if ok else 'FAIL'} {check} {json.dumps(data)}", flush=True)

    if a.phase == "auth":
        creds = (a.user, a.password)
        routes = [
            ("GET", "/vram-guard/v1/status"),
            ("POST", "/vram-guard/v1/free"),
            ("GET", "/sdapi/v1/options"),
        ]
        for method, route in routes:
            codes = {
                "none": http_status(a.url, route, method),
                "wrong": http_status(a.url, route, method, (a.user, a.password + "x")),
                "right": http_status(a.url, route, method, creds),
            }
            record(
                f"--api-auth {method} {route}", codes == {"none": 401, "wrong": 401, "right": 200}, **codes
            )
        code = http_status(a.url, "/internal/vram-guard/status")
        record("page readout route follows the page (no Gradio login set)", code == 200, code=code)
        with open(f"{a.out}/results-auth.json", "w") as fh:
            json.dump(results, fh, indent=1)
        return 0 if all(x["ok"] for x in results) else 1

    if a.phase == "baseline":
        for name, (path, payload) in reqs.items():
            if only and name not in only:
                continue
            r = run(a.url, name, path, payload)
            Image.fromarray(r["image"]).save(f"{a.out}/base-{name}.png")
            record(f"baseline {name}", True, seconds=r["seconds"], shape=list(r["image"].shape))
        return 0

    def base(name: str) -> np.ndarray:
        return np.asarray(Image.open(f"{a.out}/base-{name}.png").convert("RGB"))

    def with_args(name: str, args: list) -> tuple[str, dict]:
        path, payload = reqs[name]
        return path, dict(payload, alwayson_scripts={"VRAM Guard": {"args": args}})

    status, _ = call(a.url, "/vram-guard/v1/status")
    record("status route", status.get("schema") == 1, backend=status.get("backend"))

    def want(name: str) -> bool:
        return not only or name in only

    # 1. Off: bit-identical to the WebUI without the extension; no infotext entry.
    for name in ("txt2img", "hires", "img2img"):
        if not want(name):
            continue
        r = run(a.url, name, *with_args(name, [False]))
        same = np.array_equal(r["image"], base(name))
        record(f"off {name} identical to no extension", same and "VRAM Guard" not in r["infotext"],
               seconds=r["seconds"], psnr=psnr(r["image"], base(name)))  # fmt: skip

    on_positional = [True, "Auto", "Always", "exact", 16, True, 0, 0, "Auto", "Auto", False, True]
    # 2. On, positional args, VAE always tiled (16-px latent tiles: 128 px image = 1 tile, hires 2x2).
    if want("txt2img"):
        r = run(a.url, "txt2img", *with_args("txt2img", on_positional))
        st, _ = call(a.url, "/vram-guard/v1/status")
        record("on txt2img positional (VAE Always t16)", "VRAM Guard:" in r["infotext"], seconds=r["seconds"],
               psnr=psnr(r["image"], base("txt2img")), infotext=r["infotext"].split("\n")[-1],
               stages=[(s["stage"], s["plan"]) for s in st["stages"]])  # fmt: skip
        infotext = r["infotext"]
        # PNG info: the image's embedded parameters, parsed by the WebUI's own infotext parser.
        path, payload = reqs["txt2img"]
        body, _ = call(
            a.url,
            "/sdapi/v1/txt2img",
            dict(payload, alwayson_scripts={"VRAM Guard": {"args": on_positional}}),
        )
        png, _ = call(a.url, "/sdapi/v1/png-info", {"image": "data:image/png;base64," + body["images"][0]})
        params = png.get("parameters") or {}
        record("PNG info parses the VRAM Guard entry", params.get("VRAM Guard") == "preset Auto, VAE always exact t16, upscale on",
               parsed={k: v for k, v in params.items() if k.startswith("VRAM Guard")})  # fmt: skip
        # 3. Paste: the API's "infotext" field fills our args from the "VRAM Guard" entry.
        path, payload = reqs["txt2img"]
        # Forge (gradio 4): its API infotext paste fails on the "styles" field unless the request
        # sets it (the paste field returns gr.update(), {"__type__": "update"}, which Forge's
        # get_field_value passes to isinstance(value, list[str]): TypeError). Fields a request
        # sets are not pasted over.
        paste_extra = {"styles": []} if a.forge else {}
        r2 = run(a.url, "paste", path, dict(payload, infotext=infotext, **paste_extra))
        line = re.findall(r'VRAM Guard: "[^"]*"', r2["infotext"])
        want_line = re.findall(r'VRAM Guard: "[^"]*"', infotext)
        record("infotext paste via API restores the options", line == want_line and bool(line), got=line,
               psnr=psnr(r2["image"], r["image"]))  # fmt: skip
    # 4. Hires fix with name-keyed args: VAE tiled 2x2 at hires, ESRGAN tiled through our engine.
    if want("hires"):
        keyed = [{"vae_tiling": "Always", "vae_tile": 16, "upscale_tile": 32}]
        r = run(a.url, "hires", *with_args("hires", keyed))
        st, _ = call(a.url, "/vram-guard/v1/status")
        record("on hires name-keyed (VAE t16, upscale t32)", "VRAM Guard:" in r["infotext"], seconds=r["seconds"],
               psnr=psnr(r["image"], base("hires")), infotext=r["infotext"].split("\n")[-1],
               stages=[(s["stage"], s["plan"]) for s in st["stages"]])  # fmt: skip
    # 5. img2img, Auto: the encode/decode fit, so untiled = identical to the WebUI.
    if want("img2img"):
        r = run(a.url, "img2img", *with_args("img2img", [{"vae_tiling": "Auto"}]))
        st, _ = call(a.url, "/vram-guard/v1/status")
        record("on img2img Auto", "VRAM Guard:" in r["infotext"], seconds=r["seconds"],
               identical=bool(np.array_equal(r["image"], base("img2img"))), psnr=psnr(r["image"], base("img2img")),
               stages=[(s["stage"], s["plan"]) for s in st["stages"]])  # fmt: skip
    # 6. SD upscale script: its upscale runs before process_images (our job opens in setup()).
    if only and "sdupscale" in only:
        payload = dict(PROMPT, steps=1, width=256, height=256, init_images=[init_image(a.size)], denoising_strength=0.3,
                       script_name="sd upscale", script_args=["", 64, a.upscaler, 2.0],
                       alwayson_scripts={"VRAM Guard": {"args": [{"upscale_tile": 32, "vae_tiling": "Off"}]}})  # fmt: skip
        r = run(a.url, "sdupscale", "/sdapi/v1/img2img", payload)
        st, _ = call(a.url, "/vram-guard/v1/status")
        stages = [(s["stage"], s["plan"]) for s in st["stages"]]
        record("SD upscale script upscales through the engine", any(n == "img2img_upscale" for n, _ in stages),
               seconds=r["seconds"], stages=stages)  # fmt: skip
    # 7. Live previews decoded on the API thread ("Full" previews every step) while the job decodes
    # through our tiled hook: previews arrive, and the final image equals the same job unobserved.
    if only and "previews" in only:
        import threading

        opts0 = call(a.url, "/sdapi/v1/options")[0]
        keys = ("live_previews_enable", "show_progress_every_n_steps", "show_progress_type")
        call(a.url, "/sdapi/v1/options", {"live_previews_enable": True, "show_progress_every_n_steps": 1,
                                          "show_progress_type": "Full"})  # fmt: skip
        path, payload = with_args("txt2img", [{"vae_tiling": "Always", "vae_tile": 16}])
        payload = dict(payload, steps=4)
        try:
            quiet = run(a.url, "previews quiet", path, payload)
            box: dict = {}
            th = threading.Thread(target=lambda: box.update(r=run(a.url, "previews", path, payload)))
            th.start()
            previews = polls = 0
            while th.is_alive():
                prog, _ = call(a.url, "/sdapi/v1/progress?skip_current_image=false", timeout=120)
                polls += 1
                previews += bool(prog.get("current_image"))
                time.sleep(0.5)
            th.join()
            st, _ = call(a.url, "/vram-guard/v1/status")
        finally:
            call(a.url, "/sdapi/v1/options", {k: opts0.get(k) for k in keys})
        stages = [(s["stage"], s["plan"]) for s in st["stages"]]
        record("live previews on another thread during a tiled job", previews > 0
               and np.array_equal(box["r"]["image"], quiet["image"]) and any(n == "preview_decode" for n, _ in stages),
               polls=polls, previews=previews, identical=bool(np.array_equal(box["r"]["image"], quiet["image"])),
               stages=stages)  # fmt: skip
    # 8. "Save a copy of image before applying highres fix": the first-pass decode for the copy goes
    # through the hook; the hires result is the same as without the copy.
    if only and "savehires" in only:
        opts0 = call(a.url, "/sdapi/v1/options")[0]
        path, payload = with_args("hires", [{"vae_tiling": "Always", "vae_tile": 16, "upscale_tile": 32}])
        plain = run(a.url, "hires", path, payload)
        st0, _ = call(a.url, "/vram-guard/v1/status")
        again = run(a.url, "hires again", path, payload)
        st1, _ = call(a.url, "/vram-guard/v1/status")
        call(a.url, "/sdapi/v1/options", {"save_images_before_highres_fix": True})
        try:
            saved = run(a.url, "hires save-before", path, dict(payload, save_images=True))
            st, _ = call(a.url, "/vram-guard/v1/status")
        finally:
            call(
                a.url,
                "/sdapi/v1/options",
                {"save_images_before_highres_fix": opts0.get("save_images_before_highres_fix", False)},
            )
        stages = [(s["stage"], s["plan"]) for s in st["stages"]]
        record("save before hires: same hires image, first pass decoded through the hook",
               np.array_equal(plain["image"], saved["image"]) and any(n == "hires_decode" for n, _ in stages),
               seconds=saved["seconds"], stages=stages, psnr=psnr(plain["image"], saved["image"]),
               repeat_identical=bool(np.array_equal(plain["image"], again["image"])),
               repeat_psnr=psnr(plain["image"], again["image"]),
               plans=[[(s["stage"], s["plan"]) for s in x["stages"]] for x in (st0, st1)])  # fmt: skip
    # 9. FP16 UNet asked for on a CPU WebUI: skipped with a note, the image unchanged.
    if only and "unet" in only:
        off = run(a.url, "unet off", *with_args("txt2img", [False]))
        r = run(a.url, "unet", *with_args("txt2img", [{"unet_fp16": True}]))
        st, _ = call(a.url, "/vram-guard/v1/status")
        notes = json.dumps(st)
        record("FP16 UNet on CPU: skipped with a note, image as without", "not applied" in notes
               and np.array_equal(r["image"], off["image"]), psnr=psnr(r["image"], off["image"]),
               plan=[s["plan"] for s in st["stages"]][:3], infotext=r["infotext"].split("\n")[-1])  # fmt: skip
    # 10. Extras: the API passes None for our fields -> Settings defaults; enable them there first.
    if want("extras"):
        path, payload = reqs["extras"]
        # The Upscale operation caches results by input image and upscaler (not by our settings);
        # a cache size of 0 makes every call upscale again.
        cache_size = call(a.url, "/sdapi/v1/options")[0].get("upscaling_max_images_in_cache", 5)
        call(a.url, "/sdapi/v1/options", {"upscaling_max_images_in_cache": 0})
        r = run(a.url, "extras off", path, payload)
        record("extras off identical to no extension", np.array_equal(r["image"], base("extras")),
               seconds=r["seconds"])  # fmt: skip
        call(a.url, "/sdapi/v1/options", {"vram_guard_enabled": True, "vram_guard_upscale_tile": 32})
        try:
            r = run(a.url, "extras on", path, payload)
            st, _ = call(a.url, "/vram-guard/v1/status")
        finally:
            call(a.url, "/sdapi/v1/options", {"vram_guard_enabled": False, "vram_guard_upscale_tile": 0,
                                              "upscaling_max_images_in_cache": cache_size})  # fmt: skip
        record("extras on (Settings defaults, tile 32)", r["image"].shape == base("extras").shape,
               seconds=r["seconds"], psnr=psnr(r["image"], base("extras")),
               stages=[(s["stage"], s["plan"]) for s in st["stages"]])  # fmt: skip
    # 11. The documented API examples (docs/api.md), run exactly as written there.
    if only and "readme" in only:
        for label, path, payload in readme_api_examples():
            try:
                r = run(a.url, label, path, payload)
            except RuntimeError as exc:
                record(f"{label} runs as written", False, error=str(exc)[:300])
                continue
            line = re.findall(r'VRAM Guard: "[^"]*"', r["infotext"])
            record(f"{label} runs as written", bool(line) and "VRAM Guard error" not in r["infotext"],
                   seconds=r["seconds"], shape=list(r["image"].shape), entry=line)  # fmt: skip
    # 12. A bad option: HTTP 200 (the WebUI cannot fail it), but the client sees why in info.
    if only and "badoption" in only:
        path, payload = reqs["txt2img"]
        for bad, word in (({"vae_tile": 17}, "vae_tile"), ({"no_such_key": 1}, "no_such_key")):
            before = Path(a.log).read_text().count("VRAM Guard is off for this job") if a.log else None
            body, dt = call(a.url, path, dict(payload, alwayson_scripts={"VRAM Guard": {"args": [bad]}}))
            info = json.loads(body["info"])
            err = info.get("extra_generation_params", {}).get("VRAM Guard error", "")
            infotext = (info.get("infotexts") or [""])[0]
            logged = None
            if a.log:
                time.sleep(1)
                text = Path(a.log).read_text()
                logged = text.count("VRAM Guard is off for this job") - before
            record(f"bad option {bad} visible to the API client", word in err and "VRAM Guard error" in infotext
                   and "VRAM Guard:" not in infotext and logged in (None, 1),
                   error=err, logged_lines=logged, seconds=round(dt, 1))  # fmt: skip
        if a.log:
            text = Path(a.log).read_text()
            record("no 'Error running setup/process' for bad options", "Error running setup" not in text
                   and "Error running process" not in text)  # fmt: skip
    # 13. Stale defaults: a request without our args follows the Settings at request time.
    if only and "stale" in only:
        path, payload = reqs["txt2img"]
        xpath, xpayload = reqs["extras"]
        try:
            call(a.url, "/sdapi/v1/options", {"vram_guard_enabled": True})
            call(a.url, xpath, xpayload)
            call(a.url, "/sdapi/v1/options", {"vram_guard_enabled": False})
            off = run(a.url, "no args, Settings off", path, payload)
            call(a.url, "/sdapi/v1/options", {"vram_guard_enabled": True})
            on = run(a.url, "no args, Settings on", path, payload)
        finally:
            call(a.url, "/sdapi/v1/options", {"vram_guard_enabled": False})
        record("request without VRAM Guard args follows the Settings of the moment",
               "VRAM Guard:" not in off["infotext"] and "VRAM Guard:" in on["infotext"],
               off=off["infotext"].split("\n")[-1], on=on["infotext"].split("\n")[-1])  # fmt: skip
    with open(f"{a.out}/results.json", "w") as fh:
        json.dump(results, fh, indent=1)
    return 0 if all(x["ok"] for x in results) else 1


def emulate_jobs(a: argparse.Namespace) -> dict[str, tuple[str, dict]]:
    base = dict(PROMPT, steps=a.steps, width=a.size, height=a.size)
    hires = dict(PROMPT, steps=a.steps, width=a.hires_size, height=a.hires_size, enable_hr=True, hr_scale=a.hires_scale,
                 hr_upscaler=a.upscaler, hr_second_pass_steps=1, denoising_strength=0.5)  # fmt: skip
    extras = {"image": init_image(a.extras_size), "resize_mode": 0, "upscaling_resize": 4, "upscaler_1": a.upscaler,
              "upscaler_2": "None", "extras_upscaler_2_visibility": 0}  # fmt: skip
    return {"txt2img": ("/sdapi/v1/txt2img", base), "hires": ("/sdapi/v1/txt2img", hires),
            "extras": ("/sdapi/v1/extra-single-image", extras)}  # fmt: skip


DEFAULTS = {"enabled": True, "preset": "Auto", "vae_tiling": "Auto", "vae_mode": "exact", "vae_tile": 0,
            "upscale_tiling": True, "upscale_tile": 0, "upscale_batch": 0, "precision_vae": "Auto",
            "precision_upscale": "Auto", "unet_fp16": False, "release_between_stages": True}  # fmt: skip
"""VRAM Guard's shipped defaults (lib_vram.webui.options.FIELDS)."""


def _int_if_whole(v):  # noqa: ANN001, ANN202
    return int(v) if isinstance(v, float) and v.is_integer() else v


def _to_8bit(tag: str, x: np.ndarray) -> np.ndarray | None:
    """A stage's float output as the 8-bit picture the WebUI makes of it, or None (a latent)."""
    if tag == "decode-out":  # x in [-1, 1]; the WebUI clamps (x + 1) / 2 and truncates
        return (np.clip((x + 1) / 2, 0, 1) * 255).astype(np.uint8)
    if tag == "encode-in":  # the hires upscale's 8-bit output / 255
        return np.rint(x * 255).astype(np.uint8)
    return None


STAGE_NAMES = {
    "txt2img": ["decode in (sampled latent)", "decode out"],
    "hires": ["first-pass decode in (sampled latent)", "first-pass decode out",
              "hires encode in = hires upscale out", "hires encode out (latent)",
              "final decode in (hires-sampled latent)", "final decode out"],
}  # fmt: skip


def compare_stages(job: str, ref_dir: Path, got_dir: Path) -> list[dict]:
    """Each probed stage call of ``got_dir`` against the same call of ``ref_dir`` (call order):
    max abs error of the float tensor, and for pictures max error in 8-bit levels and PSNR."""
    ref, got = sorted(ref_dir.glob("*.npy")), sorted(got_dir.glob("*.npy"))
    names = STAGE_NAMES.get(job, [])
    out = []
    for i, rf in enumerate(ref):
        tag = rf.stem.split("-", 1)[1]
        e: dict = {"stage": names[i] if i < len(names) else tag}
        if i >= len(got):
            e["missing"] = True  # the job failed before this call
            out.append(e)
            continue
        x, y = np.load(rf), np.load(got[i])
        if got[i].stem.split("-", 1)[1] != tag or x.shape != y.shape:
            e["different_call"] = [got[i].stem, list(x.shape), list(y.shape)]
            out.append(e)
            continue
        e["shape"] = list(x.shape)
        e["max_abs"] = float(np.abs(x.astype(np.float64) - y).max())
        x8, y8 = _to_8bit(tag, x), _to_8bit(tag, y)
        if x8 is not None and y8 is not None:
            e["max_lsb"] = int(np.abs(x8.astype(int) - y8).max())
            e["psnr_8bit"] = psnr(x8, y8)
        out.append(e)
    return out


_PREDICTED = re.compile(
    r"VRAM Guard: (sampling|hires sampling|img2img sampling)[^:]*: predicted peak (\d+) MiB "
    r"\(UNet (\d+) MiB, activations (\d+) MiB\) for (\d+) sample\(s\) of (\S+) px, (\S+) attention: (.*)"
)


def sampling_readings(st: dict) -> list[dict]:
    """VRAM Guard's sampling passes of the last job, from the status route: its prediction (the
    pass's note: peak, UNet, activations, attention, plan) beside the measured stage peak, and the
    measured activations = the stage's peak minus the card's resident weights (the checkpoint's
    parameters on the card: UNet, text encoders, VAE), the same split as the prediction's
    (weights + what stays beside them, then activations above them)."""
    mib = 2**20
    resident = (st.get("card") or {}).get("resident_bytes") or 0
    peaks = {s["stage"]: s for s in st.get("stages", []) if not s.get("missing")}
    out = []
    for n in st.get("notes", []):
        m = _PREDICTED.search(n)
        if not m:
            continue
        what = m.group(1).replace(" ", "_")
        rec = peaks.get(what) or peaks.get("sampling" if what == "sampling" else what) or {}
        peak = rec.get("peak_bytes") or 0
        # what was resident during the pass: the checkpoint, less the idle parts moved off the card
        # (then only the UNet), less the streamed units (then the UNet's resident part; the
        # streamed units' buffers count as activations here)
        plan = m.group(8)
        on_card = resident
        streamed = re.search(r"UNet streamed: (\d+) of \d+ MiB resident", plan)
        if "off the card" in plan:
            on_card = int(m.group(3)) * mib
        if streamed:
            on_card = int(streamed.group(1)) * mib
        placed = re.search(r"checkpoint placed by VRAM Guard: UNet (\d+) of \d+ MiB resident", plan)
        if placed:  # the checkpoint placement: the UNet's resident part (the stage's peak may be
            on_card = int(placed.group(1)) * mib  # reached before the pass moved woken parts off)
        measured_act = (peak - on_card) / mib if peak else None
        pred_act = int(m.group(4))
        out.append({"pass": what, "size": m.group(6), "batch": int(m.group(5)), "attention": m.group(7),
                    "plan": m.group(8), "predicted_peak_mib": int(m.group(2)), "unet_mib": int(m.group(3)),
                    "predicted_activations_mib": pred_act, "measured_peak_mib": round(peak / mib, 1),
                    "resident_mib": round(resident / mib, 1), "on_card_during_pass_mib": round(on_card / mib, 1),
                    "measured_activations_mib": None if measured_act is None else round(measured_act, 1),
                    "activations_error_pct": None if not measured_act else round(100 * (pred_act / measured_act - 1), 1),
                    "stage_plan": rec.get("plan"),
                    # False: the stage stayed below an earlier peak of the job and its peak is a sampled
                    # lower bound (lib_vram.core.tracker): not a measurement of the pass's activations
                    "peak_exact": rec.get("exact")})  # fmt: skip
    return out


def cpu_seconds(pid_file: str | None) -> float | None:
    """User + system CPU seconds of the WebUI's process group leader and its threads so far
    (``/proc/PID/stat``), or None without ``--webui-pid``."""
    if not pid_file:
        return None
    import os

    pid = Path(pid_file).read_text().split()[0]
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _read_json(path: str | None) -> dict:
    if not path or not Path(path).exists():
        return {}
    return json.loads(Path(path).read_text())


def _probe_delta(before: dict, after: dict) -> dict:
    """The lowvram probe's counts for one job (tests/acceptance/webui_lowvram_probe): bytes moved
    per sampler step: UNet parts (in + out), and those with the control models (ControlNet's Low VRAM)."""
    d = {k: after.get(k, 0) - before.get(k, 0) for k in after if k != "unet_bytes"}
    steps = d.get("steps") or 0
    mib = 2**20

    def per_step(n: int) -> float | None:
        return round(n / steps / mib, 1) if steps else None

    unet = d.get("unet_in_bytes", 0) + d.get("unet_out_bytes", 0)
    return {**d, "unet_bytes": after.get("unet_bytes"), "unet_moved_mib_per_step": per_step(unet),
            "unet_in_mib_per_step": per_step(d.get("unet_in_bytes", 0)),
            "moved_mib_per_step": per_step(unet + d.get("control_in_bytes", 0) + d.get("control_out_bytes", 0))}  # fmt: skip


PLACEMENT_LOG = re.compile(
    r"VRAM Guard: (checkpoint placed by VRAM Guard|placed UNet|the .* (?:are|is) needed now|checkpoint placement"
    r"|sampling: moved|the checkpoint)"
)
"""The log lines of the checkpoint placement (lib_vram.webui.placement) a job record keeps."""
_PLACED_PASS = re.compile(
    r"placed UNet: (\d+) forward\(s\) this pass, (\d+) MiB copied to the card \((\d+) MiB per forward; "
    r"--lowvram would move (\d+) MiB per forward\)(?:; (\d+) units prefetched, (\d+) on demand)?"
)


def _log_size(path: str | None) -> int:
    return Path(path).stat().st_size if path and Path(path).exists() else 0


def _log_lines(path: str | None, offset: int, pattern: re.Pattern) -> list[str]:
    """The lines of the WebUI's log after byte ``offset`` that match ``pattern``."""
    if not path or not Path(path).exists():
        return []
    with open(path, "rb") as fh:
        fh.seek(offset)
        text = fh.read().decode(errors="replace")
    return [ln.strip() for ln in text.splitlines() if pattern.search(ln)]


def placed_traffic(lines: list[str], steps: int, lowvram: dict | None = None) -> dict | None:
    """The job's streamed traffic from its "placed UNet" log lines (all passes summed): MiB copied
    to the card per sampler step, VRAM Guard's model of --lowvram's, prefetch, and with ``lowvram``
    (the --lowvram start's probe counts and CPU seconds) the ratios against what was counted."""
    found = [m for m in map(_PLACED_PASS.search, lines) if m]
    if not found:
        return None
    forwards = sum(int(m.group(1)) for m in found)
    copied = sum(int(m.group(2)) for m in found)
    out: dict = {"forwards": forwards, "copied_mib": copied, "mib_per_step": round(copied / steps, 1),
                 "lowvram_model_mib_per_forward": int(found[-1].group(4)),
                 "prefetched": sum(int(m.group(5) or 0) for m in found),
                 "on_demand": sum(int(m.group(6) or 0) for m in found)}  # fmt: skip
    counted = (lowvram or {}).get("lowvram") or {}
    if counted.get("unet_moved_mib_per_step"):
        out["lowvram_counted_mib_per_step"] = counted["unet_moved_mib_per_step"]
        out["ratio_vs_lowvram"] = round(out["mib_per_step"] / counted["unet_moved_mib_per_step"], 3)
    return out


def emulate_phase(a: argparse.Namespace) -> int:
    """The ``emulate-ref`` and ``emulate`` phases (see the module docstring), with the WebUI's own
    ESRGAN tile set to ``--esrgan-tile`` for the run and put back afterwards."""
    opts = call(a.url, "/sdapi/v1/options")[0]
    saved = opts.get("ESRGAN_tile")
    new: dict = {"ESRGAN_tile": a.esrgan_tile}
    if a.attention is not None:
        # v1.10.1 re-hijacks the model when the option changes (initialize_util: onchange ->
        # model_hijack.redo_hijack): the next job runs with the new attention, no restart
        new["cross_attention_optimization"] = a.attention
    call(a.url, "/sdapi/v1/options", new)
    print(f"ESRGAN_tile {saved!r} -> {a.esrgan_tile} for this run"
          + (f"; attention {opts.get('cross_attention_optimization')!r} -> {a.attention!r}" if a.attention else ""),
          flush=True)  # fmt: skip
    try:
        return _emulate_phase(a)
    finally:
        back = {"ESRGAN_tile": _int_if_whole(saved)}
        if a.attention is not None:
            back["cross_attention_optimization"] = opts.get("cross_attention_optimization")
        call(a.url, "/sdapi/v1/options", back)
        print(f"restored {back}", flush=True)


def expected_attention(title: str | None) -> str | None:
    """VRAM Guard's model name for the WebUI's ``cross_attention_optimization`` value (an
    optimizer's title ``"NAME - label"``, ``"None"``, ``"Automatic"``) on the CPU, or None without
    ``--attention``."""
    if title is None:
        return None
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from lib_vram.sampling import attention_of

    name = title.split(" - ", 1)[0]
    return attention_of(name, backend="cpu")


def attention_followed(a: argparse.Namespace, readings: list[dict]) -> bool:
    """Every sampling pass's note names the attention ``--attention`` switched to (always true
    without ``--attention``; false without a pass)."""
    want = expected_attention(a.attention)
    return bool(readings) and (want is None or all(r["attention"] == want for r in readings))


def _emulate_phase(a: argparse.Namespace) -> int:
    import os

    os.makedirs(a.out, exist_ok=True)
    jobs = emulate_jobs(a)
    only = set(filter(None, a.only.split(","))) or set(jobs)
    results: list[dict] = []
    mib = 2**20

    def record(check: str, ok: bool, **data) -> None:
        results.append({"check": check, "ok": ok, **data})
        print(f"{'PASS' if ok else 'FAIL'} {check} {json.dumps(data)}", flush=True)

    def job(
        name: str, on: bool | dict, esrgan_tile: int | None = None, label: str | None = None,
        extra: dict | None = None,
    ) -> tuple[dict | None, str | None, dict]:  # fmt: skip
        """One job; returns (result or None, error text or None, status after it). ``esrgan_tile``:
        the WebUI's own ESRGAN tile size for this job (Settings → Upscaling; 0 = untiled). With
        ``--stage-dump``, the probe's files of this job go to ``OUT/stages/<label>``."""
        path, payload = jobs[name]
        payload = dict(payload, **(extra or {}))
        if a.stage_dump:
            for f in Path(a.stage_dump).glob("*.npy"):
                f.unlink()
        opts0 = None
        if name == "extras":  # the Extras API passes None for our fields: the Settings decide
            opts0 = call(a.url, "/sdapi/v1/options")[0]
            new = {"upscaling_max_images_in_cache": 0}
            new.update({f"vram_guard_{k}": v for k, v in DEFAULTS.items()}, vram_guard_enabled=bool(on))
            if esrgan_tile is not None:
                new["ESRGAN_tile"] = esrgan_tile
            call(a.url, "/sdapi/v1/options", new)
        else:
            # every field stated: the Settings page's defaults (which name-keyed args fall back to)
            # are shared state another run may have changed
            args = [False] if not on else [dict(DEFAULTS, **(on if isinstance(on, dict) else {}))]
            payload = dict(payload, alwayson_scripts={"VRAM Guard": {"args": args}})
        cpu0 = cpu_seconds(a.webui_pid)
        probe0 = _read_json(a.lowvram_probe)
        log0 = _log_size(a.log)
        try:
            r, err = run(a.url, name, path, payload), None
        except RuntimeError as exc:
            r, err = None, str(exc)
        finally:
            if r is not None and cpu0 is not None:
                r["cpu_seconds"] = round(cpu_seconds(a.webui_pid) - cpu0, 1)
            if r is not None and a.lowvram_probe:
                r["lowvram"] = _probe_delta(probe0, _read_json(a.lowvram_probe))
            if opts0 is not None:
                keys = (
                    "upscaling_max_images_in_cache",
                    "ESRGAN_tile",
                    *(f"vram_guard_{k}" for k in DEFAULTS),
                )
                # the options route hands integers back as floats: restore 192, not 192.0 (the
                # WebUI's ESRGAN path fails with a float tile size)
                call(a.url, "/sdapi/v1/options", {k: _int_if_whole(opts0.get(k)) for k in keys})
        st, _ = call(a.url, "/vram-guard/v1/status")
        if a.log:
            time.sleep(1)  # the last lines of the job reach the log file
            st["_log"] = _log_lines(a.log, log0, PLACEMENT_LOG)
        if a.stage_dump and label:
            dest = Path(a.out, "stages", label)
            dest.mkdir(parents=True, exist_ok=True)
            for f in dest.glob("*.npy"):
                f.unlink()
            for f in sorted(Path(a.stage_dump).glob("*.npy")):
                f.replace(dest / f.name)
        return r, err, st

    def stages(st: dict) -> list:
        # (stage, plan, peak MiB, exact): not exact = a sampled lower bound below an earlier peak of the job
        return [(s["stage"], s["plan"], round((s.get("peak_bytes") or 0) / mib, 1), s.get("exact"))
                for s in st.get("stages", []) if not s.get("missing")]  # fmt: skip

    ref_file = f"{a.out}/emulate-ref.json"
    if a.phase == "emulate-ref":
        ref: dict = {}
        for name in jobs:
            if name not in only or a.vg_only:
                continue
            r, err, st = job(name, False, label=f"ref-{name}")
            card = st.get("card") or {}
            if r is None:
                record(f"uncapped plain {name}", False, error=err)
                continue
            Image.fromarray(r["image"]).save(f"{a.out}/emu-ref-{name}.png")
            ref[name] = {"seconds": r["seconds"], "peak_bytes": card.get("peak_bytes"),
                         "resident_bytes": card.get("resident_bytes"), "cpu_seconds": r.get("cpu_seconds"),
                         "lowvram": r.get("lowvram")}  # fmt: skip
            vs: dict = {}
            if a.compare_to:  # this start's plain picture against another start's (the uncapped plain)
                other = np.asarray(Image.open(Path(a.compare_to, f"emu-ref-{name}.png")).convert("RGB"))
                vs = {"identical_to_compared": bool(np.array_equal(r["image"], other)),
                      "max_lsb_vs_compared": int(np.abs(r["image"].astype(int) - other).max()),
                      "psnr_vs_compared": psnr(r["image"], other)}  # fmt: skip
                if a.stage_dump:
                    vs["stages_vs_compared"] = compare_stages(
                        name,
                        Path(a.compare_to, "stages", f"ref-{name}"),
                        Path(a.out, "stages", f"ref-{name}"),
                    )
            record(f"uncapped plain {name}", True, seconds=r["seconds"], shape=list(r["image"].shape),
                   peak_mib=round((card.get("peak_bytes") or 0) / mib, 1),
                   resident_mib=round((card.get("resident_bytes") or 0) / mib, 1),
                   cpu_seconds=r.get("cpu_seconds"), lowvram=r.get("lowvram"), **vs)  # fmt: skip
        if "txt2img" in only and not a.plain_only:
            # stage peaks: VRAM Guard on, nothing tiled (the same computation as the plain WebUI)
            r, err, st = job(
                "txt2img", {"vae_tiling": "Off", "upscale_tiling": False}, label="ref-txt2img-vg-untiled"
            )
            ref["txt2img_stages"] = {s["stage"]: s.get("peak_bytes") for s in st.get("stages", [])
                                     if not s.get("missing")}  # fmt: skip
            same = r is not None and (
                a.vg_only
                or np.array_equal(r["image"], np.asarray(Image.open(f"{a.out}/emu-ref-txt2img.png")))
            )
            readings = sampling_readings(st)
            record("stage peaks (VRAM Guard on, tiling off)", same and attention_followed(a, readings),
                   stages=stages(st), sampling=readings, seconds=r and r["seconds"], error=(err or "")[:300],
                   attention_option=a.attention, attention_expected=expected_attention(a.attention),
                   cpu_seconds=r and r.get("cpu_seconds"))  # fmt: skip
            peaks = ref["txt2img_stages"]
            if "sampling" in peaks and "decode" in peaks:
                # stage peaks are the card's use (resident included) since the job started
                cap = (peaks["sampling"] + peaks["decode"]) // 2
                ref["suggested_cap_bytes"] = cap
                record("suggested cap (half-way between the sampling and decode peaks)", True,
                       cap_mib=round(cap / mib), flag=f"--vram-guard-emulate-vram {cap // mib}MB")  # fmt: skip
        if "hires" in only and ("hires" in ref or a.vg_only) and not a.plain_only:
            # the hires job's stage peaks and sampling predictions the same way (first and hires pass)
            r, err, st = job(
                "hires", {"vae_tiling": "Off", "upscale_tiling": False}, label="ref-hires-vg-untiled"
            )
            ref["hires_stages"] = {s["stage"]: s.get("peak_bytes") for s in st.get("stages", [])
                                   if not s.get("missing")}  # fmt: skip
            ref_png = Path(a.out, "emu-ref-hires.png")
            base_img = np.asarray(Image.open(ref_png).convert("RGB")) if ref_png.exists() else None
            record("hires stage peaks (VRAM Guard on, tiling off)", r is not None, error=(err or "")[:300],
                   identical=r is not None and base_img is not None and bool(np.array_equal(r["image"], base_img)),
                   psnr_vs_plain=psnr(r["image"], base_img) if r is not None and base_img is not None else None,
                   stages=stages(st), sampling=sampling_readings(st), seconds=r and r["seconds"],
                   cpu_seconds=r and r.get("cpu_seconds"))  # fmt: skip
        with open(ref_file, "w") as fh:
            json.dump(ref, fh, indent=1)
        return 0 if all(x["ok"] for x in results) else 1

    with open(ref_file) as fh:
        ref = json.load(fh)
    for _ in range(60):  # the API answers a moment before the extensions' app_started callbacks ran
        try:
            status, _ = call(a.url, "/vram-guard/v1/status")
            break
        except RuntimeError:
            time.sleep(2)
    if status.get("placement") and "placement off" not in status["placement"]:
        status = _loaded_status(a.url, wait_s=300)  # the checkpoint loads (and is placed) in a thread
    card = status.get("card") or {}
    cap = card.get("capacity_bytes")
    record("status: emulated card", bool(status.get("emulated")), emulated=status.get("emulated"),
           cap_mib=round((cap or 0) / mib, 1), resident_mib=round(card.get("resident_bytes", 0) / mib, 1),
           placement=status.get("placement"), log_at_load=_log_lines(a.log, 0, PLACEMENT_LOG)[:6])  # fmt: skip
    lowvram_ref = _read_json(str(Path(a.lowvram_ref, "emulate-ref.json"))) if a.lowvram_ref else {}
    for name in jobs:
        if name not in only or name not in ref:
            continue
        base_img = np.asarray(Image.open(f"{a.out}/emu-ref-{name}.png").convert("RGB"))
        stage_dir = Path(a.out, "stages")
        if name == "extras":
            # VRAM Guard first, then the WebUI's own ESRGAN path with its default 192-px tiles and
            # untiled (tile 0, what the reference ran). The card's use before VRAM Guard's job: what
            # the failed plain jobs before it left (VRAM Guard's job start releases it)
            before, _ = call(a.url, "/vram-guard/v1/status")
            used_before = (before.get("card") or {}).get("used_bytes") or 0
            vg, err, st = job(name, True, label="vg-extras")
            c = st.get("card") or {}
            diff = None
            if vg is not None and vg["image"].shape == base_img.shape:
                diff = int(np.abs(vg["image"].astype(int) - base_img).max())
            record("VRAM Guard extras on the capped card: completes, <= 1 LSB from the uncapped plain (tile 0)",
                   vg is not None and diff is not None and diff <= 1, error=(err or "")[:300],
                   seconds=vg and vg["seconds"], max_lsb=diff,
                   psnr_vs_uncapped_plain=psnr(vg["image"], base_img) if vg is not None else None,
                   peak_mib=round((c.get("peak_bytes") or 0) / mib, 1), cap_mib=round((cap or 0) / mib, 1),
                   used_before_mib=round(used_before / mib, 1), used_after_mib=round((c.get("used_bytes") or 0) / mib, 1),
                   ooms=c.get("ooms"), stages=stages(st))  # fmt: skip
            r, err, st = job(name, False, esrgan_tile=192, label="plain-extras-192")
            c = st.get("card") or {}
            record("plain WebUI extras, its own 192-px ESRGAN tiles", True, completed=r is not None,
                   error=(err or "")[:300], seconds=r and r["seconds"], peak_mib=round((c.get("peak_bytes") or 0) / mib, 1),
                   psnr_vs_uncapped_untiled=psnr(r["image"], base_img) if r is not None else None,
                   psnr_vram_guard_vs_this=psnr(vg["image"], r["image"]) if r is not None and vg is not None else None)  # fmt: skip
            r, err, st = job(name, False, esrgan_tile=0, label="plain-extras")
            c = st.get("card") or {}
            oom = r is None and err is not None and "out of memory" in err.lower()
            record("plain WebUI extras untiled (ESRGAN tile 0) on the capped card: out-of-memory error", oom,
                   error=(err or "")[:300], peak_mib=round((c.get("peak_bytes") or 0) / mib, 1))  # fmt: skip
            continue
        r, err, st = job(name, True, label=f"vg-{name}")
        c = st.get("card") or {}
        ok = r is not None
        if ok:
            Image.fromarray(r["image"]).save(f"{a.out}/emu-vg-{name}.png")
        p = psnr(r["image"], base_img) if ok else None
        cmp = (
            compare_stages(name, stage_dir / f"ref-{name}", stage_dir / f"vg-{name}")
            if a.stage_dump
            else None
        )
        record(f"VRAM Guard {name} on the capped card: completes", ok, error=(err or "")[:300], seconds=r and r["seconds"],
               psnr_vs_uncapped_plain=p, identical=ok and bool(np.array_equal(r["image"], base_img)),
               max_lsb=int(np.abs(r["image"].astype(int) - base_img).max()) if ok and r["image"].shape == base_img.shape else None,
               peak_mib=round((c.get("peak_bytes") or 0) / mib, 1), cap_mib=round((cap or 0) / mib, 1),
               ooms=c.get("ooms"), stages=stages(st), notes=[n for n in st.get("notes", []) if "out of memory" in n],
               infotext=(r["infotext"].split("\n")[-1] if ok else None), stage_vs_uncapped_plain=cmp,
               sampling=sampling_readings(st), cpu_seconds=r and r.get("cpu_seconds"),
               vg_notes=[n for n in st.get("notes", []) if n.startswith("VRAM Guard")],
               placement=st.get("placement"), placement_log=st.get("_log"),
               traffic=placed_traffic(st.get("_log") or [], a.steps, lowvram_ref.get(name)),
               lowvram_cpu_seconds=(lowvram_ref.get(name) or {}).get("cpu_seconds"),
               lowvram_seconds=(lowvram_ref.get(name) or {}).get("seconds"))  # fmt: skip
        if a.plain_only:  # emulate: VRAM Guard's job only (the plain one's failure shown elsewhere)
            continue
        # then the plain WebUI (after VRAM Guard: what a failed job leaves allocated cannot touch it)
        r, err, st = job(name, False, label=f"plain-{name}")
        c = st.get("card") or {}
        oom = r is None and err is not None and "out of memory" in err.lower()
        cmp = (
            compare_stages(name, stage_dir / f"ref-{name}", stage_dir / f"plain-{name}")
            if a.stage_dump
            else None
        )
        record(f"plain WebUI {name} on the capped card: out-of-memory error", oom, error=(err or "")[:300],
               plain_uncapped_peak_mib=round((ref[name].get("peak_bytes") or 0) / mib, 1),
               used_after_mib=round((c.get("used_bytes") or 0) / mib, 1), stage_vs_uncapped_plain=cmp)  # fmt: skip
        if name == "txt2img" and r is None:
            # what the failed job leaves on the card, and what frees it: another request (the
            # server's worker thread drops its last exception), then a gc.collect() (POST /free)
            call(a.url, "/sdapi/v1/options")
            st1, _ = call(a.url, "/vram-guard/v1/status")
            fr, _ = call(a.url, "/vram-guard/v1/free", {})
            used1 = (st1.get("card") or {}).get("used_bytes") or 0
            used2 = (fr.get("card") or {}).get("used_bytes") or 0
            resident = (fr.get("card") or {}).get("resident_bytes") or 0
            record("what a failed plain job leaves on the card, and what frees it", True,
                   used_after_job_mib=round((c.get("used_bytes") or 0) / mib, 1),
                   used_after_another_request_mib=round(used1 / mib, 1), used_after_gc_collect_mib=round(used2 / mib, 1),
                   resident_mib=round(resident / mib, 1), gc_collected_objects=fr.get("collected_objects"))  # fmt: skip
    if "stopped" in only:
        # a card too small for the hires pass even at micro-batch 1 (and streamed): VRAM Guard's
        # named error before that pass samples; the first pass's picture kept (the WebUI's own
        # "Save a copy of image before applying highres fix", the request saving its images); then
        # the plain WebUI on the same job: its raw out-of-memory error, where and after how long
        opt0 = call(a.url, "/sdapi/v1/options")[0].get("save_images_before_highres_fix")
        call(a.url, "/sdapi/v1/options", {"save_images_before_highres_fix": True})
        try:
            for on, label in ((True, "vg-stopped"), (False, "plain-stopped")):
                t0 = time.time()
                log0 = Path(a.log).stat().st_size if a.log else 0
                r, err, st = job("hires", on, label=label, extra={"save_images": True})
                took = round(time.time() - t0, 1)
                c = st.get("card") or {}
                kept = sorted(str(f) for f in Path(a.outputs).glob("txt2img-images/*/*-before-highres-fix.png")
                              if f.stat().st_mtime >= t0)  # fmt: skip
                where = []
                if a.log:
                    time.sleep(1)
                    with open(a.log, "rb") as fh:
                        fh.seek(log0)
                        text = fh.read().decode(errors="replace")
                    where = [ln.strip() for ln in text.splitlines()
                             if re.search(r'File ".*", line \d+, in |Error|VRAM Guard', ln)][-14:]  # fmt: skip
                if on:
                    line = next((n for n in st.get("notes", []) if "VRAM Guard stopped" in n), None)
                    ok = r is None and err is not None and "VRAM Guard stopped" in err and bool(kept)
                    check = "VRAM Guard on a too-small card: its named error before the pass samples, the first pass kept"
                else:
                    line = None
                    ok = r is None and err is not None and "out of memory" in err.lower() and bool(kept)
                    check = (
                        "plain WebUI on the too-small card: a raw out-of-memory error, the first pass kept"
                    )
                record(check, ok, error=(err or "")[:600], note=line, seconds=took, first_pass_kept=kept,
                       stages=stages(st), sampling=sampling_readings(st), log=where,
                       peak_mib=round((c.get("peak_bytes") or 0) / mib, 1), cap_mib=round((cap or 0) / mib, 1),
                       ooms=c.get("ooms"), used_after_mib=round((c.get("used_bytes") or 0) / mib, 1),
                       resident_mib=round((c.get("resident_bytes") or 0) / mib, 1))  # fmt: skip
                if on and a.vg_only:
                    break
        finally:
            call(a.url, "/sdapi/v1/options", {"save_images_before_highres_fix": bool(opt0)})
    for check in ("offload", "offload-medvram"):
        if check in only and "txt2img" in ref:
            offload_check(a, check, job, record, cap)
    with open(f"{a.out}/emulate-results.json", "w") as fh:
        json.dump(results, fh, indent=1)
    return 0 if all(x["ok"] for x in results) else 1


MOVED = "off the card for this pass"
"""Words of VRAM Guard's note when it moves the idle UNet / text encoders for a VAE pass."""


def _loaded_status(url: str, wait_s: float = 600) -> dict:
    """The status route once the checkpoint is resident on the emulated card (the WebUI loads it
    in a thread after the API answers)."""
    deadline = time.time() + wait_s
    while True:
        st, _ = call(url, "/vram-guard/v1/status")
        if (st.get("card") or {}).get("resident_bytes") or time.time() > deadline:
            return st
        time.sleep(3)


def offload_check(a: argparse.Namespace, check: str, job, record, cap: int | None) -> None:  # noqa: ANN001
    """``--only offload`` / ``offload-medvram`` of the ``emulate`` phase (module docstring)."""
    mib = 2**20
    host_swaps = check == "offload-medvram"
    base_img = np.asarray(Image.open(f"{a.out}/emu-ref-txt2img.png").convert("RGB"))
    before = _loaded_status(a.url)
    resident0 = (before.get("card") or {}).get("resident_bytes") or 0
    ooms0 = (before.get("card") or {}).get("ooms") or 0
    log0 = Path(a.log).stat().st_size if a.log else 0
    r, err, st = job("txt2img", {"vae_tiling": "Always", "vae_tile": a.offload_tile}, label=f"vg-{check}")
    c = st.get("card") or {}
    resident1 = c.get("resident_bytes") or 0
    moved_notes = [n for n in st.get("notes", []) if MOVED in n]
    events = [e for e in ((st.get("timeline") or {}).get("events") or []) if e.get("kind") == "offload"]
    max_lsb = int(np.abs(r["image"].astype(int) - base_img).max()) if r is not None else None
    log_lines: list[str] = []
    bad_lines: list[str] = []
    if a.log:
        time.sleep(1)
        with open(a.log, "rb") as fh:
            fh.seek(log0)
            text = fh.read().decode(errors="replace")
        log_lines = [
            ln for ln in text.splitlines() if "VRAM Guard" in ln and ("card" in ln or "decode" in ln)
        ]
        bad_lines = [ln for ln in text.splitlines() if re.search(r"Error|Traceback", ln)]
    cmp = (
        compare_stages("txt2img", Path(a.out, "stages", "ref-txt2img"), Path(a.out, "stages", f"vg-{check}"))
        if a.stage_dump
        else None
    )
    data = dict(error=(err or "")[:300], seconds=r and r["seconds"], max_lsb=max_lsb,
                psnr_vs_uncapped_plain=psnr(r["image"], base_img) if r is not None else None,
                notes_moved=moved_notes, offload_events=events,
                resident_before_mib=round(resident0 / mib, 1), resident_after_mib=round(resident1 / mib, 1),
                peak_mib=round((c.get("peak_bytes") or 0) / mib, 1), cap_mib=round((cap or 0) / mib, 1),
                new_ooms=(c.get("ooms") or 0) - ooms0, stages=[(s["stage"], s["plan"], round((s.get("peak_bytes") or 0) / mib, 1))
                for s in st.get("stages", []) if not s.get("missing")],
                log_vram_guard=log_lines[-8:], log_error_lines=bad_lines[:8], stage_vs_uncapped_plain=cmp)  # fmt: skip
    if host_swaps:
        ok = not moved_notes and not events and resident1 == resident0 and not bad_lines
        record("--medvram (the host swaps models): VRAM Guard moves nothing off the card", ok, **data)
        return
    ok = (
        r is not None
        and max_lsb is not None
        and max_lsb <= 1
        and any("moved the UNet, text encoders (" in n for n in moved_notes)
        and len(events) == 1
        and resident1 == resident0 > 0
        and (c.get("peak_bytes") or 0) <= (cap or 0)
        and not bad_lines
    )
    record(f"VRAM Guard txt2img, one forced {a.offload_tile}-px decode tile on the capped card: the idle "
           "UNet and text encoders leave the card for the decode and come back; uncapped plain picture", ok, **data)  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
