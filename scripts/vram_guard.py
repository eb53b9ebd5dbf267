"""VRAM Guard's WebUI entry points: the txt2img/img2img accordion, the Extras section, callbacks.

Thin on purpose: it parses the UI/API arguments and forwards each WebUI hook to
:mod:`lib_vram.webui`, where the logic lives and is tested. Importing this file only registers
callbacks (host-api §2); everything else happens when the WebUI calls in.
"""

from __future__ import annotations

import functools

from modules import script_callbacks, scripts, scripts_postprocessing

from lib_vram import webui as vg
from lib_vram.webui import host
from lib_vram.webui.options import extras_options, from_args

SESSION = vg.Session()
"""This load's state (jobs, last readout, model cache); replaced when "Reload UI" re-runs the file."""


class VRAMGuardScript(scripts.Script):
    """The "VRAM Guard" accordion (always visible, next to Hires. fix)."""

    section = "accordions"
    create_group = False

    def title(self):
        return "VRAM Guard"

    def show(self, is_img2img):
        return scripts.AlwaysVisible

    def ui(self, is_img2img):
        from lib_vram.webui.ui import build_ui

        widgets = build_ui(
            tab="img2img" if is_img2img else "txt2img",
            defaults=vg.defaults(),
            input_accordion=host.input_accordion(),
            on_free=SESSION.free_html,
            on_profile=SESSION.toggle_profile_html,
        )
        self.infotext_fields = widgets.infotext_fields
        self.paste_field_names = widgets.paste_field_names
        return widgets.inputs

    # -- job lifecycle (lib_vram.webui.ScriptJobs) -------------------------------------------
    @functools.cached_property
    def jobs(self) -> vg.ScriptJobs:
        """Made at first use (the WebUI sets ``is_img2img`` after ``__init__``)."""
        return vg.ScriptJobs(SESSION, kind="img2img" if getattr(self, "is_img2img", False) else "txt2img")

    def _options(self, p, args):
        """The job's options; None (reported once, job runs without us) when they are bad."""
        try:
            return from_args(list(args), defaults=vg.defaults())
        except ValueError as exc:
            self.jobs.options_error(p, exc)
            return None

    def setup(self, p, *args):
        options = self._options(p, args)
        if options is not None:
            self.jobs.setup(p, options)

    def process(self, p, *args):
        options = self._options(p, args)
        if options is not None:
            self.jobs.process(p, options)  # (disabled: a crashed run's leftovers closed, nothing else)

    # (each of these does nothing while no job is open)
    def process_before_every_sampling(self, p, *args, **kwargs):
        self.jobs.before_sampling(p, x=kwargs.get("x"), c=kwargs.get("c"), uc=kwargs.get("uc"))

    def before_hr(self, p, *args):
        self.jobs.before_hr(p)

    def post_sample(self, p, ps, *args):
        self.jobs.post_sample(p)

    def postprocess_batch(self, p, *args, **kwargs):
        self.jobs.postprocess_batch(p)

    def postprocess(self, p, processed, *args):
        self.jobs.postprocess(p)


class VRAMGuardExtras(scripts_postprocessing.ScriptPostprocessing):
    """Extras: tiled upscaling for the built-in Upscale operation, plus the readout.

    Route (b) of host-api §6.4: no second upscaler UI. ``process_firstpass`` (called for every
    operation before any ``process``, whatever the user's operation order) opens a job that routes
    the upscaler the built-in "Upscale" operation picks through VRAM Guard's tiled engine.
    """

    name = "VRAM Guard"
    order = 999

    def ui(self):
        from lib_vram.webui.ui import build_extras_ui

        return build_extras_ui(
            vg.defaults(), input_accordion=host.input_accordion(), on_free=SESSION.free_html
        )

    @functools.cached_property
    def jobs(self) -> vg.ScriptJobs:
        return vg.ScriptJobs(SESSION, kind="extras")

    def process_firstpass(self, pp, **args):
        # None values (the Extras API passes None for our arguments) mean "the Settings defaults".
        self.jobs.extras(pp, extras_options(args, vg.defaults()))

    def process(self, pp, **args):
        return None


def _on_ui_settings():
    vg.register_settings()


def _on_app_started(demo, app):
    vg.configure_logging()
    vg.start_emulation(SESSION)
    SESSION.refresh_placement()  # (after the emulated card started: a checkpoint loaded before it)
    vg.mount_routes(app, SESSION)
    vg.check_conflicts(SESSION)
    vg.api_defaults_follow_settings(app, SESSION)


def _on_list_unets(unets):
    # the main thread's last callback before the WebUI loads the checkpoint in its own thread:
    # the checkpoint placement's patches must be there for that load (lib_vram.webui.placement)
    SESSION.refresh_placement()


def _on_model_loaded(sd_model):
    SESSION.model_changed(sd_model)


def _on_cfg_denoiser(params):
    SESSION.sampling_step(params)


def _on_script_unloaded():
    SESSION.close_all()
    SESSION.stop_placement()
    SESSION.restore_api_defaults()
    SESSION.stop_preprocessors()
    SESSION.stop_emulation()


script_callbacks.on_ui_settings(_on_ui_settings)
script_callbacks.on_app_started(_on_app_started)
script_callbacks.on_list_unets(_on_list_unets)
script_callbacks.on_model_loaded(_on_model_loaded)
script_callbacks.on_cfg_denoiser(_on_cfg_denoiser)
script_callbacks.on_script_unloaded(_on_script_unloaded)
