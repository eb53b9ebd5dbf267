"""``python -m lib_vram bench soak``: many mixed jobs in one process; nothing may grow or stay behind.

``--quick``: the library level (:class:`_Library`, what CI runs); ``--url URL``: a running WebUI's
API (:class:`_WebUI`). Pass/fail: :func:`summary`. Method: docs/benchmarks.md, "Soak".
"""

from __future__ import annotations

import argparse
import base64
import gc
import io
import json
import os
import statistics
import tempfile
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import psutil
import torch

from lib_vram import sampling
from lib_vram.cli.common import MAX_COUNT, bounded_int
from lib_vram.cli.hostmodels import SD_VAE, build_ldm
from lib_vram.core import emulate
from lib_vram.planning import planner

from ..models.archs import save
from ..models.synthetic import image_like, rrdb_net
from ..models.unet import build_unet
from ._harness import Bench, mib_of, ok, runner

HELP = "Soak: many mixed jobs in one process (RSS, the card at rest, time per job); --quick without a WebUI."
KINDS = ("txt2img", "img2img", "hires", "extras")
VAE_EXACT = 1e-4
"""The exact tiled VAE's promise against another tile plan (tests/tolerances.py)."""
RSS_GROWTH = 0.05
"""RSS after the last job may exceed RSS after job 10 by this share at most."""
FIELDS = ("job", "kind", "lora", "ok", "error", "rss_bytes", "card_bytes_at_rest", "card_baseline_bytes",
          "seconds")  # fmt: skip


def configure(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--quick", action="store_true", help="library level, no WebUI (a few minutes)")
    add("--url", help="a running WebUI (started with --api) to drive instead")
    add("--jobs", type=bounded_int("--jobs", 10, MAX_COUNT * 10), default=100, help="jobs (default 100)")
    add("--lora", help="--url: a LoRA for every other round, NAME or NAME:WEIGHT (default weight 1)")
    add("--poll", action="store_true", help="--url: read the status route every 200 ms")
    add("--clients", type=bounded_int("--clients", 1, 8), default=1, help="--url: clients at once")


def _kind(n: int) -> tuple[str, bool]:
    """Job ``n``'s kind, and whether it runs with the LoRA (every other round; Extras never)."""
    kind = KINDS[n % len(KINDS)]
    return kind, (n // len(KINDS)) % 2 == 1 and kind != "extras"


# -- library level -----------------------------------------------------------------------------


class _Library:
    """The placed models the jobs run on (entered: placed; left: the UNet back in host memory)."""

    def __enter__(self) -> _Library:
        from lib_vram.residency import HOST, STREAMED, Model, Owner, plan_checkpoint
        from lib_vram.residency._modules import ModuleMover, nbytes_of, tensors_of

        self.unet = build_unet("sd15", 32, context_dim=64, seed=4, init=True)
        cfg = {**SD_VAE, "ch": 32, "ch_mult": (1, 2), "num_res_blocks": 1, "resolution": 64}
        self.decoder, self.encoder = build_ldm("decoder", cfg, seed=5), build_ldm("encoder", cfg, seed=None)
        vae = torch.nn.ModuleDict({"decoder": self.decoder, "encoder": self.encoder})
        self.te = torch.nn.Embedding(1000, 64)
        parts = {"UNet": self.unet, "text encoders": self.te, "VAE": vae}
        nbytes = {name: nbytes_of(tensors_of([m])) for name, m in parts.items()}
        unet_b, parked = nbytes["UNet"], [(n, nbytes[n]) for n in ("text encoders", "VAE")]
        spec = sampling.unet_spec(self.unet)
        for card in range(unet_b // 4, 4 * unet_b, max(1, unet_b // 64)):  # the smallest card keeping 2/3
            cp = plan_checkpoint(self.unet, spec, card_bytes=card, safety_bytes=1 << 20, leftover_bytes=0,
                                 parked=parked, batch=2, latent_hw=(8, 8), context_tokens=77,
                                 attention="none", dtype=torch.float32, backend="cpu")  # fmt: skip
            if cp.fits and cp.unet_resident_bytes >= 2 * unet_b // 3:
                break
        # and room for the VAE's and the upscaler's working memory beside the resident UNet (the
        # placement leaves room for the VAE's weights; its tiles are what is free then)
        self.card = emulate.EmulatedCard(card + 6 * (1 << 20))
        self.streamer = sampling.StreamedUNet(self.unet, cp.stream, "cpu", card=self.card).__enter__()
        self.card.set_resident(cp.unet_resident_bytes)
        self.owner = Owner(lambda: self.card.free_bytes)
        self.models = {}
        for name, module in parts.items():
            mover, home = ModuleMover(module, "cpu", self.card), STREAMED if name == "UNet" else HOST
            m = Model(name, name, nbytes[name], mover, home=home, where=home, movable=home == HOST)
            self.models[name] = self.owner.join(m)
            if home == HOST:  # (the UNet's streamer moves it)
                mover.on_use = lambda m=m: self.owner.use(m, why="needed")
                mover.hook()
        self.models["UNet"].resident_bytes = cp.unet_resident_bytes
        self.baseline = self.card.used_bytes
        torch.manual_seed(0)
        self.tmp = tempfile.TemporaryDirectory()
        self.path = os.path.join(self.tmp.name, "rrdb.safetensors")
        save(rrdb_net(8, 1), self.path)
        self.lora = [m for n, m in self.unet.named_modules() if n.endswith(("attn2.to_k", "attn2.to_v"))][:2]
        g = torch.Generator().manual_seed(1)
        self.deltas = [torch.randn(m.weight.shape[0], 4, generator=g) @ torch.randn(4, m.weight.shape[1],
                       generator=g) * 0.01 for m in self.lora]  # fmt: skip
        self.img = image_like(32, 32, 3, seed=2) * 2 - 1
        self.first: dict = {}
        self.mem = planner.PlanMemory()  # what the engines learn, kept for the session as in the WebUI
        self.ctx = torch.randn(1, 77, 64, generator=torch.Generator().manual_seed(6))
        return self

    def __exit__(self, *exc: object) -> None:
        self.streamer.release_to_host()  # (the card cannot hold the whole UNet: all of it to host memory)
        self.tmp.cleanup()

    def _sample(self, x, context):  # noqa: ANN001, ANN202
        self.owner.begin("sampling", busy=[self.models["UNet"]])
        try:
            for t in (700, 300):
                eps = self.unet(torch.cat([x, x]), torch.full((2,), t), context=context.expand(2, -1, -1))
                x = x - 0.1 * eps[:1]
        finally:
            self.streamer.settle()
            self.owner.end("sampling")
        return x

    def _vae(self, kind: str, x):  # noqa: ANN001, ANN202
        from lib_vram.vae import TiledVAEConfig, tiled_decode, tiled_encode

        vae, cfg = self.models["VAE"], TiledVAEConfig(mode="exact", tile=8)
        self.owner.begin(kind, busy=[vae])
        try:
            self.owner.use(vae, kind)
            if kind == "decode":
                return tiled_decode(self.decoder, x, config=cfg, memory=planner.PlanMemory())
            return tiled_encode(self.encoder, x, config=cfg, memory=planner.PlanMemory())[:, :4]
        finally:
            self.owner.end(kind)

    def _run(self, kind: str, n: int) -> tuple:
        """(the last latent, the picture); Extras: (its input, the upscaled picture)."""
        import spandrel

        from lib_vram.upscale import UpscaleConfig, upscale_tensor

        context = self.te(torch.randint(0, 1000, (1, 77), generator=torch.Generator().manual_seed(n)))
        # each job's prompt runs the text encoders; the picture stays comparable
        context = context * 0 + self.ctx
        x = torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(KINDS.index(kind)))
        if kind == "extras":  # the upscaler is built from its file at every call, as the WebUI does
            self.owner.settle()
            upscaler = spandrel.ModelLoader().load_from_file(self.path)
            cfg = UpscaleConfig(tile=16, batch=1)
            return self.img, upscale_tensor(upscaler, self.img.clone(), config=cfg, memory=self.mem)
        if kind == "img2img":
            x = self._vae("encode", self.img)
        x = self._sample(x, context)
        if kind == "hires":
            x = self._sample(torch.nn.functional.interpolate(x, size=(16, 16), mode="nearest"), context)
        return x, self._vae("decode", x)

    def job(self, n: int) -> dict:
        kind, with_lora = _kind(n)
        t0, error, backups = time.perf_counter(), None, []
        try:
            with torch.no_grad(), emulate.running_on(self.card):
                for m, d in zip(self.lora, self.deltas) if with_lora else ():
                    backups.append(m.weight.detach().clone())
                    emulate.to_host(backups[-1])  # the Lora extension keeps it on the CPU
                    m.weight.data += d  # in place, as the Lora extension merges
                out = self._run(kind, n)
                for t in out:
                    emulate.to_host(t)  # (kept for the comparison: not the card's)
                if not with_lora:
                    ref = self.first.setdefault(kind, out)
                    # the sampler's latent bit for bit; the picture within the exact tiled
                    # VAE's promise (another tile plan may round differently)
                    lat, pic = float((out[0] - ref[0]).abs().max()), float((out[1] - ref[1]).abs().max())
                    if lat != 0 or pic > VAE_EXACT:
                        error = f"differs from the first {kind}: latent by {lat:.3g}, picture by {pic:.3g}"
                elif kind in self.first and torch.equal(out[1], self.first[kind][1]):
                    error = "the LoRA changed nothing (a streamed copy kept the unmerged weight?)"
        except Exception as exc:  # noqa: BLE001 (a soak records every failure and goes on)
            error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
        finally:
            for m, b in zip(self.lora, backups):
                m.weight.data.copy_(b)
            self.owner.settle()
        gc.collect()
        rss = int(psutil.Process().memory_info().rss)
        values = (n + 1, kind, with_lora, error is None, error, rss, int(self.card.used_bytes),
                  int(self.baseline), round(time.perf_counter() - t0, 3))  # fmt: skip
        return dict(zip(FIELDS, values))


# -- a running WebUI ---------------------------------------------------------------------------


class _WebUI:
    """The jobs through a running WebUI's API, ``--clients`` at once (a case: one job per client);
    entered: the ``--poll`` poller started; left: stopped, its counts printed (``--json``)."""

    def __init__(self, a: argparse.Namespace) -> None:
        from PIL import Image

        self.a, self.stop, self.polls = a, threading.Event(), {"polls": 0, "poll_errors": 0}
        buf = io.BytesIO()
        pixels = (np.random.default_rng(3).random((128, 128, 3)) * 255).astype(np.uint8)
        Image.fromarray(pixels).save(buf, "PNG")
        self.init = base64.b64encode(buf.getvalue()).decode()
        self.poller = threading.Thread(target=self._poll, daemon=True) if a.poll else None

    def call(self, path: str, payload: dict | None = None, timeout: float = 3600) -> tuple[dict, str | None]:
        """The answer and None, or ``{}`` and why not (failed, or not JSON): the caller goes on."""
        data = None if payload is None else json.dumps(payload).encode()
        headers = {"Content-Type": "application/json"}  # (urllib POSTs what has data, GETs the rest)
        req = urllib.request.Request(self.a.url.rstrip("/") + path, data, headers)
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return json.loads(r.read().decode()), None
        except (OSError, ValueError) as exc:
            return {}, str(exc)[:200]

    def _poll(self) -> None:
        while not self.stop.is_set():
            failed = self.call("/vram-guard/v1/status", timeout=30)[1] is not None
            self.polls["poll_errors" if failed else "polls"] += 1
            time.sleep(0.2)

    def __enter__(self) -> _WebUI:
        if self.poller is not None:
            self.poller.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        if self.poller is not None:
            self.poller.join(timeout=5)
            if self.a.json:
                print(json.dumps(self.polls), flush=True)

    def _job(self, n: int) -> dict:
        kind, with_lora = _kind(n)
        name = self.a.lora or ""
        lora = f" <lora:{name if ':' in name else name + ':1'}>" if name and with_lora else ""
        base = {"prompt": f"a red apple, job {n}{lora}", "steps": 2, "width": 128, "height": 128,
                "seed": 1234, "sampler_name": "Euler a",
                "alwayson_scripts": {"VRAM Guard": {"args": [{"enabled": True}]}}}  # fmt: skip
        payload, path = {
            "txt2img": (base, "/sdapi/v1/txt2img"),
            "img2img": (dict(base, init_images=[self.init], denoising_strength=0.6), "/sdapi/v1/img2img"),
            "hires": (dict(base, enable_hr=True, hr_scale=1.5, hr_upscaler="Latent", hr_second_pass_steps=1,
                           denoising_strength=0.5), "/sdapi/v1/txt2img"),
            "extras": ({"image": self.init, "upscaling_resize": 2, "upscaler_1": "Lanczos"},
                       "/sdapi/v1/extra-single-image"),
        }[kind]  # fmt: skip
        t0 = time.perf_counter()
        error = self.call(path, payload)[1]
        st, failed = self.call("/vram-guard/v1/status", timeout=60)
        if error is None and failed is not None:
            error = f"status route: {failed[:180]}"
        card = st.get("card") or {}
        at_rest = None if st.get("job_running") else card.get("used_bytes")  # (another client's job)
        values = (n + 1, kind, "<lora:" in str(payload.get("prompt")), error is None, error,
                  (st.get("memory") or {}).get("process_rss_bytes"), at_rest,
                  card.get("resident_bytes"), round(time.perf_counter() - t0, 2))  # fmt: skip
        return dict(zip(FIELDS, values))

    def jobs(self, ns: list[int]) -> list[dict]:
        with ThreadPoolExecutor(len(ns)) as pool:  # (a job's unexpected error stops the soak)
            return list(pool.map(self._job, ns))


SETTLE_JOBS = 2 * len(KINDS)
"""``--url``: the most the card held at rest in the first round is the baseline (the WebUI keeps
about 1 MiB of conditioning and sigmas there between jobs); what may not happen is growth after it."""


def summary(records: list[dict], settle: int = 0) -> dict:
    """Every job ok, RSS growth from job 10 to the last, the card at rest (at most the placed
    resident bytes, or the most it held at rest in the first ``settle`` jobs), time per job; passed:
    all of them ok, the card at rest, RSS grown by at most :data:`RSS_GROWTH`."""
    rss = [r["rss_bytes"] for r in records if r.get("rss_bytes")]
    growth = round(rss[-1] / rss[9] - 1, 4) if len(rss) >= 10 else None
    at_rest = [r for r in records if r.get("card_bytes_at_rest") is not None]
    settled = max((r["card_bytes_at_rest"] for r in at_rest if r["job"] <= settle), default=None)
    tenth = max(1, len(records) // 10)
    secs = [r["seconds"] for r in records]
    s = {
        "jobs": len(records),
        "ok": sum(bool(r["ok"]) for r in records),
        "rss_growth_after_job_10": growth,
        "card_at_baseline": all(
            r["card_bytes_at_rest"] <= (r["card_baseline_bytes"] if settled is None else settled)
            for r in at_rest
            if r["job"] > settle
        ),
        "card_settled_bytes": settled,
        "first_tenth_median_s": statistics.median(secs[:tenth]) if secs else None,
        "last_tenth_median_s": statistics.median(secs[-tenth:]) if secs else None,
    }
    return {**s, "passed": s["ok"] == s["jobs"] and s["card_at_baseline"] and (growth or 0) <= RSS_GROWTH}


COLUMNS = ("job", "kind", "lora", ("ok", ok("ok", "yes", "NO")), "seconds",
           ("RSS MiB", mib_of("rss_bytes", 0)), ("card at rest MiB", mib_of("card_bytes_at_rest")),
           "error")  # fmt: skip


def bench(args: argparse.Namespace) -> Bench:
    if bool(args.quick) == bool(args.url):
        raise SystemExit(
            "bench soak: give --quick (library level) or --url URL (a running WebUI), one of them"
        )
    if args.quick:
        lib = _Library()
        return Bench(list(range(args.jobs)), lib.job, COLUMNS, hold=lib, summary=summary,
                     label=lambda n: f"job {n + 1} {_kind(n)[0]}")  # fmt: skip
    webui, k = _WebUI(args), args.clients
    rounds = [list(range(i, min(i + k, args.jobs))) for i in range(0, args.jobs, k)]
    return Bench(rounds, webui.jobs, COLUMNS, hold=webui, summary=lambda r: summary(r, SETTLE_JOBS),
                 label=lambda ns: "jobs " + ", ".join(str(n + 1) for n in ns))  # fmt: skip


run = runner(bench)
