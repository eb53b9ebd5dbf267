"""A stage's plan in words a WebUI user knows, for the readout's stage table (pure).

The engines and the WebUI adapter record a short plan per stage (``StageRecord.plan``): the tiled
upscale engine ``"tiled t512 o32 f16 b4 float16 acc=cuda"`` or ``"whole b1 float32 acc=cpu"``, the
tiled VAE ``"exact t64 x6"`` or ``"untiled"``, the sampling guard its pass label (``"micro-batch 1 of
2 (predicted 1704 MiB)"``, ``"UNet streamed: 1474 of 3279 MiB resident, batch 2 in one forward"``),
the adapter a suffix (``" after OOM"``, ``", VAE off the card"``). Those strings stay what the
status route, the infotext and the benchmarks carry; :func:`plan_words` says them for the readout:
``"whole image at once, FP32, picture assembled in RAM"``, ``"6 tiles of 512 px, exact mode"``,
``"batch of 2 in parts, 1 at a time"``.

Table-driven: :data:`PLAN_PHRASES` maps each comma-separated part of a plan (a regular expression
matching all of it) to its words; a part no entry matches is shown as it is.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable

DTYPE_WORDS = {
    "float32": "FP32",
    "fp32": "FP32",
    "float16": "FP16",
    "fp16": "FP16",
    "bfloat16": "BF16",
    "bf16": "BF16",
}
"""A plan's dtype as the WebUI's settings name it."""

WHERE_WORDS = {"cpu": "in RAM", "cuda": "on the card", "xpu": "on the card", "mps": "on the card"}
"""Where the upscale engine assembles its output picture (``acc=<device type>``)."""

OOM_SUFFIX = " after OOM"
OOM_WORDS = "retried after running out of memory"


def _dtype(name: str | None) -> str:
    return "" if not name else DTYPE_WORDS.get(name, name)


def _upscale(m: re.Match[str]) -> str:
    """``tiled t512 o32 f16 b4 float16 acc=cuda [inexact]`` / ``whole b1 float32 acc=cpu``."""
    batch = int(m["batch"])
    if m["tile"]:
        at_once = f"{batch} at a time" if not m["one"] else f"1 at a time ({m['one']})"
        parts = [f"tiles of {m['tile']} px", at_once]
    else:
        parts = ["whole image at once"] + ([f"{batch} at a time"] if batch > 1 else [])
    parts.append(_dtype(m["dtype"]))
    parts.append(f"picture assembled {WHERE_WORDS.get(m['acc'], 'on ' + m['acc'])}")
    if m["inexact"]:
        parts.append("tiles not exactly the untiled picture")
    return ", ".join(parts)


def _vae(m: re.Match[str]) -> str:
    """``exact t64 x6`` (tile in latent pixels: x8 on the image), ``fast t32``, ``exact t64 bf16``."""
    n = int(m["tiles"]) if m["tiles"] else 0
    size = f"of {int(m['tile']) * 8} px"
    head = f"{n} tile{'s' if n != 1 else ''} {size}" if n else f"tiles {size}"
    return ", ".join(p for p in (head, f"{m['mode']} mode", _dtype(m["dtype"])) if p)


_DT = "|".join(DTYPE_WORDS)
PLAN_PHRASES: tuple[tuple[re.Pattern[str], Callable[[re.Match[str]], str]], ...] = (
    (
        re.compile(
            r"(?:whole|tiled t(?P<tile>\d+) o\d+ f\d+) b(?P<batch>\d+)(?: \((?P<one>[^)]*)\))? "
            r"(?P<dtype>\w+) acc=(?P<acc>\w+)(?P<inexact> inexact)?"
        ),
        _upscale,
    ),
    (re.compile(rf"(?P<mode>exact|fast) t(?P<tile>\d+)(?: x(?P<tiles>\d+))?(?: (?P<dtype>{_DT}))?"), _vae),
    (re.compile(r"batch (?P<n>\d+)(?: in one forward)?"), lambda m: f"batch of {m['n']} at once"),
    (
        re.compile(r"micro-batch (?P<m>\d+) of (?P<n>\d+)"),
        lambda m: f"batch of {m['n']} in parts, {m['m']} at a time",
    ),
    (
        re.compile(r"UNet streamed: (?P<kept>\d+) of (?P<all>\d+) MiB resident"),
        lambda m: f"UNet streamed, {m['kept']} of {m['all']} MiB kept on the card",
    ),
)
"""(a plan part's full match, its words); first match wins."""

_PREDICTED = re.compile(r"\s*\((predicted \d+ MiB)\)$")


def plan_words(plan: str | None, *, said: Iterable[str] = ()) -> str:
    """``plan`` in words (see the module docstring); ``said``: texts the readout shows elsewhere
    (the checkpoint placement), left out of the plan. ``"—"`` when nothing is left."""
    text = str(plan or "").strip()
    for s in sorted((s for s in said if s), key=len, reverse=True):
        text = remove_phrase(text, s)
    predicted = ""
    if m := _PREDICTED.search(text):
        text, predicted = text[: m.start()], m.group(1)
    oom = text.endswith(OOM_SUFFIX)
    text = text.removesuffix(OOM_SUFFIX)
    parts = [_part(p) for p in text.split(", ") if p]
    if oom:
        parts.append(OOM_WORDS)
    words = ", ".join(parts)
    if predicted:
        words = f"{words} ({predicted})" if words else predicted
    return words or "—"


def strip_predicted(plan: str) -> str:
    """``plan`` without the sampling guard's ``" (predicted N MiB)"``."""
    return _PREDICTED.sub("", plan)


def _part(part: str) -> str:
    for pattern, say in PLAN_PHRASES:
        if m := pattern.fullmatch(part):
            return say(m)
    return part


def remove_phrase(text: str, phrase: str) -> str:
    """``text`` without ``phrase`` and the separator (``", "``, ``": "``, ``"; "``) before it (or,
    at the start, after it)."""
    while phrase and (i := text.find(phrase)) >= 0:
        j = i + len(phrase)
        before = text[:i]
        for sep in (", ", ": ", "; "):
            if before.endswith(sep):
                before = before[: -len(sep)]
                break
        after = text[j:]
        if not before:
            after = re.sub(r"^(?:, |: |; )", "", after)
        text = before + after
    return text.strip()
