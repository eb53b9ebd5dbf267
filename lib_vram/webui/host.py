"""Every read or write of WebUI state, behind one small function each.

This is the only module of VRAM Guard that imports ``modules`` (always lazily, inside a function),
so the rest of :mod:`lib_vram.webui` can be tested against real torch modules and plain objects.
Paths refer to AUTOMATIC1111 v1.10.1 (``host-api.md``); Forge differences are noted where they
matter.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)


def ask(host: Any, name: str, default: Any, *args: Any) -> Any:
    """``host.<name>(*args)`` for this module or a stand-in for it, or ``default`` where the host
    lacks the function or cannot answer."""
    fn = getattr(host, name, None)
    if not callable(fn):
        return default
    try:
        return fn(*args)
    except (ImportError, AttributeError) as exc:
        logger.debug("host.%s unavailable: %s", name, exc)
        return default


# -- options and flags ---------------------------------------------------------------------------
def opts_get(key: str, default: Any) -> Any:
    """``shared.opts.<key>`` or ``default`` (our options exist only after ``on_ui_settings`` ran)."""
    from modules import shared

    return getattr(shared.opts, key, default)


def cmd_opt(name: str, default: Any = None) -> Any:
    """A parsed command-line flag (``shared.cmd_opts.<name>``)."""
    from modules import shared

    return getattr(shared.cmd_opts, name, default)


def script_runners() -> dict[str, Any]:
    """The txt2img and img2img ``ScriptRunner`` (``modules.scripts.scripts_txt2img/img2img``)."""
    from modules import scripts

    return {"txt2img": scripts.scripts_txt2img, "img2img": scripts.scripts_img2img}


def controlnet_preprocessors() -> tuple[Any, Any] | None:
    """sd-webui-controlnet's preprocessor class (its registry; ``cached_call`` runs every
    preprocessor) and ``() -> roots`` of where its annotator models are held (the registry, the
    ``annotator`` modules, its legacy ``processor`` module); None without ControlNet."""
    mods = [m for n, m in list(sys.modules.items()) if n.endswith("supported_preprocessor")]
    cls = next((getattr(m, "Preprocessor", None) for m in mods), None)
    if cls is None or not isinstance(getattr(cls, "all_processors", None), dict):
        return None

    def roots() -> list[Any]:
        names = ("annotator.", "scripts.preprocessor")
        return [cls.all_processors, *(m for n, m in list(sys.modules.items()) if n.startswith(names))]

    return cls, roots


# -- job state -----------------------------------------------------------------------------------
def job_token() -> float | None:
    """Identifies the running WebUI job: ``shared.state.time_start`` is set by every ``state.begin``."""
    from modules import shared

    return getattr(shared.state, "time_start", None)


def interrupted() -> bool:
    from modules import shared

    return bool(getattr(shared.state, "interrupted", False) or getattr(shared.state, "skipped", False))


def job_entry_points() -> dict[str, tuple[Any, str]]:
    """Where every WebUI job starts, ends and draws its live previews, as ``{role: (object, name)}``
    (A1111 v1.10.1; wrapped by :mod:`lib_vram.webui.emulation`): ``begin``/``end``:
    ``shared.state.begin``/``end`` in the job's thread (UI wrapper, API routes, ``end`` in a
    ``finally``, and the Extras runner); ``finish_task`` (``progress.finish_task``, the UI wrapper's
    ``finally``) and ``run_postprocessing`` (the Extras runner) end a job whose ``state.end()`` was
    skipped because it raised; ``preview``: ``shared.state.do_set_current_image``, on the progress
    request's thread. A role whose object the host lacks is left out."""
    from modules import shared

    points: dict[str, tuple[Any, str]] = {}
    state = getattr(shared, "state", None)
    for role, name in (("begin", "begin"), ("end", "end"), ("preview", "do_set_current_image")):
        if callable(getattr(state, name, None)):
            points[role] = (state, name)
    for module, name in (("progress", "finish_task"), ("postprocessing", "run_postprocessing")):
        try:
            mod = importlib.import_module(f"modules.{module}")
        except ImportError:
            continue
        if callable(getattr(mod, name, None)):
            points[name] = (mod, name)
    return points


def loaded_sd_model() -> Any:
    """The checkpoint loaded now, or None, without loading one (``shared.sd_model`` loads the
    default checkpoint when none is loaded yet)."""
    try:
        from modules import sd_models

        return sd_models.model_data.sd_model
    except (ImportError, AttributeError):
        from modules import shared

        return vars(shared).get("sd_model")


PLACEMENT_POINTS = ("model_target_device", "send_model_to_device", "send_model_to_cpu", "send_model_to_trash")


def placement_points() -> dict[str, tuple[Any, str]]:
    """Where the WebUI decides where a checkpoint's weights go (v1.10.1 ``modules/sd_models.py``:
    ``load_model``/``reload_model_weights`` look these functions up in the module's globals): role ->
    (the ``sd_models`` module, function name), for those it has."""
    from modules import sd_models

    return {n: (sd_models, n) for n in PLACEMENT_POINTS if callable(getattr(sd_models, n, None))}


# -- model and VAE -------------------------------------------------------------------------------
def sd_model() -> Any:
    from modules import shared

    return getattr(shared, "sd_model", None)


@dataclass(frozen=True)
class VAEHandle:
    """Where the current model's VAE is and how to hook it."""

    kind: str
    """``"ldm"`` (A1111 ldm/sgm ``first_stage_model``) or ``"forge"`` (``forge_objects.vae``)."""
    first_stage_model: Any
    decoder: torch.nn.Module | None
    encoder: torch.nn.Module | None
    forge_vae: Any = None


def vae_of(model: Any) -> VAEHandle | None:
    """The VAE of ``model`` (A1111: ``first_stage_model``; Forge: ``forge_objects.vae``), or None."""
    if model is None:
        return None
    fsm = getattr(model, "first_stage_model", None)
    if fsm is not None:
        modules = [getattr(fsm, n, None) for n in ("decoder", "encoder")]
        return VAEHandle("ldm", fsm, *(m if isinstance(m, torch.nn.Module) else None for m in modules))
    forge_objects = getattr(model, "forge_objects", None)
    vae = getattr(forge_objects, "vae", None) if forge_objects is not None else None
    if vae is not None and getattr(vae, "patcher", None) is not None:
        inner = getattr(vae, "first_stage_model", None)
        return VAEHandle(
            "forge", inner, getattr(inner, "decoder", None), getattr(inner, "encoder", None), forge_vae=vae
        )
    return None


def forge_load_vae(vae: Any) -> None:
    """Forge: let its memory manager put the VAE on the device (what ``decode_inner`` does)."""
    from backend import memory_management  # Forge only

    memory_management.load_model_gpu(vae.patcher)


def prepare_upscale_memory() -> None:
    """Forge: what its own ESRGAN/RealESRGAN ``do_upscale`` does before upscaling
    (``modules_forge.utils.prepare_free_memory()``: offload models until the minimum inference
    memory is free). A1111 has no such step: nothing happens there."""
    try:
        from modules_forge.utils import prepare_free_memory  # Forge only
    except ImportError:
        return
    prepare_free_memory()


def replay_upscaler_load(path: str) -> None:
    """Make the draws from torch's global CPU generator that the host's own upscale makes.

    The ESRGAN, RealESRGAN, HAT, DAT and ScuNET upscalers of WebUI v1.10.1 and Forge build their
    model from its file at every ``do_upscale`` (``modelloader.load_spandrel_model`` ->
    ``spandrel.ModelLoader(device=None).load_from_file``), and the architecture's random weight
    initialisation draws from the global generator. The hires fix re-encode (and img2img's
    encode after a resize with an upscaler) then samples the latent posterior from that generator
    (``DiagonalGaussianDistribution.sample``: ``torch.randn``). VRAM Guard upscales with its cached
    model, so without these draws the second pass starts from other noise than the host's own
    (Forge, 128 px hires x2: 14.2 dB instead of identical). This builds the model the way the host
    does, on the CPU, and drops it: the same draws, at the same point of the job."""
    import spandrel

    spandrel.ModelLoader(device=None).load_from_file(str(path))


# -- precision -----------------------------------------------------------------------------------
def dtype_vae() -> torch.dtype | None:
    from modules import devices

    return getattr(devices, "dtype_vae", None)


def device() -> torch.device:
    from modules import devices

    return torch.device(devices.device)


def esrgan_device() -> torch.device:
    from modules import devices

    return torch.device(getattr(devices, "device_esrgan", devices.device))


def add_comment(p: Any, text: str) -> None:
    """A note under the result in the UI (``p.comment``; not saved in the infotext)."""
    comment = getattr(p, "comment", None)
    if callable(comment):
        comment(text)


# -- UNet (diffusion model) precision ------------------------------------------------------------
@dataclass(frozen=True)
class UNetHandle:
    """Where the current model's diffusion model is."""

    kind: str
    """``"ldm"`` (A1111: an ldm/sgm ``openaimodel.UNetModel`` at ``sd_model.model.diffusion_model``),
    ``"other"`` (a diffusion model VRAM Guard does not cast, e.g. SD3's MMDiT) or ``"forge"``
    (Forge: its memory manager owns the UNet's dtype)."""
    owner: Any
    """The checkpoint's model object (``shared.sd_model``)."""
    diffusion_model: torch.nn.Module | None
    name: str = ""
    """Class name of the diffusion model (for notes)."""


def unet_of(model: Any) -> UNetHandle | None:
    """The diffusion model of ``model`` (host-api §3.5, §10.1), or None. Reads attributes only."""
    if model is None:
        return None
    if getattr(model, "forge_objects", None) is not None:
        return UNetHandle("forge", model, None, "Forge")
    wrapper = getattr(model, "model", None)
    dm = getattr(wrapper, "diffusion_model", None) if wrapper is not None else None
    if not isinstance(dm, torch.nn.Module):
        return None
    name = type(dm).__name__
    return UNetHandle("ldm" if name == "UNetModel" else "other", model, dm, name)


@dataclass(frozen=True)
class UNetState:
    """The WebUI's global UNet precision state (``modules/devices.py``).

    ``dtype_unet``: what ``apply_model`` (hijacked by ``sd_hijack_unet``) casts the UNet's inputs
    (latent, timestep, every conditioning tensor) to. ``unet_needs_upcast``: ``--upcast-sampling``'s
    flag: ``apply_model`` returns ``float()`` outputs, the timestep embedding, GroupNorm32, GEGLU and
    hypernetworks are computed in FP32 around an FP16 UNet. The WebUI sets both at every checkpoint
    load (``sd_models.load_model_weights``).
    """

    dtype_unet: torch.dtype
    unet_needs_upcast: bool


def unet_state() -> UNetState:
    from modules import devices

    return UNetState(devices.dtype_unet, bool(devices.unet_needs_upcast))


def set_unet_state(state: UNetState) -> None:
    from modules import devices

    devices.dtype_unet = state.dtype_unet
    devices.unet_needs_upcast = state.unet_needs_upcast


def upcast_attn() -> bool:
    """Settings → "Upcast cross attention layer to float32" (``shared.opts.upcast_attn``)."""
    return bool(opts_get("upcast_attn", False))


# -- sampling ------------------------------------------------------------------------------------
def batch_cond_uncond() -> bool:
    """Settings -> Optimizations -> "Batch cond/uncond together" (``opts.batch_cond_uncond``,
    default on): the sampler runs the cond and uncond halves in one UNet forward."""
    return bool(opts_get("batch_cond_uncond", True))


def cross_attention() -> str | None:
    """The cross-attention optimization the WebUI applied: ``sd_hijack.model_hijack
    .optimization_method`` (v1.10.1: the optimizer's ``name``, ``""`` when none is applied), or
    None when the host does not record it."""
    from modules import sd_hijack

    name = getattr(getattr(sd_hijack, "model_hijack", None), "optimization_method", None)
    return None if name is None else str(name)


def live_previews_full() -> bool:
    """Live previews decode with the full VAE (``opts.show_progress_type == "Full"``, previews
    on): they run on the progress request's thread *during* sampling, so the VAE must stay on the
    card then. With ``--medvram``/``--lowvram`` the WebUI downgrades them unless
    ``live_preview_allow_lowvram_full``; VRAM Guard moves nothing there anyway."""
    if not bool(opts_get("live_previews_enable", True)):
        return False
    if int(opts_get("show_progress_every_n_steps", 10) or 0) == 0:
        return False
    return str(opts_get("show_progress_type", "Approx NN")) == "Full"


# -- upscalers -----------------------------------------------------------------------------------
def upscaler_instances() -> list[Any]:
    """The distinct ``Upscaler`` objects behind ``shared.sd_upscalers`` (host-api §5.1)."""
    from modules import shared

    seen: dict[int, Any] = {}
    for data in getattr(shared, "sd_upscalers", None) or []:
        scaler = getattr(data, "scaler", None)
        if scaler is not None:
            seen.setdefault(id(scaler), scaler)
    return list(seen.values())


def clear_upscale_cache() -> int:
    """Empty the Extras Upscale operation's result cache (``scripts/postprocessing_upscale.py``,
    keyed by image and upscaler only): an image upscaled by another route (VRAM Guard on/off, other
    tiling settings) would otherwise come back unchanged. Through the operation's own
    ``image_changed()``, which clears it. Returns how many scripts were cleared."""
    from modules import scripts

    n = 0
    runner = getattr(scripts, "scripts_postproc", None)
    for script in getattr(runner, "scripts", None) or []:
        if type(script).__name__ == "ScriptPostprocessingUpscale" or (
            getattr(script, "name", None) == "Upscale" and hasattr(script, "image_changed")
        ):
            script.image_changed()
            n += 1
    return n


# -- settings ------------------------------------------------------------------------------------
def add_options(section: tuple[str, str, str], options: list[tuple[str, dict]]) -> None:
    """Register settings: ``options`` = ``[(key, {default, label, kind, component_args, info})]``."""
    import gradio as gr
    from modules import shared

    # OptionInfo.section is (id, label); the category goes into category_id (what the WebUI's own
    # options_section() does with a 3-tuple; the settings page unpacks exactly two).
    section_id, label, category = section
    components: dict[str, Any] = {"bool": gr.Checkbox, "choice": gr.Dropdown, "int": gr.Slider}
    for key, spec in options:
        if spec["kind"] == "html":
            info = shared.OptionHTML(spec["label"])
        else:
            args = spec.get("component_args") or None
            info = shared.OptionInfo(spec["default"], spec["label"], components[spec["kind"]], args)
            if spec.get("info"):
                info = info.info(spec["info"])
        info.section = (section_id, label)
        info.category_id = category
        shared.opts.add_option(key, info)


def input_accordion() -> Callable[..., Any] | None:
    """``modules.ui_components.InputAccordion`` (A1111 and Forge), or None."""
    try:
        from modules.ui_components import InputAccordion
    except ImportError:
        return None
    return InputAccordion


# -- extensions ----------------------------------------------------------------------------------
TILED_VAE_FOLDERS = ("multidiffusion-upscaler-for-automatic1111",)
"""Folder names the Tiled Diffusion/Tiled VAE extension is installed under by default."""


def active_extension_dirs() -> list[str]:
    """Paths of the enabled extensions (``modules.extensions.active()``)."""
    try:
        from modules import extensions
    except ImportError:
        return []
    return [getattr(ext, "path", "") for ext in extensions.active()]


def tiled_vae_extension_installed(paths: list[str] | None = None) -> str | None:
    """The folder of an enabled Tiled VAE (MultiDiffusion) extension, or None."""
    for path in paths if paths is not None else active_extension_dirs():
        base = os.path.basename(os.path.normpath(path)).lower()
        if base in TILED_VAE_FOLDERS or os.path.isfile(os.path.join(path, "scripts", "tilevae.py")):
            return path
    return None


def profiles_dir() -> Path:
    """Where 'Profile the next job' writes: ``vram-guard-profiles/`` in the WebUI's outputs folder
    (Settings' "Output directory for images" when set, else ``outputs/`` of the WebUI's data folder)."""
    from modules import paths_internal, shared

    from .profiling import FOLDER

    base = getattr(shared.opts, "outdir_samples", "") or getattr(paths_internal, "default_output_dir", "")
    if not base:
        base = os.path.join(paths_internal.data_path, "outputs")
    return Path(base) / FOLDER


def register_file(path: str) -> None:
    """Let the page's ``file=`` route serve ``path`` as it serves the WebUI's own images (a file
    outside the WebUI's folder is served only once registered; the route keeps the page's login)."""
    from modules import shared, ui_tempdir

    demo = getattr(shared, "demo", None)
    if demo is not None:
        ui_tempdir.register_tmp_file(demo, os.path.abspath(path))
