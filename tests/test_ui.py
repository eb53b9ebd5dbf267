"""The gradio accordion and Extras section, built inside real gradio 3.41.2 Blocks (no launch)."""

from __future__ import annotations

import asyncio
import os
import sys
import types

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

import gradio as gr  # noqa: E402
import pytest  # noqa: E402

from lib_vram.webui import options as O  # noqa: E402
from lib_vram.webui import ui  # noqa: E402
from lib_vram.webui.options import FIELDS, VRAMGuardOptions  # noqa: E402

NON_DEFAULT = VRAMGuardOptions(
    enabled=True,
    preset="8GB",
    vae_tiling="Always",
    vae_mode="fast",
    vae_tile=96,
    upscale_tiling=False,
    upscale_tile=256,
    upscale_batch=4,
    precision_vae="BF16",
    precision_upscale="FP16",
    unet_fp16=True,
    release_between_stages=False,
    guard_sampling=False,
)


class WebuiStyleInputAccordion(gr.Checkbox):
    """Written for this test from host-api.md §1.4/§10.5: a checkbox that is also an accordion
    (hidden checkbox + ``gr.Accordion``; entering it enters the accordion)."""

    def __init__(self, value, **kwargs):
        self.accordion_id = kwargs.get("elem_id")
        super().__init__(value, **{**kwargs, "elem_id": f"{self.accordion_id}-checkbox", "visible": False})
        self.accordion = gr.Accordion(
            label=kwargs.get("label", "Accordion"), open=value, elem_id=self.accordion_id
        )

    def __enter__(self):
        self.accordion.__enter__()
        return self

    def __exit__(self, *exc):
        return self.accordion.__exit__(*exc)


def forge_style_factory(value, **kwargs):
    """Forge's ``InputAccordion`` is a function returning the implementation object."""
    forge_style_factory.calls.append(kwargs)
    return WebuiStyleInputAccordion(value, **kwargs)


forge_style_factory.calls = []


def build(tab="txt2img", defaults=NON_DEFAULT, **kwargs):
    with gr.Blocks() as demo:
        widgets = ui.build_ui(tab=tab, defaults=defaults, **kwargs)
    return demo, widgets


def run_event(demo, fn_index, inputs):
    """Run one wired event through gradio 3.41's own dispatcher (version-specific: one helper)."""
    out = asyncio.run(demo.process_api(fn_index=fn_index, inputs=inputs, state={}))
    return out["data"]


def dependency_for(demo, trigger, event):
    for i, dep in enumerate(demo.dependencies):
        if trigger._id in dep["targets"] and dep["trigger"] == event:
            return i, dep
    raise AssertionError(f"no {event} event on {trigger}")


def ancestors(block):
    out = []
    while getattr(block, "parent", None) is not None:
        block = block.parent
        out.append(block)
    return out


def test_inputs_in_documented_order_with_defaults_choices_ranges_and_ids():
    _demo, w = build()
    assert len(w.inputs) == len(O.API_ARG_ORDER) == 13
    assert [type(c).__name__ for c in w.inputs] == [
        "Checkbox",
        "Dropdown",
        "Radio",
        "Radio",
        "Slider",
        "Checkbox",
        "Slider",
        "Slider",
        "Dropdown",
        "Dropdown",
        "Checkbox",
        "Checkbox",
        "Checkbox",
    ]
    assert sorted(n for row in ui.COMMON + ui.ADVANCED for n in row) == sorted(O.API_ARG_ORDER[1:])
    for f, comp in zip(FIELDS, w.inputs):
        assert w.controls[f.name] is comp
        assert comp.value == getattr(NON_DEFAULT, f.name), f.name
        assert comp.elem_id == f"vram_guard_txt2img_{f.name}"
        if f.kind == "choice":
            assert [c if isinstance(c, str) else c[0] for c in comp.choices] == list(f.choices)
        if f.kind == "int":
            assert (comp.minimum, comp.maximum, comp.step) == f.range
    # The API's default args are the components' values: they must read back as the defaults.
    assert O.from_args([c.value for c in w.inputs]) == NON_DEFAULT
    assert w.readout.elem_id == "vram_guard_readout_txt2img"
    assert w.free_button.elem_id == "vram_guard_txt2img_free"
    assert w.preset is w.controls["preset"]
    assert 'class="vram-guard vram-guard-readout"' in w.readout.value


def test_tables_agree_settings_infotext_api_ui():
    """One table, four surfaces: settings keys/args, UI components, API order, infotext paste."""
    _demo, w = build(defaults=NON_DEFAULT)
    params = {"Steps": "20", **O.to_infotext(NON_DEFAULT)}
    pasted = {comp: getter(params) for comp, getter in w.infotext_fields}
    stored = {f.settings_key: getattr(NON_DEFAULT, f.name) for f in FIELDS}
    from_settings = O.defaults_from_settings(lambda key, default: stored.get(key, default))
    assert from_settings == NON_DEFAULT
    for pos, f in enumerate(FIELDS):
        comp = w.inputs[pos]
        assert O.API_ARG_ORDER[pos] == f.name
        # UI: label (unique, ui-config.json key) and range/choices come from the same row.
        assert comp.label == f.label or (f.name == "enabled" and comp.label == "Enable VRAM Guard")
        args = f.component_args()
        for key, value in args.items():
            got = getattr(comp, key)
            if key == "choices":
                got = [c if isinstance(c, str) else c[0] for c in got]
            assert got == value, (f.name, key)
        # Infotext: the paste target of this component returns this field's value, typed like
        # the component's value (the API converts with type(component.value)(v)).
        value = pasted[comp]
        assert value == getattr(NON_DEFAULT, f.name)
        assert type(value) is type(comp.value) or (f.kind == "int" and isinstance(value, int))
    assert len(w.infotext_fields) == len(FIELDS)
    assert O.INFOTEXT_KEY in w.paste_field_names


def test_paste_with_webui_conversion_rules():
    """Emulate connect_paste: bool targets get False only from "False"; int targets get float(v)."""
    _demo, w = build(defaults=VRAMGuardOptions())
    params = {"VRAM Guard": "preset 4GB, VAE off fast t32 fp32, upscale off b2, release off"}
    result = {}
    for comp, getter in w.infotext_fields:
        v = getter(params)
        valtype = type(comp.value)
        if valtype is bool and v == "False":
            val = False
        elif valtype is int:
            val = float(v)
        else:
            val = valtype(v)
        result[comp] = val
    opts = O.from_args([result[c] for c in w.inputs])
    assert opts == VRAMGuardOptions(
        enabled=True,
        preset="4GB",
        vae_tiling="Off",
        vae_mode="fast",
        vae_tile=32,
        precision_vae="FP32",
        upscale_tiling=False,
        upscale_batch=2,
        release_between_stages=False,
    )


def test_preset_change_event_resets_auto_controls():
    demo, w = build()
    index, dep = dependency_for(demo, w.preset, "change")
    assert dep["outputs"] == [w.controls[n]._id for n in ui.PRESET_TARGETS]
    out = run_event(demo, index, ["6GB"])
    by_name = dict(zip(ui.PRESET_TARGETS, out))
    assert by_name["vae_tile"]["value"] == 0 and by_name["precision_upscale"]["value"] == "Auto"
    assert "value" not in by_name["vae_mode"] and "value" not in by_name["unet_fp16"]
    custom = run_event(demo, index, ["Custom"])
    assert all("value" not in u for u in custom)


def test_free_button_calls_back_into_the_readout():
    calls = []

    def on_free():
        calls.append(1)
        return "<div class='vram-guard vram-guard-readout'>freed</div>"

    demo, w = build(on_free=on_free)
    index, dep = dependency_for(demo, w.free_button, "click")
    assert dep["outputs"] == [w.readout._id]
    out = run_event(demo, index, [])
    assert calls == [1]
    assert "freed" in out[0]
    demo2, w2 = build()
    with pytest.raises(AssertionError):
        dependency_for(demo2, w2.free_button, "click")


def test_input_accordion_class_and_factory():
    _demo, w = build(input_accordion=WebuiStyleInputAccordion)
    assert isinstance(w.inputs[0], WebuiStyleInputAccordion)
    assert w.inputs[0].accordion_id == "vram_guard_txt2img"
    assert w.inputs[0].label == "VRAM Guard"
    # every control and the readout sit inside the accordion
    for comp in [*w.inputs[1:], w.readout, w.free_button]:
        assert w.inputs[0].accordion in ancestors(comp)
    forge_style_factory.calls.clear()
    _demo, w = build(tab="img2img", input_accordion=forge_style_factory)
    assert forge_style_factory.calls == [{"label": "VRAM Guard", "elem_id": "vram_guard_img2img"}]
    assert w.readout.elem_id == "vram_guard_readout_img2img"


def test_input_accordion_detected_from_an_imported_webui(monkeypatch):
    fake = types.ModuleType("modules.ui_components")
    fake.InputAccordion = WebuiStyleInputAccordion
    monkeypatch.setitem(sys.modules, "modules.ui_components", fake)
    _demo, w = build()
    assert isinstance(w.inputs[0], WebuiStyleInputAccordion)
    monkeypatch.delitem(sys.modules, "modules.ui_components")
    _demo, w = build()
    assert type(w.inputs[0]) is gr.Checkbox


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="`tab`"):
        build(tab="extras")
    with pytest.raises(ValueError, match="`defaults`"):
        build(defaults={"preset": "6GB"})


def test_extras_section_and_none_args():
    with gr.Blocks():
        ew = ui.build_extras_widgets(NON_DEFAULT, on_free=lambda: "x")
    assert list(ew.inputs) == list(O.EXTRAS_FIELDS)
    for name, comp in ew.inputs.items():
        assert comp.value == getattr(NON_DEFAULT, name)
    assert ew.readout.elem_id == "vram_guard_readout_extras"
    with gr.Blocks():
        keys = ui.build_extras_ui(VRAMGuardOptions())
    assert list(keys) == list(O.EXTRAS_FIELDS)
    # The Extras API passes None for every arg of a non-built-in operation: defaults apply.
    opts = O.extras_options(dict.fromkeys(O.EXTRAS_FIELDS), NON_DEFAULT)
    assert opts == NON_DEFAULT.replace(upscale_tiling=True)
    opts = O.extras_options(
        {"enabled": True, "upscale_tile": 128.0, "precision_upscale": None}, VRAMGuardOptions()
    )
    assert (opts.enabled, opts.upscale_tile, opts.precision_upscale) == (True, 128, "Auto")
    with pytest.raises(ValueError, match="`vae_tile`"):
        O.extras_options({"vae_tile": 64}, VRAMGuardOptions())


def test_ui_called_three_times_is_side_effect_free(tmp_path, monkeypatch):
    """The WebUI calls ui() again inside throw-away Blocks when the API is on: every build gives the
    same inputs (values, ids), wires events only into its own Blocks, and changes no module state,
    logger or file."""
    import logging

    monkeypatch.chdir(tmp_path)

    def module_state():
        return {m.__name__: {k: id(v) for k, v in vars(m).items()} for m in (ui, O)}

    logger = logging.getLogger("lib_vram")
    before_state, before_handlers = module_state(), list(logger.handlers)
    builds = [build() for _ in range(3)]
    assert module_state() == before_state and logger.handlers == before_handlers
    assert os.listdir(tmp_path) == []
    shapes = [
        ([c.value for c in w.inputs], [c.elem_id for c in w.inputs], len(demo.dependencies))
        for demo, w in builds
    ]
    assert len(builds[0][1].inputs) == 13 and shapes[0][0] == NON_DEFAULT.args()
    assert shapes[1] == shapes[0] and shapes[2] == shapes[0]
    # Each build's events point at its own components only (nothing leaks between Blocks).
    for demo, _w in builds:
        own = {block_id for block_id in demo.blocks}
        for dep in demo.dependencies:
            assert set(dep["targets"]) <= own and set(dep["inputs"]) <= own and set(dep["outputs"]) <= own


def _tooltips_of(readout) -> dict:
    """The elem_id → [label, tooltip] map the readout hands the page's JS."""
    import html
    import json
    import re

    m = re.search(r'data-vram-guard-tooltips="([^"]*)"', readout.value)
    return json.loads(html.unescape(m.group(1)))


def _one_line(text) -> bool:
    return isinstance(text, str) and 20 <= len(text) <= 125 and "\n" not in text and text.strip() == text


def _short_label(text) -> bool:
    """Fits one line in a third of the accordion: a few words, no units or '0 = Auto' in brackets."""
    return isinstance(text, str) and 0 < len(text) <= 30 and "\n" not in text and "(" not in text


def _hint(comp):
    """The hover hint the WebUI's front end sets as the element's ``title`` (hints.js)."""
    return getattr(comp, "webui_tooltip", None)


def test_every_control_explains_itself_on_hover_under_a_short_label():
    """Accordion and Extras: a short one-line label per control, its explanation as the hover hint
    (the component's ``webui_tooltip``, which the WebUI's hints.js sets as the ``title``, and the
    readout's tooltip map, from which javascript/vram_guard.js sets the same) and no paragraph under
    it. Settings page: one line under every default (the WebUI's convention there)."""
    from lib_vram.webui.integration import settings_options

    for f in FIELDS:
        assert _short_label(f.label), (f.name, f.label)
        assert 40 <= len(f.tooltip) <= 400 and "\n" not in f.tooltip, (f.name, f.tooltip)
        assert _one_line(f.info), (f.name, f.info)
        assert f.info != f.tooltip, f.name  # the Settings page's short line, not the hover text again
    # txt2img with the WebUI's InputAccordion: the header carries the switch's hint
    _demo, w = build(input_accordion=WebuiStyleInputAccordion)
    tips = _tooltips_of(w.readout)
    for name, comp in w.controls.items():
        f = O.FIELDS_BY_NAME[name]
        assert comp.info is None, (name, comp.info)  # no paragraph under the control
        assert tips[comp.elem_id] == [f.label, f.tooltip], name
        if name != "enabled":  # (an accordion's hint goes on its header only: the JS's)
            assert _hint(comp) == f.tooltip, name
    assert tips["vram_guard_txt2img"] == ["VRAM Guard", O.FIELDS_BY_NAME["enabled"].tooltip]
    for button in (w.free_button, w.profile_button):
        assert len(_hint(button)) >= 20 and tips[button.elem_id][1] == _hint(button)
    # "Advanced" is no label of ours alone: not given to hints.js's titles[] (the JS skips "")
    assert tips["vram_guard_txt2img_advanced"] == ["", ui.ADVANCED_TOOLTIP]
    # a standalone page: the enable checkbox is visible, with its hint
    _demo, w = build()
    enable = w.controls["enabled"]
    assert enable.info is None and _hint(enable) == O.FIELDS_BY_NAME["enabled"].tooltip
    # Extras
    with gr.Blocks():
        ew = ui.build_extras_widgets(VRAMGuardOptions())
    assert ew.inputs["enabled"].info is None and "Upscale" in _hint(ew.inputs["enabled"])
    for name, comp in ew.inputs.items():
        assert comp.info is None, name
        if name != "enabled":
            assert _hint(comp) == O.FIELDS_BY_NAME[name].tooltip, name
    extras_tips = _tooltips_of(ew.readout)
    assert "vram_guard_extras_free" in extras_tips and "vram_guard_extras_upscale_tile" in extras_tips
    # Settings page: every default carries its one line
    from lib_vram.webui.placement import SETTING as PLACEMENT  # a session setting, no job field

    for key, spec in settings_options():
        if spec["kind"] != "html":
            assert _one_line(spec["info"]), (key, spec["info"])
            if key != PLACEMENT:
                assert spec["info"] == O.FIELDS_BY_NAME[key.removeprefix("vram_guard_")].info, key


def _page_order(root) -> list:
    """Every block under ``root``, depth first: the order the page shows them in."""
    out = []
    for child in getattr(root, "children", []):
        out.append(child)
        out.extend(_page_order(child))
    return out


def test_common_controls_first_then_the_readout_then_advanced_folded():
    """The WebUI's convention: the common controls first, the readout (and its timeline) right after
    them, the rest folded in a closed "Advanced" accordion under it; the API's argument order (the
    order ``ui()`` returns) does not change with the layout."""
    _demo, w = build(input_accordion=WebuiStyleInputAccordion)
    acc = w.inputs[0].accordion
    (advanced,) = [b for b in _page_order(acc) if isinstance(b, gr.Accordion)]
    assert advanced.label == "Advanced" and advanced.open is False
    assert advanced.elem_id == "vram_guard_txt2img_advanced"
    common = ["preset", "vae_tiling", "upscale_tiling", "guard_sampling"]
    assert sorted(n for row in ui.COMMON for n in row) == sorted(common)
    folded = [n for n in O.API_ARG_ORDER[1:] if n not in common]
    assert sorted(n for row in ui.ADVANCED for n in row) == sorted(folded)
    for name in common:
        assert advanced not in ancestors(w.controls[name]), name
    for name in folded:
        assert advanced in ancestors(w.controls[name]), name
    order = _page_order(acc)
    where = {id(b): i for i, b in enumerate(order)}
    last_common = max(where[id(w.controls[n])] for n in common)
    assert last_common < where[id(w.readout)] < where[id(w.free_button)] < where[id(advanced)]
    # the API's order and ids are the table's, whatever the layout
    assert [c.elem_id for c in w.inputs[1:]] == [f"vram_guard_txt2img_{n}" for n in O.API_ARG_ORDER[1:]]
    assert w.inputs == [w.controls[n] for n in O.API_ARG_ORDER]
