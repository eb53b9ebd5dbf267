"""The VRAM Guard accordion (txt2img/img2img) and the Extras section, built with gradio.

Builds from :data:`lib_vram.webui.options.FIELDS` and plain data handed in by the host adapter; never
imports the WebUI (``modules``). Works with gradio 3.41.2 (A1111) and 4.x (Forge): only
``gr.update``, context-manager layout blocks and constructor keywords both versions know.

The WebUI's way: short labels, the explanation on hover (the ``title`` the WebUI's front end
sets from a component's ``webui_tooltip``, and ``javascript/vram_guard.js`` from the readout's
tooltip map), the common controls first, then the readout, the rest folded under "Advanced".

The WebUI's ``InputAccordion`` (an accordion that is also the enable checkbox) is passed in as
``input_accordion``; without it, one already imported by the WebUI is used if present, otherwise a
plain ``gr.Accordion`` with an "Enable VRAM Guard" checkbox stands in (standalone pages, tests).
Forge's ``InputAccordion`` is a factory function; both are only ever *called*, so either works.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import gradio as gr

from lib_vram.core.readout import PROFILE_BUTTON, placeholder_payload, render_readout_html

from .options import (
    API_ARG_ORDER,
    EXTRAS_FIELDS,
    FIELDS_BY_NAME,
    INFOTEXT_KEY,
    OptionField,
    VRAMGuardOptions,
    infotext_getter,
)
from .profiling import BUTTON_TOOLTIP

logger = logging.getLogger(__name__)

TABS = ("txt2img", "img2img")


AUTO_VALUES: dict[str, Any] = {
    "vae_tiling": "Auto",
    "vae_tile": 0,
    "precision_vae": "Auto",
    "upscale_tile": 0,
    "upscale_batch": 0,
    "precision_upscale": "Auto",
}
"""Controls that can "follow the preset"; choosing a preset puts them back to these values."""

COMMON: tuple[tuple[str, ...], ...] = (
    ("preset", "vae_tiling"),
    ("upscale_tiling", "guard_sampling"),
)
"""Rows above the readout: what most jobs need."""
ADVANCED: tuple[tuple[str, ...], ...] = (
    ("vae_mode", "vae_tile"),
    ("upscale_tile", "upscale_batch"),
    ("precision_vae", "precision_upscale"),
    ("unet_fp16", "release_between_stages"),
)
"""Rows of the folded "Advanced" accordion under the readout (Auto/on fits most jobs)."""
ADVANCED_LABEL = "Advanced"
ADVANCED_TOOLTIP = (
    "Tiled VAE mode, precisions, tile and batch sizes, FP16 UNet and memory release. Auto (0) and the "
    "defaults fit most jobs; the preset sets what is left on Auto."
)

DROPDOWNS = frozenset({"preset", "precision_vae", "precision_upscale"})
"""Choice fields shown as dropdowns (the rest are radio buttons)."""

FREE_TOOLTIP = (
    "Return the memory PyTorch keeps cached but unused to the driver now (also after a failed job), "
    "and refresh the readout."
)
EXTRAS_ENABLE_INFO = (
    "Run the Upscale operation's upscaler in tiles that fit your card's free memory; use it when Extras "
    "runs out of memory."
)
"""The Extras section's enable switch's hover hint, in the user's terms (its field's speaks of a tab)."""

PRESET_TARGETS: tuple[str, ...] = tuple(n for n in API_ARG_ORDER if n not in ("enabled", "preset"))
"""The controls a preset change updates, in order (the outputs of the preset's ``change`` event)."""


@dataclass
class UIWidgets:
    """What :func:`build_ui` made; ``inputs`` is what the Script's ``ui()`` returns."""

    inputs: list[Any]
    """Components in :data:`~lib_vram.webui.options.API_ARG_ORDER`; the first is the enable switch."""
    controls: dict[str, Any]
    """The same components keyed by field name."""
    readout: Any
    free_button: Any
    infotext_fields: list[tuple[Any, Callable[[Mapping[str, Any]], Any]]]
    """``(component, f(params) -> value | None)`` pairs for ``Script.infotext_fields``."""
    preset: Any
    paste_field_names: list[str] = field(default_factory=lambda: [INFOTEXT_KEY])
    profile_button: Any = None
    """'Profile the next job' (not an input: never in presets, the infotext or the API)."""


@dataclass
class ExtrasWidgets:
    """What :func:`build_extras_widgets` made; ``inputs`` is ``ScriptPostprocessing.ui()``'s dict."""

    inputs: dict[str, Any]
    readout: Any
    free_button: Any


def elem_id(tab: str, name: str) -> str:
    return f"vram_guard_{tab}_{name}"


def with_hint(comp: Any, tooltip: str) -> Any:
    """``comp`` with ``tooltip`` as its hover hint: the WebUI (A1111 1.6+, Forge) sends a component's
    ``webui_tooltip`` to the page, whose ``hints.js`` sets it as the element's ``title`` on load
    (what its own ``tooltip=`` keyword does; plain gradio rejects that keyword, so it is set here).
    Elsewhere the attribute is unused and ``javascript/vram_guard.js`` sets the same ``title``."""
    comp.webui_tooltip = tooltip
    return comp


def _component(f: OptionField, value: Any, eid: str) -> Any:
    """The control of ``f``: its short label, its explanation as the hover hint (no text under it)."""
    cls = {"bool": gr.Checkbox, "int": gr.Slider}.get(
        f.kind, gr.Dropdown if f.name in DROPDOWNS else gr.Radio
    )
    # (component_args: a slider's range, a choice's choices: the Settings page's arguments)
    return with_hint(cls(value=value, label=f.label, elem_id=eid, **f.component_args()), f.tooltip)


def _rows(rows: tuple[tuple[str, ...], ...], defaults: VRAMGuardOptions, tab: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for row in rows:
        with gr.Row():
            for name in row:
                out[name] = _component(FIELDS_BY_NAME[name], getattr(defaults, name), elem_id(tab, name))
    return out


def tooltips_for(
    controls: Mapping[str, Any],
    extra: Mapping[str, tuple[str, str]] = (),
    *,
    labels: Mapping[str, tuple[str, str]] = (),
) -> dict:
    """elem_id → (label, tooltip) for the JS (``titles[label] = tooltip``, ``title`` attributes).

    ``labels`` replaces a field's (label, tooltip) where the section shows it differently (the
    Extras section's enable switch)."""
    own = dict(labels)
    out: dict[str, tuple[str, str]] = {}
    for name, comp in controls.items():
        f = FIELDS_BY_NAME[name]
        # An InputAccordion: its (hidden) checkbox's id and the accordion's, whose header shows it.
        for eid in (getattr(comp, "elem_id", None), getattr(comp, "accordion_id", None)):
            if eid:
                out[str(eid)] = own.get(name, (f.label, f.tooltip))
    out.update(dict(extra))
    return out


def _readout(tab: str, tooltips: Mapping[str, tuple[str, str]]) -> Any:
    """The readout box (a placeholder until the JS polls)."""
    initial = render_readout_html(placeholder_payload(), tab=tab, tooltips=tooltips)
    eid = f"vram_guard_readout_{tab}"  # (the JS updates #vram_guard_readout_<tab>)
    return gr.HTML(value=initial, elem_id=eid, elem_classes=["vram-guard-readout-box"])


def _button(label: str, eid: str, tooltip: str) -> Any:
    return with_hint(gr.Button(value=label, elem_id=eid, variant="secondary", size="sm"), tooltip)


@contextlib.contextmanager
def _enable_switch(
    value: bool, *, label: str, eid: str, input_accordion: Callable[..., Any] | None, checkbox: str, hint: str
) -> Iterator[Any]:
    """The section's accordion, its body entered: the WebUI's ``InputAccordion`` (its header
    switches it on), else a plain accordion whose first control is an enable checkbox labelled
    ``checkbox``. Yields the enable component."""
    if input_accordion is None:  # one the WebUI has already imported (no import here)
        input_accordion = getattr(sys.modules.get("modules.ui_components"), "InputAccordion", None)
    if input_accordion is not None:
        acc = input_accordion(value, label=label, elem_id=eid)
        with acc:
            yield acc
        return
    with gr.Accordion(label=label, open=value, elem_id=eid, elem_classes=["vram-guard-accordion"]):
        yield with_hint(gr.Checkbox(value=value, label=checkbox, elem_id=f"{eid}_enabled"), hint)


def build_ui(
    *,
    tab: str,
    defaults: VRAMGuardOptions,
    input_accordion: Callable[..., Any] | None = None,
    on_free: Callable[[], str] | None = None,
    on_profile: Callable[[], str] | None = None,
) -> UIWidgets:
    """Build the "VRAM Guard" accordion inside the current gradio Blocks context.

    Args:
        tab: ``"txt2img"`` or ``"img2img"`` (element ids and the readout id use it).
        defaults: initial values (the Settings page's defaults).
        input_accordion: the WebUI's ``InputAccordion`` (``None``: see the module docstring).
        on_free, on_profile: called by "Free memory now" and "Profile the next job" (arms or cancels
            profiling of the next job); return the readout HTML to show. ``None`` leaves the button
            unwired (the caller wires its ``click`` itself).
    """
    if tab not in TABS:
        raise ValueError(f"`tab` must be one of {TABS}, got {tab!r}")
    if not isinstance(defaults, VRAMGuardOptions):
        raise ValueError(f"`defaults` must be a VRAMGuardOptions, got {type(defaults).__name__}")
    controls: dict[str, Any] = {}
    acc_id = f"vram_guard_{tab}"
    enable_field = FIELDS_BY_NAME["enabled"]
    with _enable_switch(
        defaults.enabled, label=enable_field.label, eid=acc_id, input_accordion=input_accordion,
        checkbox="Enable VRAM Guard", hint=enable_field.tooltip,
    ) as enable:  # fmt: skip
        controls["enabled"] = enable
        with gr.Column(elem_classes=["vram-guard", "vram-guard-controls"]):
            controls.update(_rows(COMMON, defaults, tab))
            free_id = elem_id(tab, "free")
            profile_id = elem_id(tab, "profile")
            advanced_id = elem_id(tab, "advanced")
            folded = [FIELDS_BY_NAME[name] for row in ADVANCED for name in row]
            tips = tooltips_for(
                controls,
                {
                    **{elem_id(tab, f.name): (f.label, f.tooltip) for f in folded},
                    free_id: ("Free memory now", FREE_TOOLTIP),
                    profile_id: (PROFILE_BUTTON, BUTTON_TOOLTIP),
                    advanced_id: ("", ADVANCED_TOOLTIP),  # ("": not for hints.js's titles[])
                    acc_id: (enable_field.label, enable_field.tooltip),  # the accordion's header
                },
            )
            readout = _readout(tab, tips)
            with gr.Row():
                free_button = _button("Free memory now", free_id, FREE_TOOLTIP)
                profile_button = _button(PROFILE_BUTTON, profile_id, BUTTON_TOOLTIP)  # (.profiling)
            with gr.Accordion(
                ADVANCED_LABEL, open=False, elem_id=advanced_id, elem_classes=["vram-guard-advanced"]
            ):
                controls.update(_rows(ADVANCED, defaults, tab))
    inputs = [controls[name] for name in API_ARG_ORDER]
    targets = [controls[name] for name in PRESET_TARGETS]
    controls["preset"].change(
        fn=preset_changed,
        inputs=[controls["preset"]],
        outputs=targets,
        show_progress="hidden",
    )
    if on_free is not None:
        free_button.click(fn=on_free, inputs=[], outputs=[readout], show_progress="hidden")
    if on_profile is not None:
        profile_button.click(fn=on_profile, inputs=[], outputs=[readout], show_progress="hidden")
    infotext = [(controls[name], infotext_getter(name)) for name in API_ARG_ORDER]
    return UIWidgets(
        inputs=inputs,
        controls=controls,
        readout=readout,
        free_button=free_button,
        infotext_fields=infotext,
        preset=controls["preset"],
        profile_button=profile_button,
    )


def preset_changed(preset: str) -> list[Any]:
    """Updates for :data:`PRESET_TARGETS` after the preset dropdown changed: ``"Custom"`` changes
    nothing; a preset puts the controls that can follow it back to Auto."""
    if preset == "Custom":
        return [gr.update() for _ in PRESET_TARGETS]
    return [gr.update(value=AUTO_VALUES[n]) if n in AUTO_VALUES else gr.update() for n in PRESET_TARGETS]


def build_extras_widgets(
    defaults: VRAMGuardOptions,
    *,
    input_accordion: Callable[..., Any] | None = None,
    on_free: Callable[[], str] | None = None,
) -> ExtrasWidgets:
    """The Extras tab section: tiled-upscale settings, the readout and "Free memory now"."""
    if not isinstance(defaults, VRAMGuardOptions):
        raise ValueError(f"`defaults` must be a VRAMGuardOptions, got {type(defaults).__name__}")
    tab = "extras"
    inputs: dict[str, Any] = {}
    with _enable_switch(
        defaults.enabled, label="VRAM Guard upscaling", eid=f"vram_guard_{tab}",
        input_accordion=input_accordion, checkbox="Enable VRAM Guard upscaling", hint=EXTRAS_ENABLE_INFO,
    ) as enable:  # fmt: skip
        inputs["enabled"] = enable
        with gr.Column(elem_classes=["vram-guard", "vram-guard-controls"]):
            inputs.update(_rows((EXTRAS_FIELDS[1:],), defaults, tab))
            free_id = elem_id(tab, "free")
            tips = tooltips_for(
                inputs,
                {
                    free_id: ("Free memory now", FREE_TOOLTIP),
                    f"vram_guard_{tab}": ("VRAM Guard upscaling", EXTRAS_ENABLE_INFO),
                },
                labels={"enabled": ("VRAM Guard upscaling", EXTRAS_ENABLE_INFO)},
            )
            readout = _readout(tab, tips)
            free_button = _button("Free memory now", free_id, FREE_TOOLTIP)
    if on_free is not None:
        free_button.click(fn=on_free, inputs=[], outputs=[readout], show_progress="hidden")
    return ExtrasWidgets(inputs=inputs, readout=readout, free_button=free_button)


def build_extras_ui(defaults: VRAMGuardOptions, **kwargs: Any) -> dict[str, Any]:
    """``ScriptPostprocessing.ui()``'s dict (keys = ``process()`` keyword names, see
    :data:`EXTRAS_FIELDS`); keyword arguments as :func:`build_extras_widgets`."""
    return build_extras_widgets(defaults, **kwargs).inputs
