"""The memory readout: a stable JSON payload and its HTML (pure; no gradio, no WebUI).

The host adapter serves :func:`status_payload` at ``GET /vram-guard/v1/status``; the accordion shows
:func:`render_readout_html` of the same payload; ``javascript/vram_guard.js`` polls the route while
a job runs and swaps in the payload's ``html``.

Payload keys (``schema`` 1; a change of meaning bumps ``schema``): docs/api.md, "Status route".
Beyond it: ``emulated`` is the emulated card's label (:mod:`lib_vram.core.emulate`) when ``memory``
describes one, else ``null``; ``stages`` come in pipeline order (:data:`KNOWN_STAGES`, then any
other stage in the order seen).
"""

from __future__ import annotations

import json
import os
import re
import urllib.parse
from collections.abc import Iterable, Mapping
from typing import Any

from .device import MemoryInfo
from .plan_words import plan_words, remove_phrase, strip_predicted
from .profiling import mib as _mib
from .timeline import _e, format_bytes, legend_html, render_svg

SCHEMA = 1
STATUS_ROUTE = "/vram-guard/v1/status"
UI_STATUS_ROUTE = "/internal/vram-guard/status"
"""The same payload for the page's readout: it follows the WebUI's UI access control (its Gradio
login, like the WebUI's own ``/internal/*`` routes), where ``STATUS_ROUTE`` follows the API's
(``--api-auth``)."""

KNOWN_STAGES: tuple[tuple[str, str], ...] = (
    ("encode", "Encode (img2img)"),
    ("img2img_upscale", "Img2img upscale"),
    ("sampling", "Sampling"),
    ("hires_decode", "Hires first decode"),
    ("hires_upscale", "Hires upscale"),
    ("hires_encode", "Hires encode"),
    ("hires_sampling", "Hires sampling"),
    ("decode", "Decode"),
    ("postprocess", "Postprocess"),
    ("ext_encode", "Extension's encode"),
    ("ext_sampling", "Extension's sampling"),
    ("ext_decode", "Extension's decode"),
    ("upscale", "Upscale (Extras)"),
    ("preview_decode", "Live preview decode"),
    ("other_encode", "Other encode"),
)
"""Every stage name the host adapter records, in pipeline order, with its label; stages not
listed here follow them in the order seen."""

STAGE_ALIASES: dict[str, str] = {
    "vae_decode": "decode",
    "hires_vae_encode": "hires_encode",
    "hires_upscaler": "hires_upscale",
    "postprocessing": "postprocess",
}
"""Tracker stage names that mean one of :data:`STAGES`."""

CPU_ONLY_NOTE = "CPU only: no GPU is in use, so VRAM Guard shows system RAM."
EMULATED_NOTE = (
    "Emulated card: {label} (--emulate-vram, or the WebUI's --vram-guard-emulate-vram); memory is "
    "counted and capped in software, not a real GPU."
)

_LABELS = dict(KNOWN_STAGES)
STAGES: tuple[tuple[str, str], ...] = tuple(
    (sid, _LABELS[sid]) for sid in ("sampling", "hires_upscale", "hires_encode", "decode", "postprocess")
)
"""The pipeline stages the readout lists after a generation job (ran or not), in order: (id, label)."""
_ORDER = {sid: i for i, (sid, _label) in enumerate(KNOWN_STAGES)}
_MEMORY_FIELDS = (  # the MemoryInfo readings the payload's "memory" carries, each as <name>_bytes
    "total", "used", "free", "allocated", "reserved", "process_rss", "system_total", "system_available",
)  # fmt: skip


def _stage_id(name: str) -> str:
    return STAGE_ALIASES.get(name, name)


def _as_dict(record: Any) -> Mapping[str, Any]:
    if isinstance(record, Mapping):
        return record
    to_dict = getattr(record, "to_dict", None)
    if callable(to_dict):
        return to_dict()
    raise ValueError(f"`records` items must be dicts or StageRecords, got {type(record).__name__}")


def _stages(records: Iterable[Any]) -> list[dict[str, Any]]:
    merged: dict[str, dict[str, Any]] = {}
    for raw in records:
        rec = _as_dict(raw)
        name = rec.get("name") or rec.get("stage")
        if not name:
            raise ValueError("every item of `records` needs a `name`")
        sid = _stage_id(str(name))
        peak = int(rec.get("peak_bytes") or 0)
        plan = rec.get("plan")
        entry = merged.get(sid)
        if entry is None:
            merged[sid] = {
                "stage": sid,
                "label": stage_label(sid),
                "peak_bytes": peak,
                "plan": None if plan is None else str(plan),
                "seconds": float(rec.get("seconds") or 0.0),
                "count": 1,
                "ok": bool(rec.get("ok", True)),
                "exact": bool(rec.get("exact", True)),
                "error": rec.get("error"),
            }
            continue
        # The stage ran again (batch count > 1): report its highest peak and that run's plan.
        entry["count"] += 1
        entry["seconds"] += float(rec.get("seconds") or 0.0)
        if peak >= entry["peak_bytes"]:
            entry["peak_bytes"] = peak
            entry["exact"] = bool(rec.get("exact", True))
            if plan is not None:
                entry["plan"] = str(plan)
        if not rec.get("ok", True):
            entry["ok"] = False
            entry["error"] = rec.get("error")
    # dicts keep insertion order; sorted() is stable, so unknown stages stay in the order seen.
    return sorted(merged.values(), key=lambda e: _ORDER.get(e["stage"], len(_ORDER)))


def status_payload(
    memory: MemoryInfo,
    records: Iterable[Any],
    *,
    job_running: bool,
    notes: Iterable[str] = (),
    device_name: str | None = None,
    timeline: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The readout's JSON (keys in the module docstring), including its rendered ``html``.

    ``records``: the last job's stage records (:class:`~lib_vram.core.tracker.StageRecord` or their
    ``to_dict()``); a stage that ran several times is merged (highest peak, summed time).
    ``timeline``: that job's :meth:`Timeline.to_dict() <lib_vram.core.timeline.Timeline.to_dict>`.
    """
    cpu_only = memory.backend == "cpu"
    emulated = getattr(memory, "emulated", None)
    note_list = [str(n) for n in notes]
    first = EMULATED_NOTE.format(label=emulated) if emulated else CPU_ONLY_NOTE if cpu_only else None
    if first is not None and first not in note_list:
        note_list.insert(0, first)
    payload: dict[str, Any] = {
        "schema": SCHEMA,
        "device": memory.device,
        "device_name": device_name,
        "backend": memory.backend,
        "cpu_only": cpu_only,
        "memory": {
            "basis": "emulated device memory" if emulated else "system RAM" if cpu_only else "device memory",
            **{f"{k}_bytes": getattr(memory, k) for k in _MEMORY_FIELDS},
        },
        "emulated": emulated,
        "job_running": bool(job_running),
        "stages": _stages(records),
        "notes": note_list,
        "timeline": None if timeline is None else dict(timeline),
    }
    payload["html"] = render_readout_body(payload)
    return payload


def _where(model: Mapping[str, Any], placed: bool = False) -> str:
    """``"card (160 MiB)"``, ``"CPU"`` (``"CPU until used"`` for a placed checkpoint's parked part),
    ``"streamed, 2168 of 3279 MiB on the card"``."""
    where = model.get("where")
    if where == "streamed":
        return f"streamed, {model.get('card_mib', 0):.0f} of {model.get('mib', 0):.0f} MiB on the card"
    if where == "card":
        return f"card ({model.get('mib', 0):.0f} MiB)"
    return "CPU until used" if placed else "CPU"


PLACED_PREFIX = "checkpoint placed"
"""How the checkpoint placement's status line (the payload's ``placement``) starts when it placed
the loaded checkpoint (:attr:`lib_vram.webui.placed.Placed.label`)."""
AT_LEAST_NOTE = (
    "≥ at least: the stage stayed below an earlier peak of the job, and VRAM Guard leaves the "
    "card's peak counter to the WebUI (it never resets it), so this is the highest value sampled "
    "during the stage."
)
"""The footnote of a peak marked "≥" (a record with ``exact=False``, :mod:`lib_vram.core.tracker`)."""


def render_readout_body(payload: Mapping[str, Any]) -> str:
    """The readout's inner HTML (everything escaped). Each thing is said once: the checkpoint
    placement in the "Models now" line (not in the plans or the notes), each stage's plan in words
    (:func:`~lib_vram.core.plan_words.plan_words`), and only the notes that say something the rest
    does not (:func:`readout_notes`)."""
    mem = payload.get("memory") or {}
    total = mem.get("total_bytes") or 0
    used = mem.get("used_bytes") or 0
    pct = 0.0 if not total else max(0.0, min(100.0, 100.0 * used / total))
    name = payload.get("device_name")
    device = payload.get("device", "?")
    title = f"{name} ({device})" if name else str(device)
    basis = mem.get("basis", "device memory")
    parts = [
        '<div class="vram-guard-head">',
        f'<span class="vram-guard-device">{_e(title)}</span>',
        f'<span class="vram-guard-state">{"job running" if payload.get("job_running") else "idle"}</span>',
        "</div>",
        f'<div class="vram-guard-mem" data-basis="{_e(basis)}">',
        f"{_e(basis)}: used <b>{_e(format_bytes(used))}</b> of {_e(format_bytes(total))}, "
        f"free <b>{_e(format_bytes(mem.get('free_bytes')))}</b>",
        "</div>",
        f'<div class="vram-guard-bar"><span style="width:{pct:.1f}%"></span></div>',
    ]
    shown: list[str] = []  # what the head and the table say (a note saying no more is left out)
    drop: list[str] = []  # notes the head says in its own words
    if payload.get("emulated"):
        text = (
            f"{payload['emulated']} (--vram-guard-emulate-vram): memory is counted and capped in "
            "software, not a real GPU; out-of-memory errors are raised at its capacity."
        )
        parts.append(f'<div class="vram-guard-emulated">{_e(text)}</div>')
        drop.append(EMULATED_NOTE.format(label=payload["emulated"]))
    elif payload.get("cpu_only"):
        rss = format_bytes(mem.get("process_rss_bytes"))
        text = f"{CPU_ONLY_NOTE.removesuffix('.')}; this process uses {rss}."
        parts.append(f'<div class="vram-guard-cpu">{_e(text)}</div>')
        drop.append(CPU_ONLY_NOTE)
    placement = str(payload.get("placement") or "")
    placement = placement if placement.startswith(PLACED_PREFIX) else ""
    said = [placement] if placement else []  # (said in the "Models now" line only)
    models = payload.get("models") or []
    line = ""
    if models:
        cells = " · ".join(f"{m['name']}: {_where(m, bool(placement))}" for m in models)
        line = f"Models now{', placed by VRAM Guard' if placement else ''} — {cells}"
    elif placement:
        line = f"Models now — {placement}"
    if line:
        parts.append(f'<div class="vram-guard-models">{_e(line)}</div>')
        shown.append(line)
    parts.append(render_timeline_html(payload.get("timeline"), said=said))
    stages = payload.get("stages") or []
    listed = {s["stage"] for s in stages}
    always = STAGES if listed != {"upscale"} else ()  # (an Extras job has no generation stages)
    rows = list(stages) + [
        {"stage": sid, "label": label, "missing": True} for sid, label in always if sid not in listed
    ]
    rows.sort(key=lambda r: _ORDER.get(r["stage"], len(_ORDER)))
    parts.append('<table class="vram-guard-stages"><thead><tr>')
    parts.append("<th>stage</th><th>peak</th><th>plan</th><th>time</th></tr></thead><tbody>")
    at_least = False
    told = " ".join(str(n) for n in payload.get("notes") or [])
    tails: list[str] = []  # each plan as a note may end with it (the sampling guard's)
    for row in rows:
        sid = _e(row["stage"])
        if row.get("missing"):
            parts.append(
                f'<tr class="vram-guard-stage vram-guard-skipped" data-stage="{sid}">'
                f"<td>{_e(row['label'])}</td><td>—</td><td>—</td><td></td></tr>"
            )
            continue
        peak, tip = format_bytes(row.get("peak_bytes")), ""
        if not row.get("exact", True):
            peak, tip, at_least = "≥ " + peak, f' title="{_e(AT_LEAST_NOTE)}"', True
        count = f" ×{int(row['count'])}" if int(row.get("count", 1)) > 1 else ""
        cls = "vram-guard-stage" + ("" if row.get("ok", True) else " vram-guard-failed")
        raw = str(row.get("plan") or "")
        # (the sampling guard's note gives the prediction with what it is made of: said there only)
        pred = re.search(r"\(predicted (\d+ MiB)\)$", raw)
        plan = plan_words(
            strip_predicted(raw) if pred and f"predicted peak {pred[1]}" in told else raw, said=said
        )
        if not row.get("ok", True):
            plan = f"{plan} — failed: {row.get('error') or 'error'}"
        shown += [f"{row['label']} {raw}", plan]
        tails.append(strip_predicted(remove_phrase(raw, placement)))
        parts.append(
            f'<tr class="{cls}" data-stage="{sid}"><td>{_e(row["label"])}{_e(count)}</td>'
            f'<td class="vram-guard-peak"{tip}>{_e(peak)}</td><td class="vram-guard-plan">{_e(plan)}</td>'
            f"<td>{float(row.get('seconds') or 0.0):.2f} s</td></tr>"
        )
    parts.append("</tbody></table>")
    if at_least:
        parts.append(f'<div class="vram-guard-footnote">{_e(AT_LEAST_NOTE)}</div>')
    parts.append(render_profile_section(payload.get("profile")))
    notes = readout_notes(payload.get("notes") or [], said=said, tails=tails, shown=shown, drop=drop)
    if notes:
        parts.append('<ul class="vram-guard-notes">')
        parts.extend(f"<li>{_e(n)}</li>" for n in notes)
        parts.append("</ul>")
    return "".join(parts)


NOTE_PREFIX = "VRAM Guard: "
"""How the adapter's notes start (they are log lines too); the readout, VRAM Guard's own box,
leaves it out."""
_SENTENCE_END = re.compile(r"(?<=\.)\s+(?=[A-Z])")


def _norm(text: str) -> str:
    return " ".join(text.split()).strip(" .;,").lower()


def readout_notes(
    notes: Iterable[str],
    *,
    said: Iterable[str] = (),
    tails: Iterable[str] = (),
    shown: Iterable[str] = (),
    drop: Iterable[str] = (),
) -> list[str]:
    """The notes the readout lists, each saying what the rest of it does not.

    ``drop``: notes the readout says in its own words (left out); ``said``: texts it shows once
    elsewhere (the checkpoint placement), cut out of every note with their separator; ``tails``:
    the stage table's plans, cut from a note's end after ``": "`` (the sampling guard's note ends
    with its pass's plan); ``shown``: what the head and the table say: a note sentence equal to or
    contained in one of them is left out, as is a sentence an earlier note said."""
    drop, said = set(drop), [s for s in said if s]
    tails = sorted({t for t in tails if t}, key=len, reverse=True)
    shown_n = [_norm(s) for s in shown if s]
    seen: set[str] = set()
    out: list[str] = []
    for note in notes:
        if note in drop:
            continue
        text = str(note).removeprefix(NOTE_PREFIX)
        for s in said:
            text = remove_phrase(text, s)
        for t in tails:
            if text.endswith(f": {t}"):
                text = text[: -len(t) - 2]
                break
        keep = []
        for sentence in _SENTENCE_END.split(text):
            n = _norm(sentence)
            if n and n not in seen and not any(n in s for s in shown_n):
                seen.add(n)
                keep.append(sentence.strip())
        if keep:
            out.append(_sentence(" ".join(keep)))
    return out


FIRST_FORWARD = "_first_forward"
"""Suffix of the nested stage that measures a pass's first UNet step (a forward VRAM Guard does not
predict): ``sampling_first_forward``."""


def stage_label(name: str) -> str:
    """The readout's label of a tracker stage name (``"vae_decode"`` -> ``"Decode"``)."""
    sid = _stage_id(name)
    if sid.endswith(FIRST_FORWARD):
        return stage_label(sid[: -len(FIRST_FORWARD)]) + ": first step, measured"
    return _LABELS.get(sid, sid.replace("_", " ").capitalize())


STAGE_WORDS: dict[str, str] = {
    "decode": "the VAE decode",
    "encode": "the VAE encode of the input image",
    "hires_decode": "the VAE decode before hires fix",
    "hires_encode": "the hires-fix VAE encode",
    "preview_decode": "a live preview's VAE decode",
    "other_encode": "a VAE encode",
    "hires_upscale": "the hires-fix upscale",
    "img2img_upscale": "the img2img upscale",
    "upscale": "the upscale",
    "ext_encode": "an extension's VAE encode (e.g. ADetailer's inpaint)",
    "ext_sampling": "an extension's sampling pass (e.g. ADetailer's inpaint)",
    "ext_decode": "an extension's VAE decode (e.g. ADetailer's inpaint)",
}
"""What each stage is called in the readout's notes: the words a user knows it by."""


def stage_words(name: str) -> str:
    """The words a note uses for a stage (``"hires_encode"`` -> ``"the hires-fix VAE encode"``)."""
    sid = _stage_id(name)
    if sid.endswith(FIRST_FORWARD):
        return "the first step of " + stage_words(sid[: -len(FIRST_FORWARD)]).removeprefix("the ")
    return STAGE_WORDS.get(sid, "the " + sid.replace("_", " "))


def size_words(n: int | float) -> str:
    """A size for a note: ``"3.2 GiB"``, ``"750 MiB"`` (the units of the rest of the readout)."""
    if n >= 2**30:
        return f"{n / 2**30:.1f} GiB"
    return f"{max(n, 0) / 2**20:.0f} MiB"


def _sentence(text: str) -> str:
    return text[:1].upper() + text[1:]


def _tiles_done(what: str, failed: str, tiles: int, size: str) -> str:
    """``"The VAE decode was done in 6 tiles of up to {size}"`` ("then it was ..." after ``failed``)."""
    plural = "s" if tiles != 1 else ""
    return f"{'then it' if failed else _sentence(what)} was done in {tiles} tile{plural} of up to {size}"


def vae_pass_note(
    stage: str,
    *,
    mode: str,
    tiles: int,
    tile: int | None,
    budget_bytes: int,
    retries: Iterable[int] = (),
    whole: Iterable[str] = (),
) -> str | None:
    """What one VAE pass did, in words (``None`` when it simply ran untiled).

    ``tile`` is in latent pixels (x8 on the image); ``budget_bytes`` is the memory it planned
    within (free memory less a safety margin); ``retries`` the tiles that ran out of memory first
    (0 = untiled), ``whole`` the engine's out-of-memory remarks. E.g. "The VAE decode was done in 6
    tiles of 512x512 px to fit in 3.2 GiB (the free memory less a safety margin); exact tiles: the
    same picture as untiled."."""
    what = stage_words(stage)
    retries, whole = list(retries), [w.removeprefix("out of memory ") for w in whole]
    failed = ""
    if retries or whole:
        tries = ["untiled" if t == 0 else f"with {t * 8}x{t * 8}-px tiles" for t in retries]
        first = " and ".join(tries) if retries else "; ".join(whole)
        failed = f"{_sentence(what)} ran out of memory {first}; "
    if mode not in ("exact", "fast") or not tile or (tiles <= 1 and not failed):
        return f"{failed}it then ran untiled." if failed else None
    px = tile * 8
    done = _tiles_done(what, failed, tiles, f"{px}x{px} px to fit in {size_words(budget_bytes)}")
    done += " (the free memory less a safety margin)"
    picture = (
        "exact tiles: the same picture as untiled."
        if mode == "exact"
        else "fast tiles: seamless, but not exactly the untiled picture."
    )
    return f"{failed}{done}; {picture}"


def upscale_pass_note(
    stage: str,
    *,
    tiled: bool,
    tiles: int,
    tile: int,
    batch: int,
    budget_bytes: int,
    ooms: int = 0,
    exact: bool = True,
) -> str | None:
    """What one tiled upscale did, in words (``None`` when the whole image went through at once
    without an out-of-memory error)."""
    what = stage_words(stage)
    failed = f"{_sentence(what)} ran out of memory {ooms} time{'s' if ooms != 1 else ''}; " if ooms else ""
    if not tiled:
        return f"{failed}it then ran on the whole image at once." if failed else None
    done = _tiles_done(
        what, failed, tiles, f"{tile}x{tile} px, {batch} at a time, to fit in {size_words(budget_bytes)}"
    )
    picture = (
        "the tiles blend into the untiled picture (within one 8-bit level)."
        if exact
        else "this model looks at the whole image, so its tiles are not exactly the untiled picture."
    )
    return f"{failed}{done}; {picture}"


def render_timeline_html(timeline: Mapping[str, Any] | None, *, said: Iterable[str] = ()) -> str:
    """The memory timeline's plot and legend (``""`` without one), see :mod:`lib_vram.core.timeline`;
    its stage plans in words, without ``said`` (what the readout shows elsewhere)."""
    said = list(said)
    words = lambda plan: plan_words(plan, said=said)  # noqa: E731
    svg = render_svg(timeline, label=stage_label, plan=words) if timeline else ""
    if not svg:
        return ""
    state = "running" if timeline.get("running") else "done"
    return (
        f'<div class="vram-guard-timeline-box" data-state="{state}" '
        f'data-points="{len((timeline.get("points") or {}).get("t") or [])}">'
        f"{svg}{legend_html(timeline, label=stage_label)}</div>"
    )


def render_readout_html(
    payload: Mapping[str, Any], *, tab: str = "", tooltips: Mapping[str, tuple[str, str]] | None = None
) -> str:
    """The readout as the accordion's ``gr.HTML`` value: a ``.vram-guard`` box around the body.

    ``tooltips`` (elem_id → (label, tooltip)) are carried in a ``data-`` attribute for the JS,
    which registers them with the WebUI's ``titles`` and sets ``title`` on the elements.
    """
    attrs = f' data-tab="{_e(tab)}"' if tab else ""
    if tooltips:
        attrs += f' data-vram-guard-tooltips="{_e(json.dumps({k: list(v) for k, v in tooltips.items()}))}"'
    return f'<div class="vram-guard vram-guard-readout"{attrs}>{render_readout_body(payload)}</div>'


def placeholder_payload(memory: MemoryInfo | None = None, *, note: str | None = None) -> dict[str, Any]:
    """A payload for a readout shown before anything was measured (no stages)."""
    if memory is None:  # (nothing read: zeros, no allocator counters)
        memory = MemoryInfo(
            "?", "unknown", 0, 0, *[None] * 4, process_rss=0, system_total=0, system_available=0
        )
    notes = [note] if note else ["No job measured yet."]
    return status_payload(memory, [], job_running=False, notes=notes)


# -- 'Profile the next job' (lib_vram.webui.profiling) ------------------------------------------

PROFILE_BUTTON = "Profile the next job"
PROFILE_ARMED_NOTE = (
    "Profiling armed: the next job's VRAM Guard stages run under the PyTorch profiler (slower); "
    f"click '{PROFILE_BUTTON}' again to cancel."
)
PROFILE_TOP = 3
"""Operators per stage the readout names (the status route has more)."""


def file_url(path: str) -> str:
    """The WebUI's route for a file (``file=<absolute path>``, relative to the page)."""
    return "file=" + urllib.parse.quote(os.path.abspath(path), safe="/:\\")


def render_profile_section(state: Mapping[str, Any] | None) -> str:
    """The payload's ``profile`` as HTML: armed, and the last profiled job's top operators per stage
    with links to its files (through the WebUI's ``file=`` route). Empty without a profile."""
    if not state:
        return ""
    parts: list[str] = []
    if state.get("armed"):
        parts.append(f'<div class="vram-guard-profile-armed">{_e(PROFILE_ARMED_NOTE)}</div>')
    last = state.get("last")
    if last:
        parts.append('<div class="vram-guard-profile">')
        parts.append(f"<b>Profile of the last profiled job</b> ({_e(str(last.get('kind')))})")
        if not last.get("stages"):
            parts.append(" — no VRAM Guard stage ran on the job's thread.")
        parts.append("<ul>")
        for st in last.get("stages", []):
            tops = ", ".join(
                f"{_e(op['name'].removeprefix('aten::'))} {_mib(op['alloc_bytes'])}"
                + (f" ×{op['calls']}" if op.get("calls", 0) > 1 else "")
                for op in st.get("top", [])[:PROFILE_TOP]
            )
            links = " ".join(
                f'<a href="{_e(file_url(p))}" target="_blank" data-kind="{_e(k)}">{_e(k)}</a>'
                for k, p in st.get("files", {}).items()
            )
            failed = "" if st.get("ok", True) else f" — failed: {_e(str(st.get('error')))}"
            parts.append(
                f'<li data-stage="{_e(st["stage"])}">{_e(st["stage"])}: '
                f"{tops or 'no operator allocated memory'}; tensors at once {_mib(st.get('peak_bytes'))}"
                f"{failed}{' — ' + links if links else ''}</li>"
            )
        parts.append("</ul>")
        for note in last.get("notes", []):
            parts.append(f'<div class="vram-guard-profile-note">{_e(note)}</div>')
        parts.append("</div>")
    return "".join(parts)
