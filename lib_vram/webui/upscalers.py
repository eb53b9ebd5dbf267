"""Route the WebUI's ESRGAN-family upscalers through VRAM Guard's tiled engine and model cache.

Where: the ``do_upscale`` of the ``Upscaler`` *instances* behind ``shared.sd_upscalers`` (an
instance attribute, undone when the job closes). Every path that upscales with a model — hires fix
and img2img resize (``images.resize_image``), the SD upscale script and the Extras tab — ends in
``UpscalerData.scaler.upscale()`` → ``self.do_upscale(img, path)``, so this one place covers them
all. Patching the module-level ``upscale_with_model`` instead would need one patch per importing
module (``esrgan_model``, ``realesrgan_model``, ``dat_model``, ``hat_model`` bind the name at import,
host-api §5.3) and would still let ESRGAN reload its model from disk at every call; at
``do_upscale`` we get the model *path* and load it through our :class:`~lib_vram.upscale.ModelCache`.

Anything we cannot handle (a URL still to download, an architecture our loader rejects) goes to the
WebUI's own ``do_upscale`` unchanged.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

import torch

from lib_vram.core.readout import upscale_pass_note

from .host import ask
from .patching import patch_attr

logger = logging.getLogger(__name__)

PATH_ARG = ("UpscalerESRGAN", "UpscalerHAT", "UpscalerSwinIR", "UpscalerScuNET")
"""Classes whose ``do_upscale`` gets the model file path itself (SwinIR and ScuNET: or the URL of a
built-in model, whose downloaded file is used once it exists)."""
INFO_ARG = ("UpscalerRealESRGAN", "UpscalerDAT")
"""Classes whose ``do_upscale`` gets a path/URL that their ``load_model`` resolves to an
``UpscalerData`` with ``local_data_path`` (downloading it if needed)."""
FAMILY = PATH_ARG + INFO_ARG
"""Every spandrel upscaler of WebUI v1.10.1 (``modules/*_model.py`` and the built-in SwinIR and
ScuNET extensions); LDSR is not a spandrel model and keeps its own path."""
RELOADS_EACH_CALL = ("UpscalerESRGAN", "UpscalerRealESRGAN", "UpscalerHAT", "UpscalerDAT", "UpscalerScuNET")
"""Classes whose own ``do_upscale`` builds the model from its file at every call (WebUI v1.10.1 and
Forge). The build draws from torch's global generator, which the hires re-encode samples from next:
the route hides its own (cached) loads from that generator and replays the host's build instead
(``host.replay_upscaler_load``), so the generator is where the host's own upscale leaves it.
``UpscalerSwinIR`` keeps its last model (``_cached_model``) like our cache: its loads are left as
they are."""


def model_path(scaler: Any, selected: Any) -> str | None:
    """The local model file ``scaler.do_upscale(img, selected)`` would load, or None."""
    cls = type(scaler).__name__
    if not isinstance(selected, str):
        return None
    if cls in PATH_ARG:
        if selected.startswith("http"):
            return _downloaded(scaler, cls)
        return selected if os.path.isfile(selected) else None
    if cls in INFO_ARG:
        info = type(scaler).load_model(scaler, selected)  # the class's own resolver (may download)
        path = getattr(info, "local_data_path", None)
        return path if isinstance(path, str) and os.path.isfile(path) else None
    return None


def _downloaded(scaler: Any, cls: str) -> str | None:
    """Where the WebUI's ``load_model`` stores a built-in SwinIR/ScuNET model it downloads (the
    file name it passes to ``load_file_from_url``), if that file exists."""
    folder = getattr(scaler, "model_download_path", None)
    if cls == "UpscalerSwinIR":
        name = f"{str(getattr(scaler, 'model_name', '')).replace(' ', '_')}.pth"
    elif cls == "UpscalerScuNET":
        name = f"{getattr(scaler, 'name', '')}.pth"
    else:
        return None
    if not isinstance(folder, str):
        return None
    path = os.path.join(folder, name)
    return path if os.path.isfile(path) else None


def _swap_rb(img: Any) -> Any:
    """RGB <-> BGR of a PIL RGB image (the WebUI feeds its spandrel upscalers BGR)."""
    from PIL import Image

    r, g, b = img.split()
    return Image.merge("RGB", (b, g, r))


def patch_upscalers(job: Any, scalers: list[Any], *, device: Any, cache: Callable[[], Any]) -> int:
    """Patch ``do_upscale`` of every ESRGAN-family scaler in ``scalers`` for ``job``; returns how many.

    ``cache()`` returns the model cache (called at the first upscale, so nothing is imported or
    allocated for jobs that never upscale)."""
    ours = [s for s in scalers if type(s).__name__ in FAMILY]
    for scaler in ours:
        patch_attr(scaler, "do_upscale", _make(job, scaler, device=device, cache=cache), job.stack)
    return len(ours)


def _make(job: Any, scaler: Any, *, device: Any, cache: Any) -> Callable[..., Any]:
    def do_upscale(original: Callable[..., Any], img: Any, selected: Any, *args: Any, **kwargs: Any) -> Any:
        if args or kwargs or not job.current() or not job.settings.upscale_tiling:
            return original(img, selected, *args, **kwargs)
        return upscale(job, scaler, original, img, selected, device=device, cache=cache)

    return do_upscale


def upscale(
    job: Any, scaler: Any, original: Callable[..., Any], img: Any, selected: Any, *, device: Any, cache: Any
):
    """One upscale through the tiled engine (falls back to ``original`` where we cannot help)."""
    try:
        from lib_vram import upscale as engine
    except ImportError as exc:
        job.warn_once("no-upscale-engine", f"VRAM Guard: tiled upscale engine unavailable ({exc})")
        return original(img, selected)
    try:
        path = model_path(scaler, selected)
    except (OSError, ValueError) as exc:
        logger.warning(
            "VRAM Guard: cannot resolve upscaler model %r (%s); using the WebUI's upscaler", selected, exc
        )
        path = None
    if path is None:
        return original(img, selected)
    reloads = type(scaler).__name__ in RELOADS_EACH_CALL
    replay = getattr(job.host, "replay_upscaler_load", None) if reloads else None
    try:
        # Our load (a cache miss) must not draw from the global generator where the host's replay
        # below draws: the host's build happens once per upscale, hit or miss.
        with torch.random.fork_rng(devices=[], enabled=callable(replay)):
            model = engine.load_model(path, device=device, cache=cache())
    except engine.UpscaleError as exc:
        job.warn_once(
            f"upscale-load-{path}",
            f"VRAM Guard: cannot load {os.path.basename(path)} for tiled upscaling ({exc}); "
            "the WebUI's upscaler runs it instead",
        )
        return original(img, selected)
    s = job.settings
    config = engine.UpscaleConfig(
        tile=s.upscale_tile, batch=s.upscale_batch, precision=s.upscale_precision, device=device
    )
    report = engine.UpscaleReport()
    # The WebUI's own path (modules/upscaler_utils.py, v1.10.1): the image as RGB, channels flipped
    # to BGR for the model and back after it. Same here, so the picture is the WebUI's.
    bgr = _swap_rb(img.convert("RGB"))
    # Forge's own ESRGAN/RealESRGAN do_upscale first asks its memory manager for its minimum
    # inference memory (offloading models if needed); ours replaces that do_upscale, so it asks too
    # (then tiles to what is free). A1111: nothing to do.
    ask(job.host, "prepare_upscale_memory", None)
    if callable(replay):
        try:
            replay(path)
        except (OSError, RuntimeError, ValueError, KeyError) as exc:  # the picture is unaffected
            job.warn_once(
                f"upscale-replay-{path}",
                f"VRAM Guard: could not rebuild {os.path.basename(path)} as the WebUI does ({exc}); "
                "a hires fix or img2img after this upscale may start from other noise than the WebUI's own",
            )
    stage = job.upscale_stage_name()
    with job.stage(stage):

        def attempt(rep: Any) -> Any:
            return engine.upscale_image(
                model,
                bgr,
                config=config,
                should_interrupt=job.host.interrupted,
                tracker=job.tracker,
                report=rep,
            )

        moved = ""
        try:
            with job.owned_stage(stage):
                failed = out = None
                if job.may_make_room(stage) and not smallest_plan_fits(engine, model, bgr, config):
                    moved = job.make_room(
                        stage, "the upscaler's model and its smallest plan do not fit with them there"
                    )
                try:
                    out = attempt(report)
                except (engine.UpscaleError, torch.OutOfMemoryError) as exc:
                    if moved or not job.may_make_room(stage) or not _out_of_memory(exc):
                        raise
                    failed = exc if not isinstance(exc, torch.OutOfMemoryError) else None
                    logger.info("VRAM Guard: %s: %s", stage.replace("_", " "), exc)
                if out is None:  # out of the except block (its traceback holds the failed upscale)
                    report = engine.UpscaleReport()
                    moved = job.make_room(
                        stage, "it ran out of memory with them there, even with the smallest tile"
                    )
                    if not moved and failed is not None:
                        raise failed
                    out = attempt(report)
        except engine.Interrupted:
            # What the WebUI's own tiled upscale does when interrupted: hand back the input.
            job.tracker.note(plan="interrupted")
            return img
        except engine.UpscaleError as exc:
            # The model fails in the engine for a reason other than memory and the whole image
            # does not fit untiled (the engine runs it untiled where it does): one line, and the
            # WebUI's own upscaler (one tile per call) gets its chance.
            job.tracker.note(plan="failed")
            failed = str(exc)
        else:
            failed = None
        if failed is not None:
            job.warn_once(
                f"upscale-failed-{path}",
                f"VRAM Guard: {os.path.basename(path)}: {failed}; the WebUI's upscaler runs it instead",
            )
            return original(img, selected)
        plan = report.plan
        text = upscale_pass_note(
            job.upscale_stage_name(),
            tiled=bool(report.tiled),
            tiles=report.tiles_total,
            tile=report.tile,
            batch=report.batch,
            budget_bytes=report.budget_bytes,
            ooms=report.ooms,
            exact=report.exact,
        )
        if text:
            job.note(f"VRAM Guard: {text}", logging.WARNING if report.ooms else logging.INFO)
        if report.ooms:
            plan = f"{plan or 'tiled'} after OOM"
        if moved:
            plan = f"{plan or 'tiled'}, {moved} off the card"
        job.tracker.note(plan=plan)
        for note in report.notes:
            job.warn_once(f"upscale-inexact-{path}", f"VRAM Guard: {note}")
    return _swap_rb(out)


def _out_of_memory(exc: BaseException) -> bool:
    """An upscale that ran out of memory where no smaller tile helps (the engine's last word), or
    an out-of-memory error outside its tile loop (placing the model)."""
    from lib_vram.core.device import is_oom_error

    return is_oom_error(exc) or "out of memory" in str(exc).lower()


def smallest_plan_fits(engine: Any, model: Any, img: Any, config: Any) -> bool:
    """Whether the upscaler's weights (where they are not on the device yet in the dtype it runs
    in) plus its smallest plan (the engine's smallest tile, one tile per batch) fit the free memory
    now. A planning error never fails the upscale: it then runs, and an out-of-memory error still
    moves the idle models."""
    from lib_vram.core import emulate
    from lib_vram.core.device import free_bytes, is_oom_error
    from lib_vram.upscale._engine import BUDGET_FRACTION
    from lib_vram.upscale._plan import MIN_TILE

    try:
        spec = engine.as_spec(model)
        dev = torch.device(config.device) if config.device is not None else torch.device("cpu")
        dtype = engine.choose_dtype(config.precision, spec, dev)
        extra = 0
        if spec.module is not None:
            first = next(spec.module.parameters(), None)
            if first is not None and (first.device != dev or first.dtype != dtype):
                extra = emulate.module_bytes([spec.module]) * torch.empty((), dtype=dtype).element_size()
                extra //= max(1, first.element_size())
        free = free_bytes(dev)
        budget = max(1, int((free - extra) * BUDGET_FRACTION))
        w, h = img.size
        plan = engine.plan_upscale(
            model,
            (1, 3, int(h), int(w)),
            dtype,
            budget,
            tile=MIN_TILE,
            batch=1,
            device=dev,
            host_apart=emulate.separate_host(dev),
        )
    except Exception as exc:
        if is_oom_error(exc):
            return False  # planning itself (the calibration's probes) ran out of memory
        if isinstance(exc, (ValueError, RuntimeError)):
            logger.debug("VRAM Guard: no upscale plan for the idle-model check: %s", exc)
            return True
        raise
    fits = extra < free and plan.fits
    logger.debug(
        "VRAM Guard: smallest upscale plan %s: %d bytes + %d bytes of weights, %d free: %s",
        plan.plan,
        plan.peak_bytes,
        extra,
        free,
        "fits" if fits else "does not fit",
    )
    return fits
