"""The options model and its one table: validation, API args, settings defaults, infotext."""

from __future__ import annotations

import dataclasses
import json
import logging
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lib_vram.webui import options as O
from lib_vram.webui.options import FIELDS, VRAMGuardOptions

# The WebUI's infotext parser (modules/infotext_utils.py, v1.10.1), restated from host-api.md §1.8:
# a key is `\w[\w \-/]+`, a value is a JSON string or runs to the next comma.
PARAM_RE = re.compile(r'\s*(\w[\w \-/]+):\s*("(?:\\.|[^\\"])+"|[^,]*)(?:,|$)')
INFOTEXT_KEY_RE = re.compile(r"^\w[\w \-/]+$")
"""What that parser accepts as a key."""


def webui_quote(value: str) -> str:
    text = str(value)
    if "," not in text and "\n" not in text and ":" not in text:
        return text
    return json.dumps(text, ensure_ascii=False)


def webui_parse(line: str) -> dict[str, str]:
    out = {}
    for key, value in PARAM_RE.findall(line):
        if value and value[0] == '"' and value[-1] == '"':
            value = json.loads(value)
        out[key] = value
    return out


def write_line(entries: dict[str, str]) -> str:
    base = {"Steps": "20", "Sampler": "Euler a", "Size": "512x512"}
    return ", ".join(f"{k}: {webui_quote(v)}" for k, v in {**base, **entries}.items())


options_strategy = st.builds(
    VRAMGuardOptions,
    enabled=st.booleans(),
    preset=st.sampled_from(O.PRESET_CHOICES),
    vae_tiling=st.sampled_from(O.VAE_TILING_CHOICES),
    vae_mode=st.sampled_from(O.VAE_MODE_CHOICES),
    vae_tile=st.integers(0, 32).map(lambda i: i * 16),
    upscale_tiling=st.booleans(),
    upscale_tile=st.integers(0, 64).map(lambda i: i * 32),
    upscale_batch=st.integers(0, 64),
    precision_vae=st.sampled_from(O.PRECISION_CHOICES),
    precision_upscale=st.sampled_from(O.PRECISION_CHOICES),
    unet_fp16=st.booleans(),
    release_between_stages=st.booleans(),
    guard_sampling=st.booleans(),
)


@pytest.fixture
def options_log():
    """Messages of lib_vram.webui.options, caught on that logger itself: another test may have called
    lib_vram.core.log.configure(), which stops propagation to the root logger (and so to caplog)."""

    class Catch(logging.Handler):
        def __init__(self):
            super().__init__(logging.DEBUG)
            self.messages = []

        def emit(self, record):
            self.messages.append(record.getMessage())

    handler = Catch()
    logger = logging.getLogger("lib_vram.webui.options")
    logger.addHandler(handler)
    try:
        yield handler.messages
    finally:
        logger.removeHandler(handler)


def test_table_matches_dataclass():
    names = [f.name for f in dataclasses.fields(VRAMGuardOptions)]
    assert list(O.API_ARG_ORDER) == names
    assert [f.name for f in FIELDS] == names
    for f in FIELDS:
        assert getattr(VRAMGuardOptions(), f.name) == f.default, f.name
        f.coerce(f.default)
        assert f.settings_key == f"vram_guard_{f.name}"
        assert f.tooltip and f.label
        assert f.infotext in ("VRAM Guard", "preset", "VAE", "upscale", "UNet", "release", "sampling")
    labels = [f.label for f in FIELDS]
    assert len(set(labels)) == len(labels), "labels key ui-config.json: they must be unique"


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("enabled", "yes"),
        ("enabled", 2),
        ("preset", "5GB"),
        ("vae_tiling", "sometimes"),
        ("vae_mode", 1),
        ("vae_tile", 8),
        ("vae_tile", 528),
        ("vae_tile", -16),
        ("vae_tile", 64.5),
        ("vae_tile", True),
        ("upscale_tile", 100),
        ("upscale_batch", 65),
        ("precision_vae", "fp8"),
        ("unet_fp16", None),
    ],
)
def test_bad_values_name_the_field(field, value):
    with pytest.raises(ValueError, match=f"`{field}`"):
        VRAMGuardOptions(**{field: value})


def test_from_args_positional_and_none_and_short():
    opts = O.from_args([True, "6GB", "always", None, 64.0, "False", "192", "Auto"])
    assert opts.enabled and opts.preset == "6GB" and opts.vae_tiling == "Always"
    assert opts.vae_mode == "exact" and opts.vae_tile == 64
    assert opts.upscale_tiling is False and opts.upscale_tile == 192 and opts.upscale_batch == 0
    assert O.from_args([None] * len(FIELDS)) == VRAMGuardOptions()
    assert O.from_args(None) == VRAMGuardOptions()
    custom = VRAMGuardOptions(vae_mode="fast")
    assert O.from_args([True], defaults=custom) == custom.replace(enabled=True)
    assert O.from_args(VRAMGuardOptions(preset="8GB").args()).preset == "8GB"


def test_from_args_name_keyed():
    ui_defaults = VRAMGuardOptions().args()[1:]  # what the API leaves in the other slots
    opts = O.from_args([{"preset": "4GB", "vae_tile": 32, "precision_upscale": "fp16"}, *ui_defaults])
    assert opts.enabled is True
    assert (opts.preset, opts.vae_tile, opts.precision_upscale) == ("4GB", 32, "FP16")
    assert O.from_args([{"enabled": False}]).enabled is False
    with pytest.raises(ValueError, match="`vae_tiles`"):
        O.from_args([{"vae_tiles": 64}])


def test_from_args_errors():
    with pytest.raises(ValueError, match="`args`"):
        O.from_args([False] * (len(FIELDS) + 1))
    with pytest.raises(ValueError, match="`vae_tile`"):
        O.from_args([True, "Auto", "Auto", "exact", "big"])
    with pytest.raises(ValueError, match="`args`"):
        O.from_args("6GB")


def test_defaults_from_settings_reads_every_key_and_survives_stale_values(options_log):
    stored = {"vram_guard_preset": "8GB", "vram_guard_vae_tile": 96.0, "vram_guard_vae_mode": "blurry"}
    asked = []

    def getter(key, default):
        asked.append(key)
        return stored.get(key, default)

    opts = O.defaults_from_settings(getter)
    assert asked == [f.settings_key for f in FIELDS]
    assert opts.preset == "8GB" and opts.vae_tile == 96
    assert opts.vae_mode == "exact"
    assert any("vram_guard_vae_mode" in m for m in options_log)


@settings(max_examples=150, deadline=None)
@given(options_strategy)
def test_infotext_round_trip_through_the_webui_parser(opts):
    entries = O.to_infotext(opts, plans={"vae_decode": "exact t64", "hires_upscale": "t192 fp16, b4"})
    if not opts.enabled:
        assert entries == {}
        return
    for key, value in entries.items():
        assert INFOTEXT_KEY_RE.match(key), key
        assert "\n" not in value
    params = webui_parse(write_line(entries))
    assert params["Steps"] == "20" and params["Size"] == "512x512"
    back = O.from_infotext(params)
    assert back == opts.to_dict()
    for f in FIELDS:
        assert O.infotext_getter(f.name)(params) == getattr(opts, f.name)


def test_infotext_example_and_absent_key():
    opts = VRAMGuardOptions(
        enabled=True, preset="6GB", vae_tile=64, upscale_tile=192, precision_upscale="FP16"
    )
    assert O.to_infotext(opts)["VRAM Guard"] == "preset 6GB, VAE auto exact t64, upscale on t192 fp16"
    assert O.from_infotext({"Steps": "20"}) == {}
    assert O.infotext_getter("enabled")({"Steps": "20"}) is None
    # A real bool, not the string "True" (the API infotext path needs it).
    assert O.infotext_getter("enabled")({"VRAM Guard": "preset Auto"}) is True
    assert O.infotext_getter("release_between_stages")({"VRAM Guard": "preset Auto, release off"}) is False
    assert O.infotext_getter("guard_sampling")({"VRAM Guard": "preset Auto, sampling off"}) is False
    assert O.infotext_getter("guard_sampling")({"VRAM Guard": "preset Auto"}) is True


def test_infotext_unknown_words_are_skipped_not_fatal(options_log):
    got = O.from_infotext({"VRAM Guard": "preset 6GB, VAE always t7 zz, warp 9, upscale off"})
    assert got["preset"] == "6GB" and got["vae_tiling"] == "Always" and got["vae_tile"] == 0
    assert got["upscale_tiling"] is False
    text = " ".join(options_log)
    assert "t7" in text and "warp 9" in text


def test_settings_component_args():
    assert O.FIELDS_BY_NAME["preset"].component_args() == {"choices": list(O.PRESET_CHOICES)}
    assert O.FIELDS_BY_NAME["vae_tile"].component_args() == {"minimum": 0, "maximum": 512, "step": 16}
    assert O.FIELDS_BY_NAME["enabled"].component_args() == {}


def test_preset_names_match_planner_presets():
    from lib_vram.planning import presets

    assert presets.PRESET_NAMES == O.PRESET_NAMES
    assert ("Auto", *presets.PRESETS) == O.PRESET_NAMES
    assert (*presets.PRESET_NAMES, "Custom") == O.PRESET_CHOICES
    for name in O.PRESET_NAMES:
        presets.resolve_preset(name, total_bytes=6 * 1024**3)
