"""The extension's process-wide state and the per-script job driver.

:class:`Session` — one per loaded ``scripts/vram_guard.py`` (created there, passed to everything):
open jobs (closed all at once on unload), the last job's summary for the readout and the status
route, the upscaler model cache, and session-level notes (e.g. "the WebUI switched its VAE to FP32").

:class:`ScriptJobs` — owned by one ``Script`` instance (one per tab): turns the WebUI's hook calls
(``setup``, ``process``, ``before_hr``, ``post_sample``, ``postprocess_batch``, ``postprocess``) into
:class:`~lib_vram.webui.job.Job` operations. Every method is safe to call in any order and any
number of times.
"""

from __future__ import annotations

import logging
import threading
import weakref
from typing import Any

import torch

from lib_vram.core.device import capabilities, memory_info, release
from lib_vram.core.readout import render_readout_body, render_readout_html, status_payload

from . import host as default_host
from .host import ask
from .job import Job
from .options import INFOTEXT_PLAN_KEY, to_infotext
from .patching import foreign_vae_wrapper, patch_attr
from .profiling import ProfileSwitch
from .settings import resolve

logger = logging.getLogger(__name__)

TILED_VAE_NOTE = (
    "VRAM Guard: the Tiled VAE (multidiffusion-upscaler) extension is installed ({where}). Both tile "
    "the VAE: turn one of them off in a job (its 'Tiled VAE' accordion, or VRAM Guard's 'Tiled VAE')."
)
REVERT_NOTE = (
    "The WebUI switched its VAE from {old} to {new} after a NaN (its automatic VAE precision "
    "fallback); that stays for the rest of this session and needs about twice the VAE memory. "
    "VRAM Guard keeps {old} for its jobs when 'VAE precision' is FP16/BF16 (each tile that "
    "overflows is recomputed wider); restart the WebUI to reset it."
)


OPTIONS_ERROR_KEY = "VRAM Guard error"
"""Infotext / ``extra_generation_params`` key naming bad VRAM Guard arguments of a job."""


class Session:
    """Process-wide state of the loaded extension (see the module docstring)."""

    def __init__(self, host: Any = None) -> None:
        self.host = host if host is not None else default_host
        self._jobs: weakref.WeakSet[Job] = weakref.WeakSet()
        self._lock = threading.RLock()
        self.last: dict | None = None
        self.notes: list[str] = []
        self._cache: Any = None
        self._dtype_seen: torch.dtype | None = None
        self._api_defaults: list[tuple[list, int, list]] = []
        self.emulation: Any = None
        """The :class:`~lib_vram.webui.emulation.WebUICard` of ``--vram-guard-emulate-vram``, or None."""
        self.profile_switch = ProfileSwitch()
        """'Profile the next job' (:mod:`.profiling`)."""
        self.placement: Any = None
        """The :class:`~lib_vram.webui.placement.Placement` (checkpoint placement), or None."""
        self._cards: Any = None
        self._pre: Any = None
        """ControlNet's preprocessor models in the owner (:meth:`preprocessors`) and its patches."""

    # -- jobs --------------------------------------------------------------------------------
    def remember_api_defaults(self, values: list, start: int, saved: list) -> None:
        """Keep what :func:`~lib_vram.webui.integration.api_defaults_follow_settings` replaced."""
        self._api_defaults.append((values, start, list(saved)))

    def restore_api_defaults(self) -> None:
        """Put back the WebUI API's captured defaults (script unload / Reload UI)."""
        while self._api_defaults:
            values, start, saved = self._api_defaults.pop()
            if all(v is None for v in values[start : start + len(saved)]):
                values[start : start + len(saved)] = saved

    def job_opened(self, job: Job) -> None:
        with self._lock:
            self._jobs.add(job)

    def job_closed(self, job: Job) -> None:
        with self._lock:
            self._jobs.discard(job)
            self.last = job.summary()
        self.profile_switch.finished(job)
        self.check_dtype_vae(job)

    def open_jobs(self) -> list[Job]:
        with self._lock:
            return list(self._jobs)

    def close_all(self, *, failed: bool = False) -> int:
        """Close every open job (``on_script_unloaded``); returns how many were open."""
        jobs = self.open_jobs()
        for job in jobs:
            job.close(failed=failed)
        from .stream import restore_pending

        restore_pending()  # a streamed UNet still waiting for room to move back
        return len(jobs)

    def model_changed(self, sd_model: Any) -> None:
        """``on_model_loaded``: hook the new model's VAE for the jobs that are running now
        (a hires checkpoint is loaded between the first pass and the hires re-encode), and give
        it the FP16 UNet of the jobs that use it (the WebUI reset its precision state); on an
        emulated card, its weights are what is resident now."""
        if self.emulation is not None:
            # (a checkpoint placed as it loaded: counting all of it for a moment would be a peak no
            # GPU sees; the placement's count stands)
            placed = self.placement is not None and self.placement.placed_for(sd_model) is not None
            self.emulation.model_changed(sd_model, resident=not placed)
        if self.placement is not None:
            self.placement.model_loaded(sd_model)  # after the card's count: the placement's wins
        if self.placement is None or self.placement.placed_for(sd_model) is None:
            self.card_models().report(sd_model)  # (a placed one was reported with its homes)
        for job in self.open_jobs():
            if job.current():
                job.hook_vae(self.host.vae_of(sd_model))
                if job.unet is not None:
                    job.unet.ensure(sd_model)

    def sampling_step(self, params: Any = None) -> None:
        """``on_cfg_denoiser`` (every sampling step, after the Refiner may have switched models and
        before the UNet runs): keep the FP16 UNet on whatever model is current now (a cached model
        can be switched in without ``on_model_loaded``). Cheap when nothing changed. Also one
        sample of the job's memory timeline per step, and a pass another extension runs inside the
        job without VRAM Guard's script (ADetailer's) planned at its first step
        (:meth:`~lib_vram.webui.sampling.SamplingGuard.step`; ``params``: ``CFGDenoiserParams``)."""
        for job in self.open_jobs():
            if not job.current():
                continue
            if job.unet is not None:
                job.unet.ensure(self.host.sd_model())
            if params is not None and job.kind != "extras":
                job.sampling_guard().step(params)
            job.tracker.sample("step")

    def note(self, text: str) -> None:
        with self._lock:
            if text not in self.notes:
                self.notes.append(text)
                logger.warning("%s", text)

    def emulated_card(self) -> Any:
        """The :class:`~lib_vram.core.emulate.EmulatedCard` every job runs on, or None."""
        return None if self.emulation is None else self.emulation.card

    def card_models(self) -> Any:
        """The one owner of the card and the checkpoint's models in it (:mod:`.models`)."""
        if self._cards is None:
            from .models import CardModels

            self._cards = CardModels(self.host, self.emulated_card)
        return self._cards

    def preprocessors(self) -> Any:
        """ControlNet's preprocessor models in the owner (:mod:`lib_vram.residency.preprocessors`),
        its calls wrapped once ControlNet is loaded (every job, the accordion on or off: the
        emulated card counts them either way); None without ControlNet."""
        if self._pre is None:
            found = ask(self.host, "controlnet_preprocessors", None)
            if found is None:
                return None
            from contextlib import ExitStack

            from lib_vram.residency.preprocessors import Preprocessors

            pre = Preprocessors(self.card_models(), found[1], self._owns_now, self._stopped_in_job)
            self._pre = (pre, ExitStack())
            pre.install(found[0], self._pre[1])
        return self._pre[0]

    def stop_preprocessors(self) -> None:
        """Script unload: the preprocessor models leave the owner, ControlNet's calls unwrapped."""
        pre, self._pre = self._pre, None
        if pre is not None:
            pre[1].close()

    def _owns_now(self) -> bool:
        """Whether this thread runs a VRAM Guard job whose owner may move models."""
        return any(j.current() and j.may_make_room("preprocessor") for j in self.open_jobs())

    def _stopped_in_job(self, line: str) -> None:
        for job in self.open_jobs():
            if job.current() and job.may_make_room("preprocessor"):
                job.stop_line = line  # (its sampling pass raises it at the first step)
                job.note(line, logging.WARNING, log=False)

    # -- the checkpoint placement (issue 22 item 2) ------------------------------------------
    def start_placement(self) -> Any:
        """Create (once) and refresh the checkpoint placement (:mod:`.placement`): patches on while
        the option is on, a loaded checkpoint that does not fit placed; returns it."""
        from .placement import Placement

        if self.placement is None:
            self.placement = Placement(self.host, emulated=self.emulated_card, cards=self.card_models())
        self.placement.refresh()
        return self.placement

    def refresh_placement(self) -> None:
        """A job starts or the WebUI loads (``on_list_unets``, ``on_app_started``): the placement
        follows its option, which may have been turned on or off since (Settings)."""
        if self.placement is not None:
            self.placement.refresh()
        else:
            from .placement import option_on

            if option_on(self.host):
                self.start_placement()

    def stop_placement(self) -> None:
        """Script unload: every weight back where the WebUI would have it, the patches gone."""
        placement, self.placement = self.placement, None
        if placement is not None:
            placement.close()

    def stop_emulation(self) -> None:
        """Undo ``--vram-guard-emulate-vram`` (script unload): patches, installed card."""
        emulation, self.emulation = self.emulation, None
        if emulation is not None:
            emulation.close()

    # -- precision watch ---------------------------------------------------------------------
    def check_dtype_vae(self, job: Job | None = None) -> None:
        """Tell the user (log + readout + ``p.comment``) when the WebUI widened its VAE dtype."""
        now = ask(self.host, "dtype_vae", None)
        if now is None:
            return
        before = self._dtype_seen
        self._dtype_seen = now
        if before is None or now == before or _WIDTH.get(now, 0) <= _WIDTH.get(before, 0):
            return
        text = REVERT_NOTE.format(old=_dtype_name(before), new=_dtype_name(now))
        self.note(text)
        if job is not None and job.p is not None:
            self.host.add_comment(job.p, text)

    # -- upscaler model cache ----------------------------------------------------------------
    def model_cache(self) -> Any:
        if self._cache is None:
            from lib_vram.upscale import default_cache

            self._cache = default_cache()
        return self._cache

    # -- readout -----------------------------------------------------------------------------
    def status(self) -> dict:
        """The readout payload (``GET /vram-guard/v1/status``)."""
        dev = self._device()
        jobs = self.open_jobs()
        running = any(j.current() for j in jobs)
        last = jobs[-1].summary() if jobs else self.last
        records = last["records"] if last else []
        notes = list(self.notes)
        if last:
            notes += [n for n in last["notes"] if n not in notes]
            notes += [
                f"{rel['freed_device_bytes'] / 2**20:.0f} MiB of cached memory released "
                f"{_BOUNDARY_WORDS.get(rel['at'], 'at ' + rel['at'].replace('_', ' '))}"
                for rel in last.get("releases", [])
                if rel["freed_device_bytes"] >= 2**20
            ]
        placed = self.placement.status_line() if self.placement is not None else None
        if (placed or "").startswith("checkpoint placed") and not any(placed in n for n in notes):
            notes.append(placed)  # once: a job that ran placed has it as "VRAM Guard: <placed>" already
        name = None
        try:
            name = capabilities(dev).name
        except (RuntimeError, AssertionError) as exc:
            logger.debug("device name unavailable: %s", exc)
        info = memory_info(dev)
        timeline = last.get("timeline") if last else None
        payload = status_payload(
            info, records, job_running=running, notes=notes, device_name=name, timeline=timeline
        )
        if placed is not None:
            payload["placement"] = placed
        if self._cards is not None and self._cards.owner.models:
            payload["models"] = self._cards.owner.snapshot()  # where each model is now
            payload["host_bytes"] = self._cards.owner.host_bytes  # their weights in host memory
            payload["moves"] = [m.text for m in self._cards.owner.moves][-8:]
        card = self.emulated_card()
        if card is not None:
            # ``--vram-guard-emulate-vram``: capacity, resident (the checkpoint), use, the last job's
            # peak (reset when each job starts), refused allocations
            payload["card"] = card.describe()
        payload["profile"] = self.profile_switch.payload()  # 'Profile the next job'
        payload["html"] = render_readout_body(payload)
        return payload

    # -- 'Profile the next job' --------------------------------------------------------------

    def toggle_profile(self) -> bool:
        """The accordion's 'Profile the next job': arm (or cancel) profiling of the next job."""
        armed = self.profile_switch.toggle()
        logger.info("VRAM Guard: profiling of the next job %s", "armed" if armed else "cancelled")
        return armed

    def toggle_profile_html(self) -> str:
        self.toggle_profile()
        return render_readout_html(self.status())

    def free(self) -> dict:
        """ "Free memory now": gc + cache release; returns the new status with what was freed."""
        res = release(self._device())
        status = self.status()
        status["freed_device_bytes"] = res.freed_device_bytes
        status["collected_objects"] = res.collected_objects
        return status

    def free_html(self) -> str:
        return render_readout_html(self.free())

    def _device(self) -> torch.device:
        return ask(self.host, "device", torch.device("cpu"))


_WIDTH = {torch.float16: 1, torch.bfloat16: 2, torch.float32: 3}
"""Numeric range of the VAE dtypes, narrowest first (a switch to a wider one is the NaN fallback)."""


def _dtype_name(dtype: torch.dtype | None) -> str:
    return {torch.float16: "FP16", torch.bfloat16: "BF16", torch.float32: "FP32"}.get(dtype, str(dtype))


_BOUNDARY_WORDS = {
    "process": "as the job began",
    "post_sample": "after sampling",
    "postprocess_batch": "after the batch",
    "postprocess": "after the job",
}
"""Where a release between stages happened, in a note's words."""


class ScriptJobs:
    """Drives the jobs of one ``Script`` instance (see the module docstring)."""

    def __init__(self, session: Session, *, kind: str) -> None:
        self.session = session
        self.kind = kind
        self.job: Job | None = None
        self._reported: Any = None
        """The ``p`` whose bad options were last reported (once per job, not per hook)."""

    @property
    def host(self) -> Any:
        return self.session.host

    def options_error(self, p: Any, exc: Exception) -> None:
        """Bad VRAM Guard arguments (an API request's ``alwayson_scripts``): the job runs without
        VRAM Guard, and says so once, where an API client sees it (``info.extra_generation_params``
        and the infotext, key ``VRAM Guard error``), under the result in the UI, and in the log.

        The WebUI gives scripts no way to fail the request: it catches every exception raised in
        ``setup``/``process`` and only prints it."""
        self.close()
        if self._reported is p:
            return
        self._reported = p
        text = f"VRAM Guard is off for this job: bad option ({exc})"
        logger.error("%s", text)
        params = getattr(p, "extra_generation_params", None)
        if isinstance(params, dict):
            params[OPTIONS_ERROR_KEY] = str(exc)
        self.host.add_comment(p, text)

    # -- opening / closing -------------------------------------------------------------------
    def close(self, *, failed: bool = False) -> None:
        job, self.job = self.job, None
        if job is not None:
            job.close(failed=failed)

    def _open(self, p: Any, options: Any) -> Job | None:
        """Open a job for ``p`` unless the current one belongs to the same WebUI job."""
        job = self.job
        token = self.host.job_token()
        if job is not None and not job.closed and job.token == token and job.options == options:
            return job
        if job is not None:
            # A job that was not closed by postprocess: the last run raised (OOM...).
            self.close(failed=not job.postprocessed)
        if self.host.cmd_opt("vram_guard_disable", False):
            return None
        self.session.refresh_placement()
        dev = self.host.device()
        info = memory_info(dev)
        override = self.host.cmd_opt("vram_guard_preset")
        settings = resolve(options, total_bytes=info.total, caps=capabilities(dev), preset_override=override)
        job = Job(
            settings,
            kind=self.kind,
            token=token,
            p=p,
            options=options,
            device=dev,
            session=self.session,
            host=self.host,
            total_bytes=info.total,
        )
        self.job = job
        self.session.job_opened(job)
        self.session.profile_switch.attach(job, self.host)
        if getattr(options, "unet_fp16", False) and self.kind != "extras":
            from .unet import UNetFP16

            job.unet = UNetFP16(job, self.host, dev)
            job.stack.callback(job.unet.close)
        self.session.check_dtype_vae(job)
        if p is not None:
            self._safety_net(p, job)
        if settings.upscale_tiling:
            from .upscalers import patch_upscalers

            patch_upscalers(
                job,
                self.host.upscaler_instances(),
                device=self.host.esrgan_device(),
                cache=self.session.model_cache,
            )
        logger.info("VRAM Guard job (%s): %s", self.kind, settings.describe())
        return job

    def _safety_net(self, p: Any, job: Job) -> None:
        """Close ``job`` in the host's own ``finally``: every txt2img/img2img job (UI and API) runs
        inside ``with closing(p)``; ``p`` is thrown away after the job, so wrapping its ``close``
        leaves nothing behind."""
        if not callable(getattr(p, "close", None)):
            return

        def close(original: Any, *args: Any, **kwargs: Any) -> Any:
            try:
                return original(*args, **kwargs)
            finally:
                if not job.closed:
                    job.close(failed=not job.postprocessed)
                if self.job is job:
                    self.job = None

        try:
            patch_attr(p, "close", close, job.stack)
        except (AttributeError, TypeError) as exc:
            logger.debug("no p.close safety net: %s", exc)

    # -- the WebUI's hooks -------------------------------------------------------------------
    def setup(self, p: Any, options: Any) -> None:
        """``Script.setup``: early, so the SD upscale script's upscale (before any
        ``process_images``) already goes through us (and ControlNet's preprocessors)."""
        self.session.preprocessors()
        if not options.enabled:
            self.close()
            return
        self._open(p, options)

    def process(self, p: Any, options: Any) -> Job | None:
        if not options.enabled:
            self.close()  # stale patches of a crashed run; nothing else happens when disabled
            return None
        job = self._open(p, options)
        if job is None:
            return None
        if job.p is not p:
            if job.postprocessing:  # another extension's call inside the job (ADetailer's passes)
                return job
            job.adopt(p)  # a script's own run of the job (X/Y/Z plot: a copy of p per cell)
        job.boundary("process")
        self.refresh(p)
        self._ensure_unet(job)
        entries = to_infotext(options)
        p.extra_generation_params.update(entries)
        if entries:
            p.extra_generation_params[INFOTEXT_PLAN_KEY] = job.plan_text
        return job

    def refresh(self, p: Any = None) -> None:
        """Hook the VAE of the model the WebUI uses *now* (it can change mid-job)."""
        job = self.job
        if job is None or job.closed:
            return
        handle = self.host.vae_of(self.host.sd_model())
        if handle is not None and handle.kind == "forge" and job.forge_load_vae is None:
            job.forge_load_vae = self.host.forge_load_vae
        if handle is not None and (other := foreign_vae_wrapper(handle.decoder)):
            job.warn_once(
                "foreign-vae",
                f"VRAM Guard: another extension wraps the VAE decoder ({other}); whichever wraps it "
                "last decides how it runs (Tiled VAE? use one of the two)",
            )
        if not job.hook_vae(handle):
            job.warn_once("no-vae", "VRAM Guard: no VAE found on the current model; the VAE is not tiled")

    def _ensure_unet(self, job: Job) -> None:
        """'FP16 UNet': cast the model the WebUI uses *now* (idempotent; see :mod:`.unet`)."""
        if job.unet is not None and not job.closed:
            job.unet.ensure(self.host.sd_model())

    def before_sampling(self, p: Any, *, x: Any = None, c: Any = None, uc: Any = None) -> None:
        """``process_before_every_sampling`` (first pass, hires pass, img2img): the pass's stage
        opens, and the sampling guard plans it (:mod:`.sampling`); ``x``, ``c``, ``uc``: the
        latent the pass starts from and its conditioning, as the host passes them. A pass of
        another ``p`` while the job post-processes its images is another extension's pass inside
        the job (ADetailer's, with VRAM Guard on its script list): planned as ``ext_sampling``."""
        job = self.job
        if job is not None and not job.closed:
            self.refresh(p)
            self._ensure_unet(job)
            if job.postprocessing and p is not job.p:
                stage = "ext_sampling"
            else:
                job.postprocessing = False
                job.sampled = False
                stage = "hires_sampling" if getattr(p, "is_hr_pass", False) else "sampling"
            if (cards := job.cards()) is not None:
                cards.owner.settle()  # the conditioning's wakes go home before the pass's stage opens
            job.begin_span(stage)
            job.sampling_guard().before(p, stage, x=x, c=c, uc=uc)

    def before_hr(self, p: Any) -> None:
        job = self.job
        if job is not None and not job.closed:
            job.boundary("before_hr")
            self.refresh(p)
            self._ensure_unet(job)

    def post_sample(self, p: Any) -> None:
        job = self.job
        if job is not None and not job.closed:
            job.boundary("post_sample")
            job.sampled = True
            self.refresh(p)

    def postprocess_batch(self, p: Any) -> None:
        job = self.job
        if job is not None and not job.closed:
            job.boundary("postprocess_batch")
            if not (job.postprocessing and p is not job.p):  # (an extension's pass: its own batch)
                job.postprocessing = True
                job.begin_span("postprocess")

    def postprocess(self, p: Any) -> None:
        """``postprocess``: the job ends, unless this is another extension calling every script's
        ``postprocess`` for a ``p`` of its own while the job still post-processes its images:
        ADetailer does so (with a copy of ``p`` and no images) before its inpaint passes, and its
        passes' own ``p`` ends the same way when VRAM Guard is on its script list. The job stays
        open: those passes are passes of this job (the ``p.close`` safety net still ends it)."""
        job = self.job
        if job is None:
            return
        if job.postprocessing and p is not job.p and not job.closed and job.current():
            logger.debug(
                "VRAM Guard: postprocess of another p inside the job (an extension's): job kept open"
            )
            return
        job.postprocessed = True
        self.close()

    # -- Extras ------------------------------------------------------------------------------
    def extras(self, pp: Any, options: Any) -> Job | None:
        """Extras (``ScriptPostprocessing.process_firstpass``): open a job that routes the built-in
        Upscale operation's upscaler through the tiled engine. Closed when ``pp`` is dropped (the
        end of this image's run), at the next Extras run, or by the job token check."""
        if not options.enabled:
            self.close()
            self._extras_route(None)
            return None
        previous = self.job
        job = self._open(None, options)
        if job is None:
            self._extras_route(None)
            return None
        if job is not previous:
            # the job start's release, as at txt2img/img2img's process(): a failed job before this
            # one can leave its tensors on the device, held by the traceback's frames in a
            # reference cycle (the web server's exception handling); the WebUI's torch_gc does not
            # collect them
            job.boundary("process")
        s = job.settings
        self._extras_route(
            (s.upscale_tile, s.upscale_batch, s.upscale_precision) if s.upscale_tiling else None
        )
        weakref.finalize(pp, _close_if_open, weakref.ref(job))
        info = getattr(pp, "info", None)
        if isinstance(info, dict):
            info.update(to_infotext(options))
            job.info = info
        return job

    def _extras_route(self, route: tuple | None) -> None:
        """The WebUI caches Extras upscales by image and upscaler only: when the route changes
        (VRAM Guard's tiling on/off, its tile/batch/precision), empty that cache, so the picture is
        computed by the route in force and not handed back from the other one."""
        if route != getattr(self.session, "extras_route", "unset"):
            ask(self.host, "clear_upscale_cache", None)
            self.session.extras_route = route


def _close_if_open(job_ref: weakref.ref) -> None:
    job = job_ref()
    if job is not None and not job.closed:
        job.postprocessed = True
        job.close()
