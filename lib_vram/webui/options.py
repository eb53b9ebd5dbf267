"""VRAM Guard's user options: one validated model and one table that drives everything else.

:class:`VRAMGuardOptions` is what a generation runs with. :data:`FIELDS` describes every option
once (short label, default, choices or range, settings key, infotext group, hover hint, the
Settings page's line); the gradio accordion (:mod:`lib_vram.webui.ui`), the Settings page
(registered by the host adapter), the infotext and the API (``alwayson_scripts``) are all built
from it, so they cannot drift apart.

Pure: no gradio, no WebUI imports.

The infotext entry ``VRAM Guard`` (segments and their words: docs/webui.md, "Infotext") states
every option, independent of anybody's defaults: a missing ``t``/``b``/precision word means Auto, a
missing ``UNet``/``release``/``sampling`` segment means its default. The value contains commas, so
the WebUI JSON-quotes it on write and unquotes it on read.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

PRESET_NAMES: tuple[str, ...] = ("Auto", "4GB", "6GB", "8GB", "12GB", "16GB", "24GB+")
"""Names of the memory presets (``lib_vram.planning.presets.PRESETS`` has the same names, tested)."""
PRESET_CHOICES: tuple[str, ...] = (*PRESET_NAMES, "Custom")
"""What the preset control offers: the presets plus ``"Custom"`` (only the controls count)."""
VAE_TILING_CHOICES: tuple[str, ...] = ("Auto", "Always", "Off")
VAE_MODE_CHOICES: tuple[str, ...] = ("exact", "fast")
PRECISION_CHOICES: tuple[str, ...] = ("Auto", "FP16", "BF16", "FP32")

INFOTEXT_KEY = "VRAM Guard"
"""The summary infotext key (also the script's title)."""
INFOTEXT_PLAN_KEY = "VRAM Guard plan"
"""Optional informational key: the plan each stage used."""
SETTINGS_PREFIX = "vram_guard_"

BOOL = "bool"
CHOICE = "choice"
INT = "int"


@dataclass(frozen=True)
class OptionField:
    """One user option, described once for the UI, the settings page, the infotext and the API."""

    name: str
    """Field name in :class:`VRAMGuardOptions`, keyword in the name-keyed API form."""
    label: str
    """Visible label: short, one line (unique: the WebUI's ``ui-config.json`` keys on it)."""
    default: Any
    choices: tuple[str, ...] | None = None
    """Allowed values of a ``"choice"``."""
    range: tuple[int, int, int] | None = None
    """``(minimum, maximum, step)`` of an ``"int"``; values must lie on the step grid from minimum."""
    auto_zero: bool = False
    """For ints: 0 means "Auto" (chosen by the planner)."""
    infotext: str = ""
    """Infotext group word of the summary entry (see the module docstring); ``"VRAM Guard"`` for
    the enable switch, whose presence is the key itself."""
    tooltip: str = ""
    """The control's hover hint (the WebUI's way: short label, hint on hover): what it does and when."""
    info: str = ""
    """One line in the user's terms under the option's label on the Settings page: what and when."""

    @property
    def kind(self) -> str:
        """``"choice"`` (dropdown/radio) with choices, ``"int"`` (slider) with a range, else ``"bool"``."""
        if self.choices:
            return CHOICE
        return INT if self.range else BOOL

    @property
    def settings_key(self) -> str:
        """Key of the Settings-page default for this option (``shared.opts.<key>``)."""
        return SETTINGS_PREFIX + self.name

    @property
    def settings_label(self) -> str:
        return f"Default: {self.label}" if self.name != "enabled" else "Enable VRAM Guard by default"

    def component_args(self) -> dict[str, Any]:
        """gradio keyword arguments for a settings component (``OptionInfo(component_args=...)``)."""
        if self.kind == CHOICE:
            return {"choices": list(self.choices or ())}
        if self.kind == INT:
            lo, hi, step = self.range or (0, 0, 1)
            return {"minimum": lo, "maximum": hi, "step": step}
        return {}

    def coerce(self, value: Any) -> Any:
        """Convert an API/UI/settings value to this field's type and check it.

        Accepts what the front ends produce: gradio sliders may send ``64.0``, the API ``"64"``,
        ``"Auto"`` for an auto int, ``"true"``/``"False"`` for a bool, and case variants of a
        choice. Raises ``ValueError`` naming the field for anything else; never clamps.
        """
        name = self.name
        if self.kind == BOOL:
            if isinstance(value, bool):
                return value
            if isinstance(value, int) and value in (0, 1):
                return bool(value)
            if isinstance(value, str) and value.strip().lower() in ("true", "false"):
                return value.strip().lower() == "true"
            raise ValueError(f"`{name}` must be a bool, got {value!r}")
        if self.kind == CHOICE:
            if isinstance(value, str):
                for choice in self.choices or ():
                    if value.strip().lower() == choice.lower():
                        return choice
            raise ValueError(f"`{name}` must be one of {list(self.choices or ())}, got {value!r}")
        # INT
        orig = value
        if isinstance(value, str):
            text = value.strip()
            if self.auto_zero and text.lower() == "auto":
                value = 0
            else:
                try:
                    value = float(text)
                except ValueError:
                    raise ValueError(f"`{name}` must be an integer, got {orig!r}") from None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"`{name}` must be an integer, got {orig!r}")
        if isinstance(value, float):
            if not math.isfinite(value) or value != int(value):
                raise ValueError(f"`{name}` must be an integer, got {orig!r}")
            value = int(value)
        self.check_int(value)
        return value

    def check_int(self, value: int) -> None:
        lo, hi, step = self.range or (0, 0, 1)
        auto = " (0 = Auto)" if self.auto_zero else ""
        if not lo <= value <= hi or (value - lo) % step:
            raise ValueError(f"`{self.name}` must be in {lo}..{hi} in steps of {step}{auto}, got {value!r}")


FIELDS: tuple[OptionField, ...] = (
    OptionField(
        "enabled",
        "VRAM Guard",
        False,
        infotext=INFOTEXT_KEY,
        tooltip="Turn VRAM Guard on for this tab when its jobs run out of GPU memory: tiled VAE, tiled "
        "upscaling, a check before each sampling pass, precision control and memory release between "
        "stages. Off, the WebUI runs exactly as without VRAM Guard.",
        info="Turn on when this tab's jobs run out of GPU memory; off, the WebUI runs exactly as "
        "without VRAM Guard.",
    ),
    OptionField(
        "preset",
        "Memory preset",
        "Auto",
        choices=PRESET_CHOICES,
        infotext="preset",
        tooltip="The card to plan for. Auto reads this card's memory at each job; a size (e.g. 6GB) "
        "plans for a card of that size: pick a smaller one if a job still runs out of memory; Custom "
        "uses only the controls. Controls left on Auto (under Advanced) follow the preset.",
        info="The card to plan for: Auto reads yours at each job; pick a smaller size if a job still "
        "runs out of memory.",
    ),
    OptionField(
        "vae_tiling",
        "Tiled VAE",
        "Auto",
        choices=VAE_TILING_CHOICES,
        infotext="VAE",
        tooltip="Auto tiles the VAE decode/encode only when the whole image would not fit in free "
        "memory; Always tiles every time (if Auto still runs out of memory); Off never tiles.",
        info="Auto tiles the VAE only when the image would not fit; Always if Auto still runs out; "
        "Off never tiles.",
    ),
    OptionField(
        "vae_mode",
        "Tiled VAE mode",
        "exact",
        choices=VAE_MODE_CHOICES,
        infotext="VAE",
        tooltip="exact: same picture as the untiled VAE (shared normalisation statistics, a few % "
        "slower); fast: one pass with estimated statistics: no seams, but not the untiled picture "
        "(25-47 dB against it, depending on the VAE and the image; a little faster).",
        info="exact gives the untiled VAE's picture; fast is a little quicker but not the same "
        "picture (25-47 dB).",
    ),
    OptionField(
        "vae_tile",
        "VAE tile size",
        0,
        range=(0, 512, 16),
        auto_zero=True,
        infotext="VAE",
        tooltip="VAE tile edge in latent pixels (x8 in image pixels). 0 = Auto: the largest tile that "
        "fits in free memory. Smaller tiles need less memory and take a little longer.",
        info="Smaller tiles need less memory and take a little longer; 0 = the largest that fits "
        "(latent px, x8 on the image).",
    ),
    OptionField(
        "upscale_tiling",
        "Tiled upscaling",
        True,
        infotext="upscale",
        tooltip="Run ESRGAN-family upscalers tile by tile on the GPU (hires fix, img2img resize, SD "
        "upscale), in tiles that fit, without seams, retrying with smaller tiles on out-of-memory. Off "
        "uses the WebUI's own upscaling.",
        info="Run ESRGAN-family upscalers in tiles that fit (hires fix, img2img resize, SD upscale); "
        "off uses the WebUI's own.",
    ),
    OptionField(
        "upscale_tile",
        "Upscale tile size",
        0,
        range=(0, 2048, 32),
        auto_zero=True,
        infotext="upscale",
        tooltip="Upscaler tile edge in input pixels. 0 = Auto: chosen from free memory. Smaller tiles "
        "need less memory.",
        info="Smaller tiles need less memory; 0 = chosen from free memory (input px).",
    ),
    OptionField(
        "upscale_batch",
        "Upscale batch size",
        0,
        range=(0, 64, 1),
        auto_zero=True,
        infotext="upscale",
        tooltip="How many tiles go through the upscaler at once: fewer need less memory, more run "
        "faster. 0 = Auto: chosen from free memory.",
        info="Tiles per upscaler pass: fewer need less memory, more run faster; 0 = chosen from free memory.",
    ),
    OptionField(
        "precision_vae",
        "VAE precision",
        "Auto",
        choices=PRECISION_CHOICES,
        infotext="VAE",
        tooltip="Auto keeps the WebUI's choice (BF16 where the card supports it on small cards). "
        "FP16/BF16 halve the VAE's memory; tiles that overflow are recomputed in a wider type. Choose "
        "BF16 or FP16 if you get black or NaN images.",
        info="FP16/BF16 halve the VAE's memory; choose BF16 or FP16 if you get black or NaN images; "
        "Auto keeps the WebUI's.",
    ),
    OptionField(
        "precision_upscale",
        "Upscaler precision",
        "Auto",
        choices=PRECISION_CHOICES,
        infotext="upscale",
        tooltip="FP16/BF16 halve the upscaler's memory. Auto uses them when the model supports them, "
        "else FP32; batches with NaN/Inf are recomputed in FP32.",
        info="FP16/BF16 halve the upscaler's memory; Auto uses them where the model supports them, "
        "else FP32.",
    ),
    OptionField(
        "unet_fp16",
        "FP16 UNet",
        False,
        infotext="UNet",
        tooltip="Run the UNet in FP16 for the job when the WebUI would run it in FP32 (e.g. --no-half): "
        "halves its memory. Use it when sampling runs out of memory.",
        info="Halves the UNet's memory for the job when the WebUI runs it in FP32 (--no-half); use "
        "it when sampling runs out.",
    ),
    OptionField(
        "release_between_stages",
        "Free memory between stages",
        True,
        infotext="release",
        tooltip="Collect garbage and return cached GPU memory between sampling, hires fix, decode and "
        "postprocessing. Costs milliseconds; keep it on.",
        info="Frees unused GPU memory between sampling, hires fix and decode; costs milliseconds, "
        "keep it on.",
    ),
    OptionField(
        "guard_sampling",
        "Guard sampling",
        True,
        infotext="sampling",
        info="Checks each sampling pass fits before it runs: smaller batches, idle models off the card, "
        "or a clear stop. Keep it on.",
        tooltip="Before each sampling pass, check that it fits: when it does not, run the batch in "
        "smaller pieces (same picture) or move the VAE and text encoders off the card for the pass; "
        "when nothing fits, stop before sampling with what would fit instead of running out of memory. "
        "Keep it on.",
    ),
)

FIELDS_BY_NAME: dict[str, OptionField] = {f.name: f for f in FIELDS}

API_ARG_ORDER: tuple[str, ...] = tuple(f.name for f in FIELDS)
"""Field names in the order ``ui()`` returns its components (= positional API ``args``)."""

EXTRAS_FIELDS: tuple[str, ...] = (
    "enabled",
    "upscale_tile",
    "upscale_batch",
    "precision_upscale",
    "release_between_stages",
)
"""Keys (= keyword names of ``ScriptPostprocessing.process``) of the Extras section, in order."""


@dataclass(frozen=True)
class VRAMGuardOptions:
    """Everything a VRAM Guard job is configured with (validated; errors name the field)."""

    enabled: bool = False
    preset: str = "Auto"
    vae_tiling: str = "Auto"
    vae_mode: str = "exact"
    vae_tile: int = 0
    upscale_tiling: bool = True
    upscale_tile: int = 0
    upscale_batch: int = 0
    precision_vae: str = "Auto"
    precision_upscale: str = "Auto"
    unet_fp16: bool = False
    release_between_stages: bool = True
    guard_sampling: bool = True

    def __post_init__(self) -> None:
        for f in FIELDS:
            value = getattr(self, f.name)
            if f.kind == BOOL:
                if not isinstance(value, bool):
                    raise ValueError(f"`{f.name}` must be a bool, got {value!r}")
            elif f.kind == CHOICE:
                if value not in (f.choices or ()):
                    raise ValueError(f"`{f.name}` must be one of {list(f.choices or ())}, got {value!r}")
            else:
                if isinstance(value, bool) or not isinstance(value, int):
                    raise ValueError(f"`{f.name}` must be an int, got {value!r}")
                f.check_int(value)

    def replace(self, **changes: Any) -> VRAMGuardOptions:
        """A copy with ``changes`` applied (coerced like API values, then validated)."""
        for key, value in changes.items():
            field = FIELDS_BY_NAME.get(key)
            if field is None:
                raise ValueError(f"unknown VRAM Guard option `{key}`; known: {list(API_ARG_ORDER)}")
            changes[key] = field.coerce(value)
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in FIELDS}

    def args(self) -> list[Any]:
        """Positional script args in :data:`API_ARG_ORDER`."""
        return [getattr(self, name) for name in API_ARG_ORDER]


def from_args(args: Sequence[Any] | None, *, defaults: VRAMGuardOptions | None = None) -> VRAMGuardOptions:
    """Build options from script args (UI, API ``alwayson_scripts``, Extras).

    * Positional: values in :data:`API_ARG_ORDER`; fewer values than fields leave the rest at
      ``defaults``; ``None`` at a position means "the default" (the Extras API passes ``None``).
    * Name-keyed: a ``dict`` as the **first** arg, e.g. ``[{"preset": "6GB", "vae_tile": 64}]``;
      keys are field names, missing keys take ``defaults``, ``enabled`` defaults to ``True`` in
      this form (asking for options means wanting them). Any further args are ignored: the API
      fills the remaining slots with the UI's default values.
    * ``None`` or ``[]``: ``defaults``.

    Raises ``ValueError`` naming the field for a bad value, an unknown key or too many args.
    """
    base = defaults if defaults is not None else VRAMGuardOptions()
    if args is None:
        return base
    if isinstance(args, (str, bytes)) or not isinstance(args, Sequence):
        raise ValueError(f"`args` must be a sequence of values or a dict first, got {type(args).__name__}")
    if len(args) == 0:
        return base
    first = args[0]
    if isinstance(first, Mapping):
        changes = {k: v for k, v in first.items() if v is not None}
        for key in changes:
            if not isinstance(key, str):
                raise ValueError(f"VRAM Guard option names must be strings, got `{key!r}`")
        changes.setdefault("enabled", True)
        return base.replace(**changes)
    if len(args) > len(API_ARG_ORDER):
        raise ValueError(
            f"`args` has {len(args)} values but VRAM Guard takes {len(API_ARG_ORDER)}: {list(API_ARG_ORDER)}"
        )
    changes = {name: value for name, value in zip(API_ARG_ORDER, args) if value is not None}
    return base.replace(**changes)


def defaults_from_settings(getter: Callable[[str, Any], Any]) -> VRAMGuardOptions:
    """The Settings page's defaults: ``getter(f"vram_guard_{name}", default)`` for every field.

    A stored value that is no longer valid (e.g. from an older version) is logged and replaced by
    the built-in default, so a stale ``config.json`` cannot break generation.
    """
    values = {}
    for f in FIELDS:
        raw = getter(f.settings_key, f.default)
        try:
            values[f.name] = f.coerce(raw)
        except ValueError as exc:
            logger.warning("VRAM Guard: setting %s ignored (%s); using %r", f.settings_key, exc, f.default)
            values[f.name] = f.default
    return VRAMGuardOptions(**values)


# -- infotext -------------------------------------------------------------------------------------

_PRECISION_WORDS = {p.lower(): p for p in PRECISION_CHOICES if p != "Auto"}
_INT_WORD = re.compile(r"^([tb])(\d+)$")


def summary(opts: VRAMGuardOptions) -> str:
    """The value of the ``VRAM Guard`` infotext entry (see the module docstring)."""
    up = "on" if opts.upscale_tiling else "off"
    parts = [
        f"preset {opts.preset}",
        _segment(["VAE", opts.vae_tiling.lower(), opts.vae_mode], opts.vae_tile, 0, opts.precision_vae),
        _segment(["upscale", up], opts.upscale_tile, opts.upscale_batch, opts.precision_upscale),
    ]
    if opts.unet_fp16:
        parts.append("UNet fp16")
    if not opts.release_between_stages:
        parts.append("release off")
    if not opts.guard_sampling:
        parts.append("sampling off")
    return ", ".join(parts)


def _segment(head: list[str], tile: int, batch: int, precision: str) -> str:
    """A VAE/upscale segment: the words of ``head``, then only what is not Auto."""
    tail = [f"t{tile}" if tile else "", f"b{batch}" if batch else "", precision.lower()]
    return " ".join(head + [w for w in tail if w and w != "auto"])


_STAGE_LABELS = {
    "sampling": "sampling",
    "hires_sampling": "hires sampling",
    "hires_upscale": "hires upscale",
    "hires_encode": "hires encode",
    "vae_encode": "encode",
    "vae_decode": "decode",
    "decode": "decode",
    "postprocess": "postprocess",
}


def to_infotext(opts: VRAMGuardOptions, *, plans: Mapping[str, str] | None = None) -> dict[str, str]:
    """Infotext entries for ``p.extra_generation_params`` (empty when disabled).

    ``plans`` maps a stage name (``"vae_decode"``, ``"hires_upscale"``, ...) to the plan it used
    (``"exact t64"``); they go into the informational ``VRAM Guard plan`` entry.
    """
    if not opts.enabled:
        return {}
    out = {INFOTEXT_KEY: summary(opts)}
    if plans:
        items = [  # (on one line: a newline would end the infotext's parameter line)
            f"{_STAGE_LABELS.get(stage, stage.replace('_', ' '))} {' '.join(str(plan).split())}"
            for stage, plan in plans.items()
            if plan
        ]
        if items:
            out[INFOTEXT_PLAN_KEY] = "; ".join(items)
    return out


def from_infotext(params: Mapping[str, Any]) -> dict[str, Any]:
    """Field values stated by a parsed infotext (``parse_generation_parameters`` output).

    Returns ``{}`` when there is no ``VRAM Guard`` entry (leave the accordion unchanged), else
    ``enabled=True`` plus every field the entry states. Words that are not understood (a newer
    version's, a typo) are logged and skipped; the rest still applies.
    """
    raw = params.get(INFOTEXT_KEY)
    if raw is None:
        return {}
    text = str(raw).strip()
    if len(text) >= 2 and text[0] == '"' and text[-1] == '"':
        text = text[1:-1]
    out: dict[str, Any] = {"enabled": True}
    bad: list[str] = []
    for segment in text.split(","):
        words = segment.split()
        if not words:
            continue
        group, rest = words[0], words[1:]
        if group == "preset" and len(rest) == 1 and rest[0] in PRESET_CHOICES:
            out["preset"] = rest[0]
        elif group in ("VAE", "upscale"):
            _parse_group(group, rest, out, bad)
        elif group == "UNet" and rest == ["fp16"]:
            out["unet_fp16"] = True
        elif group in _SWITCHES and len(rest) == 1 and rest[0] in ("on", "off"):
            out[_SWITCHES[group]] = rest[0] == "on"
        else:
            bad.append(segment.strip())
    out.setdefault("unet_fp16", False)
    out.setdefault("release_between_stages", True)
    out.setdefault("guard_sampling", True)
    if bad:
        logger.warning("VRAM Guard: infotext words not understood, skipped: %s", bad)
    return out


_SWITCHES = {"release": "release_between_stages", "sampling": "guard_sampling"}
_INTS = {"VAE": {"t": "vae_tile"}, "upscale": {"t": "upscale_tile", "b": "upscale_batch"}}


def _parse_group(group: str, words: list[str], out: dict[str, Any], bad: list[str]) -> None:
    """The words of a ``VAE`` or ``upscale`` segment into ``out`` (a missing int or precision: Auto)."""
    ints = _INTS[group]
    precision = "precision_vae" if group == "VAE" else "precision_upscale"
    for name in ints.values():
        out.setdefault(name, 0)
    out.setdefault(precision, "Auto")
    for word in words:
        m = _INT_WORD.match(word)
        if group == "VAE" and word in ("auto", "always", "off"):
            out["vae_tiling"] = word.capitalize()
        elif group == "VAE" and word in VAE_MODE_CHOICES:
            out["vae_mode"] = word
        elif group == "upscale" and word in ("on", "off"):
            out["upscale_tiling"] = word == "on"
        elif word in _PRECISION_WORDS:
            out[precision] = _PRECISION_WORDS[word]
        elif m and m.group(1) in ints:
            try:
                out[ints[m.group(1)]] = FIELDS_BY_NAME[ints[m.group(1)]].coerce(int(m.group(2)))
            except ValueError:
                bad.append(word)
        else:
            bad.append(f"{group} {word}")


def infotext_getter(name: str) -> Callable[[Mapping[str, Any]], Any]:
    """A paste target for field ``name``: ``f(params) -> value | None`` (``None`` = leave as is).

    Returns real Python values (a real ``bool``), which the WebUI's API ``infotext`` path needs
    (it converts with ``type(value)(v)``, which would turn the string ``"False"`` into ``True``).
    """
    if name not in FIELDS_BY_NAME:
        raise ValueError(f"unknown VRAM Guard option `{name}`")

    def get(params: Mapping[str, Any]) -> Any:
        return from_infotext(params).get(name)

    get.__name__ = f"vram_guard_infotext_{name}"
    return get


def extras_options(kwargs: Mapping[str, Any], defaults: VRAMGuardOptions) -> VRAMGuardOptions:
    """Options for one Extras run from ``process(pp, **kwargs)``.

    ``None`` values (the Extras API passes ``None`` for every non-built-in operation) and missing
    keys take ``defaults``. Tiled upscaling is what the section does, so ``upscale_tiling`` is on.
    """
    for key in kwargs:
        if key not in EXTRAS_FIELDS:
            raise ValueError(f"unknown Extras option `{key}`; known: {list(EXTRAS_FIELDS)}")
    return defaults.replace(upscale_tiling=True, **{k: v for k, v in kwargs.items() if v is not None})
