"""``python -m lib_vram bench soak``: many mixed jobs in one process; nothing may grow or stay behind.

Two ways to run it:

* ``--quick`` (library level, no WebUI; what CI runs): a checkpoint of real ldm modules at a small
  width (the UNet with cross-attention, the VAE decoder and encoder, a text encoder's weights) placed
  by VRAM Guard on an emulated card below it (:func:`lib_vram.residency.plan_checkpoint`: a third
  of the UNet streams, the text encoders and VAE wait in host memory; :class:`~lib_vram.residency.Owner`
  moves them) and a spandrel ESRGAN loaded from a file. Jobs cycle through txt2img, img2img, hires
  fix and an Extras upscale, each with its own prompt; every other round merges a LoRA-style
  low-rank update into two of the UNet's attention weights in place (the built-in Lora extension's
  way: a backup, then the weight changed) and restores it after the job. Per job: ``ok`` (it ran,
  and a job without the LoRA equals the first run of its kind bit for bit: nothing of a merge left
  in a streamed or parked copy), ``rss_bytes``, ``card_bytes_at_rest`` (the card after the job:
  must be the placed checkpoint's resident bytes, nothing more) and ``seconds``.
* ``--url URL`` (a running WebUI with ``--api``): the same mix through its API (``--lora NAME``
  adds ``<lora:NAME:1>`` to every other prompt), ``--poll`` reads the status route every 200 ms
  during the jobs, ``--clients 2`` sends from two clients at once (the WebUI queues them). Per job:
  ``ok``, ``rss_bytes`` and ``card_bytes_at_rest`` from the status route, ``seconds``.

The summary: every job ok, RSS after the last job within 5 % of after job 10, the card at rest at
its baseline after every job, the median seconds of the first and the last tenth. Exit 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time

from lib_vram.cli.common import MAX_COUNT, bounded_int

HELP = "Soak: many mixed jobs in one process (RSS, the card at rest, time per job); --quick without a WebUI."
KINDS = ("txt2img", "img2img", "hires", "extras")
VAE_EXACT = 1e-4
"""The exact tiled VAE's promise against another tile plan (tests/tolerances.py)."""
RSS_GROWTH = 0.05
"""RSS after the last job may exceed RSS after job 10 by this share at most."""


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="library level, no WebUI (a few minutes)")
    parser.add_argument("--url", help="a running WebUI (started with --api) to drive instead")
    parser.add_argument(
        "--jobs", type=bounded_int("--jobs", 10, MAX_COUNT * 10), default=100, help="jobs (default 100)"
    )
    parser.add_argument("--lora", help="--url: a LoRA's name for every other prompt")
    parser.add_argument("--poll", action="store_true", help="--url: read the status route every 200 ms")
    parser.add_argument(
        "--clients", type=bounded_int("--clients", 1, 8), default=1, help="--url: clients at once"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON record per job, then the summary")


# -- library level -----------------------------------------------------------------------------


class _Checkpoint:
    """Real ldm modules at a small width, placed on an emulated card below them."""

    def __init__(self) -> None:
        import contextlib
        import io

        import torch

        from lib_vram import sampling
        from lib_vram.core import emulate
        from lib_vram.residency import HOST, STREAMED, Model, Owner, plan_checkpoint
        from lib_vram.residency._modules import ModuleMover, nbytes_of, tensors_of

        from ._unet import build_unet

        with contextlib.redirect_stdout(io.StringIO()):
            from ldm.modules.diffusionmodules.model import Decoder, Encoder

            self.unet = build_unet("sd15", 32, context_dim=64, seed=4).eval()
            g = torch.Generator().manual_seed(4)
            with torch.no_grad():  # ldm zero-initialises its output layers: a UNet that predicts 0
                for p in self.unet.parameters():
                    p.copy_(torch.randn(p.shape, generator=g) * 0.05)
            torch.manual_seed(5)
            vae = dict(
                ch=32,
                out_ch=3,
                ch_mult=(1, 2),
                num_res_blocks=1,
                attn_resolutions=[],
                in_channels=3,
                resolution=64,
                z_channels=4,
            )
            self.decoder, self.encoder = Decoder(**vae).eval(), Encoder(**vae).eval()
        self.vae = torch.nn.ModuleDict({"decoder": self.decoder, "encoder": self.encoder})
        self.te = torch.nn.Embedding(1000, 64)
        unet_b = nbytes_of(tensors_of([self.unet]))
        parked = [
            ("text encoders", nbytes_of(tensors_of([self.te]))),
            ("VAE", nbytes_of(tensors_of([self.vae]))),
        ]
        spec = sampling.unet_spec(self.unet)
        step = dict(
            batch=2, latent_hw=(8, 8), context_tokens=77, attention="none", dtype=torch.float32, backend="cpu"
        )
        card = 0
        for card in range(unet_b // 4, 4 * unet_b, max(1, unet_b // 64)):  # the smallest card keeping 2/3
            cp = plan_checkpoint(
                self.unet,
                spec,
                card_bytes=card,
                safety_bytes=1 << 20,
                leftover_bytes=0,
                parked=parked,
                **step,
            )
            if cp.fits and cp.unet_resident_bytes >= 2 * unet_b // 3:
                break
        self.plan = cp
        # and room for the VAE's and the upscaler's working memory beside the resident UNet (the
        # placement leaves room for the VAE's weights; its tiles are what is free then)
        self.card = emulate.EmulatedCard(card + 6 * (1 << 20))
        self.streamer = sampling.StreamedUNet(self.unet, cp.stream, torch.device("cpu"), card=self.card)
        self.streamer.__enter__()
        self.card.set_resident(cp.unet_resident_bytes)
        self.owner = Owner(lambda: self.card.free_bytes)
        um = Model(
            "UNet",
            "unet",
            unet_b,
            ModuleMover(self.unet, torch.device("cpu"), self.card),
            home=STREAMED,
            where=STREAMED,
            resident_bytes=cp.unet_resident_bytes,
            movable=False,
        )
        self.owner.join(um)
        self.unet_model = um
        self.models = {}
        for name, module in (("text encoders", self.te), ("VAE", self.vae)):
            mover = ModuleMover(module, torch.device("cpu"), self.card)
            m = self.owner.join(
                Model(
                    name, name, parked[0 if name == "text encoders" else 1][1], mover, home=HOST, where=HOST
                )
            )
            mover.on_use = lambda m=m: self.owner.use(m, why="needed")
            mover.hook()
            self.models[name] = m
        self.baseline = self.card.used_bytes

    def close(self) -> None:
        self.streamer.release_to_host()  # (the card cannot hold the whole UNet: all of it to host memory)


def _library_jobs(n_jobs: int, emit) -> list[dict]:  # noqa: ANN001
    import gc
    import os
    import tempfile

    import psutil
    import spandrel
    import torch
    from safetensors.torch import save_file

    from lib_vram.core import emulate
    from lib_vram.planning import planner
    from lib_vram.upscale import UpscaleConfig, upscale_tensor
    from lib_vram.vae import TiledVAEConfig, tiled_decode, tiled_encode

    from ._synthetic import image_like, make_imagelike_rrdb, rrdb_class

    ck = _Checkpoint()
    torch.manual_seed(0)
    net = make_imagelike_rrdb(rrdb_class()(in_nc=3, out_nc=3, num_filters=8, num_blocks=1, scale=4))
    tmp = tempfile.TemporaryDirectory()
    path = os.path.join(tmp.name, "rrdb.safetensors")
    save_file({k: v.contiguous() for k, v in net.state_dict().items()}, path)
    lora = [m for n, m in ck.unet.named_modules() if n.endswith(("attn2.to_k", "attn2.to_v"))][:2]
    g = torch.Generator().manual_seed(1)
    deltas = [
        torch.randn(m.weight.shape[0], 4, generator=g) @ torch.randn(4, m.weight.shape[1], generator=g) * 0.01
        for m in lora
    ]
    img = image_like(32, 32, 3, seed=2) * 2 - 1
    cfg = TiledVAEConfig(mode="exact", tile=8)
    first: dict[str, torch.Tensor] = {}
    mem = planner.PlanMemory()  # what the engines learn, kept for the session as in the WebUI
    ctx = torch.randn(1, 77, 64, generator=torch.Generator().manual_seed(6))
    proc = psutil.Process()
    records = []

    def sample(x: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        ck.owner.begin("sampling", busy=[ck.unet_model])
        try:
            for t in (700, 300):
                x = (
                    x
                    - 0.1
                    * ck.unet(torch.cat([x, x]), torch.full((2,), t), context=context.expand(2, -1, -1))[:1]
                )
        finally:
            ck.streamer.settle()
            ck.owner.end("sampling")
        return x

    def vae(kind: str, x: torch.Tensor) -> torch.Tensor:
        ck.owner.begin(kind, busy=[ck.models["VAE"]])
        try:
            ck.owner.use(ck.models["VAE"], kind)
            run = tiled_decode if kind == "decode" else tiled_encode
            out = run(
                ck.decoder if kind == "decode" else ck.encoder, x, config=cfg, memory=planner.PlanMemory()
            )
            return out if kind == "decode" else out[:, :4]
        finally:
            ck.owner.end(kind)

    def job(kind: str, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(the sampler's last latent, the picture); Extras: (its input, the upscaled picture)."""
        context = ck.te(torch.randint(0, 1000, (1, 77), generator=torch.Generator().manual_seed(n)))
        context = context * 0 + ctx  # each job's prompt runs the text encoders; the picture stays comparable
        x = torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(KINDS.index(kind)))
        if kind == "extras":  # the upscaler is built from its file at every call, as the WebUI does
            ck.owner.settle()
            upscaler = spandrel.ModelLoader().load_from_file(path)
            config = UpscaleConfig(tile=16, batch=1)
            return img, upscale_tensor(upscaler, img.clone(), config=config, memory=mem)
        if kind == "img2img":
            x = vae("encode", img)
        x = sample(x, context)
        if kind == "hires":
            x = sample(torch.nn.functional.interpolate(x, size=(16, 16), mode="nearest"), context)
        return x, vae("decode", x)

    try:
        for n in range(n_jobs):
            kind = KINDS[n % len(KINDS)]
            with_lora = (n // len(KINDS)) % 2 == 1 and kind != "extras"
            t0 = time.perf_counter()
            error = None
            backups = []
            try:
                with torch.no_grad(), emulate.running_on(ck.card):
                    if with_lora:
                        for m, d in zip(lora, deltas):
                            backups.append(m.weight.detach().clone())
                            emulate.to_host(backups[-1])  # the Lora extension keeps it on the CPU
                            m.weight.data += d  # in place, as the Lora extension merges
                    out = job(kind, n)
                    for t in out:
                        emulate.to_host(t)  # (kept for the comparison: not the card's)
                    ok = True
                    if not with_lora:
                        ref = first.setdefault(kind, out)
                        # the sampler's latent bit for bit; the picture within the exact tiled
                        # VAE's promise (another tile plan may round differently)
                        lat, pic = float((out[0] - ref[0]).abs().max()), float((out[1] - ref[1]).abs().max())
                        ok = lat == 0 and pic <= VAE_EXACT
                        if not ok:
                            error = (
                                f"differs from the first {kind}: latent by {lat:.3g}, picture by {pic:.3g}"
                            )
                    elif kind in first and torch.equal(out[1], first[kind][1]):
                        ok, error = (
                            False,
                            "the LoRA changed nothing (a streamed copy kept the unmerged weight?)",
                        )
            except Exception as exc:  # noqa: BLE001 (a soak records every failure and goes on)
                ok, error = False, f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
            finally:
                with torch.no_grad():
                    for m, b in zip(lora, backups):
                        m.weight.data.copy_(b)
                ck.owner.settle()
            gc.collect()
            rec = {
                "job": n + 1,
                "kind": kind,
                "lora": with_lora,
                "ok": ok,
                "error": error,
                "rss_bytes": int(proc.memory_info().rss),
                "card_bytes_at_rest": int(ck.card.used_bytes),
                "card_baseline_bytes": int(ck.baseline),
                "seconds": round(time.perf_counter() - t0, 3),
            }
            records.append(rec)
            emit(rec)
    finally:
        ck.close()
        tmp.cleanup()
    return records


# -- a running WebUI ---------------------------------------------------------------------------


def _webui_jobs(a: argparse.Namespace, emit) -> list[dict]:  # noqa: ANN001
    import base64
    import io
    import urllib.request

    import numpy as np
    from PIL import Image

    def call(path: str, payload: dict | None = None, timeout: float = 3600) -> dict:
        data = None if payload is None else json.dumps(payload).encode()
        req = urllib.request.Request(
            a.url.rstrip("/") + path,
            data=data,
            headers={"Content-Type": "application/json"},
            method="GET" if payload is None else "POST",
        )
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read().decode())

    buf = io.BytesIO()
    Image.fromarray((np.random.default_rng(3).random((128, 128, 3)) * 255).astype(np.uint8)).save(buf, "PNG")
    init = base64.b64encode(buf.getvalue()).decode()
    stop = threading.Event()
    polls = {"n": 0, "errors": 0}

    def poll() -> None:
        while not stop.is_set():
            try:
                call("/vram-guard/v1/status", timeout=30)
                polls["n"] += 1
            except OSError:
                polls["errors"] += 1
            time.sleep(0.2)

    def request(n: int) -> tuple[str, dict, str]:
        kind = KINDS[n % len(KINDS)]
        prompt = f"a red apple, job {n}"
        if a.lora and (n // len(KINDS)) % 2:
            prompt += f" <lora:{a.lora}:1>"
        base = {
            "prompt": prompt,
            "steps": 2,
            "width": 128,
            "height": 128,
            "seed": 1234,
            "sampler_name": "Euler a",
        }
        if kind == "img2img":
            return kind, dict(base, init_images=[init], denoising_strength=0.6), "/sdapi/v1/img2img"
        if kind == "hires":
            return (
                kind,
                dict(
                    base,
                    enable_hr=True,
                    hr_scale=1.5,
                    hr_upscaler="Latent",
                    hr_second_pass_steps=1,
                    denoising_strength=0.5,
                ),
                "/sdapi/v1/txt2img",
            )
        if kind == "extras":
            return (
                kind,
                {"image": init, "upscaling_resize": 2, "upscaler_1": "Lanczos"},
                "/sdapi/v1/extra-single-image",
            )
        return kind, base, "/sdapi/v1/txt2img"

    records: list[dict] = []
    lock = threading.Lock()
    todo = list(range(a.jobs))

    def client() -> None:
        while True:
            with lock:
                if not todo:
                    return
                n = todo.pop(0)
            kind, payload, path = request(n)
            t0 = time.perf_counter()
            try:
                call(path, payload)
                ok, error = True, None
            except OSError as exc:
                ok, error = False, str(exc)[:200]
            st = call("/vram-guard/v1/status", timeout=60)
            rec = {
                "job": n + 1,
                "kind": kind,
                "lora": "<lora:" in str(payload.get("prompt")),
                "ok": ok,
                "error": error,
                "rss_bytes": (st.get("memory") or {}).get("process_rss_bytes"),
                "card_bytes_at_rest": (st.get("card") or {}).get("used_bytes"),
                "card_baseline_bytes": (st.get("card") or {}).get("resident_bytes"),
                "seconds": round(time.perf_counter() - t0, 2),
            }
            with lock:
                records.append(rec)
                emit(rec)

    poller = threading.Thread(target=poll, daemon=True) if a.poll else None
    if poller is not None:
        poller.start()
    threads = [threading.Thread(target=client) for _ in range(a.clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stop.set()
    if poller is not None:
        poller.join(timeout=5)
        emit({"polls": polls["n"], "poll_errors": polls["errors"]})
    return sorted(records, key=lambda r: r["job"])


def summary(records: list[dict]) -> dict:
    """Every job ok, RSS growth from job 10 to the last, the card at rest, time per job."""
    rss = [r["rss_bytes"] for r in records if r.get("rss_bytes")]
    growth = (rss[-1] / rss[9] - 1) if len(rss) >= 10 else None
    at_rest = [r for r in records if r.get("card_bytes_at_rest") is not None]
    tenth = max(1, len(records) // 10)
    secs = [r["seconds"] for r in records]
    return {
        "jobs": len(records),
        "ok": sum(bool(r["ok"]) for r in records),
        "rss_growth_after_job_10": None if growth is None else round(growth, 4),
        "card_at_baseline": all(r["card_bytes_at_rest"] <= r["card_baseline_bytes"] for r in at_rest),
        "first_tenth_median_s": statistics.median(secs[:tenth]) if secs else None,
        "last_tenth_median_s": statistics.median(secs[-tenth:]) if secs else None,
    }


def run(args: argparse.Namespace) -> int:
    if bool(args.quick) == bool(args.url):
        raise SystemExit(
            "bench soak: give --quick (library level) or --url URL (a running WebUI), one of them"
        )

    def emit(rec: dict) -> None:
        if args.json:
            print(json.dumps(rec), flush=True)

    records = _webui_jobs(args, emit) if args.url else _library_jobs(args.jobs, emit)
    s = summary(records)
    good = (
        s["ok"] == s["jobs"] and s["card_at_baseline"] and (s["rss_growth_after_job_10"] or 0) <= RSS_GROWTH
    )
    s["passed"] = good
    if args.json:
        print(json.dumps({"summary": s}))
    else:
        head = f"{'job':>4} {'kind':8} {'lora':5} {'ok':3} {'seconds':>8} {'RSS MiB':>8}"
        print(f"{head} {'card at rest MiB':>16}")
        for r in records:
            rest = r["card_bytes_at_rest"]
            print(
                f"{r['job']:>4} {r['kind']:8} {str(r['lora']):5} {'yes' if r['ok'] else 'NO':3} "
                f"{r['seconds']:>8} "
                f"{(r['rss_bytes'] or 0) / 2**20:>8.0f} {'' if rest is None else f'{rest / 2**20:.1f}':>16}"
                + (f"  {r['error']}" if r["error"] else "")
            )
        print(json.dumps(s))
    return 0 if good else 1
