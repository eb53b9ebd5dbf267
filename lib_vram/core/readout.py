"""The memory readout: a stable JSON payload and its HTML (pure; no gradio, no WebUI).

The host adapter serves :func:`status_payload` at ``GET /vram-guard/v1/status``; the accordion shows
:func:`render_readout_html` of the same payload; ``javascript/vram_guard.js`` polls the route while
a job runs and swaps in the payload's ``html``.

Payload keys (``schema`` 1; a change of meaning bumps ``schema``):

=================== ==========================================================================
key                 meaning
=================== ==========================================================================
``schema``          1
``device``          e.g. ``"cuda:0"``, ``"cpu"``
``device_name``     e.g. ``"NVIDIA GeForce RTX 3060"``, or ``null``
``backend``         ``cuda``, ``rocm``, ``mps``, ``xpu`` or ``cpu``
``cpu_only``        ``true`` when no accelerator is used (memory is then system RAM)
``memory``          object: ``basis`` (``"device memory"`` or ``"system RAM"``), ``total_bytes``,
                    ``used_bytes``, ``free_bytes``, ``allocated_bytes``, ``reserved_bytes``
                    (``null`` without an allocator), ``process_rss_bytes``,
                    ``system_total_bytes``, ``system_available_bytes``
``job_running``     whether a generation is running now
``stages``          list, in pipeline order (:data:`KNOWN_STAGES`, then any other stage in the
                    order seen), one object per stage of
                    the last job: ``stage`` (id), ``label``, ``peak_bytes``, ``plan`` (or
                    ``null``), ``seconds`` (summed), ``count`` (times it ran), ``ok``, ``exact``
                    (``false``: the peak is a sampled lower bound), ``error`` (or ``null``)
``emulated``        the emulated card's label (``--emulate-vram``, :mod:`lib_vram.core.emulate`) when
                    ``memory`` describes one, else ``null``
``notes``           list of strings (warnings, the CPU-only notice, what a release freed)
``html``            the readout's inner HTML (what the JS puts into the page)
=================== ==========================================================================
"""

from __future__ import annotations

import html
import json
import logging
from collections.abc import Iterable, Mapping
from typing import Any

from .device import MemoryInfo

logger = logging.getLogger(__name__)

SCHEMA = 1
STATUS_ROUTE = "/vram-guard/v1/status"
UI_STATUS_ROUTE = "/internal/vram-guard/status"
"""The same payload for the page's readout: it follows the WebUI's UI access control (its Gradio
login, like the WebUI's own ``/internal/*`` routes), where ``STATUS_ROUTE`` follows the API's
(``--api-auth``)."""

STAGES: tuple[tuple[str, str], ...] = (
    ("sampling", "Sampling"),
    ("hires_upscale", "Hires upscale"),
    ("hires_encode", "Hires encode"),
    ("decode", "Decode"),
    ("postprocess", "Postprocess"),
)
"""The pipeline stages the readout always lists, in order: (id, label)."""

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
_ORDER = {sid: i for i, (sid, _label) in enumerate(KNOWN_STAGES)}


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
                "label": _LABELS.get(sid, sid.replace("_", " ").capitalize()),
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
) -> dict[str, Any]:
    """The readout's JSON (keys in the module docstring), including its rendered ``html``.

    ``records``: the last job's stage records (:class:`~lib_vram.core.tracker.StageRecord` or their
    ``to_dict()``); a stage that ran several times is merged (highest peak, summed time).
    """
    cpu_only = memory.backend == "cpu"
    emulated = getattr(memory, "emulated", None)
    note_list = [str(n) for n in notes]
    if emulated:
        note = EMULATED_NOTE.format(label=emulated)
        if note not in note_list:
            note_list.insert(0, note)
    elif cpu_only and CPU_ONLY_NOTE not in note_list:
        note_list.insert(0, CPU_ONLY_NOTE)
    payload: dict[str, Any] = {
        "schema": SCHEMA,
        "device": memory.device,
        "device_name": device_name,
        "backend": memory.backend,
        "cpu_only": cpu_only,
        "memory": {
            "basis": "emulated device memory" if emulated else "system RAM" if cpu_only else "device memory",
            "total_bytes": memory.total,
            "used_bytes": memory.used,
            "free_bytes": memory.free,
            "allocated_bytes": memory.allocated,
            "reserved_bytes": memory.reserved,
            "process_rss_bytes": memory.process_rss,
            "system_total_bytes": memory.system_total,
            "system_available_bytes": memory.system_available,
        },
        "emulated": emulated,
        "job_running": bool(job_running),
        "stages": _stages(records),
        "notes": note_list,
    }
    payload["html"] = render_readout_body(payload)
    return payload


def format_bytes(n: int | float | None) -> str:
    """``1536 MiB`` → ``"1.50 GiB"``; ``None`` → ``"n/a"``."""
    if n is None:
        return "n/a"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit in ("B", "KiB") else f"{value:.2f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def _e(value: Any) -> str:
    return html.escape(str(value), quote=True)


def render_readout_body(payload: Mapping[str, Any]) -> str:
    """The readout's inner HTML (everything escaped)."""
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
    if payload.get("emulated"):
        parts.append(
            f'<div class="vram-guard-emulated">{_e(payload["emulated"])}: emulated device memory, '
            "not a real GPU — out-of-memory errors are raised at its capacity.</div>"
        )
    elif payload.get("cpu_only"):
        rss = format_bytes(mem.get("process_rss_bytes"))
        parts.append(f'<div class="vram-guard-cpu">CPU only — this process uses {_e(rss)} of RAM.</div>')
    stages = payload.get("stages") or []
    listed = {s["stage"] for s in stages}
    rows = list(stages) + [
        {"stage": sid, "label": label, "missing": True} for sid, label in STAGES if sid not in listed
    ]
    rows.sort(key=lambda r: _ORDER.get(r["stage"], len(_ORDER)))
    parts.append('<table class="vram-guard-stages"><thead><tr>')
    parts.append("<th>stage</th><th>peak</th><th>plan</th><th>time</th></tr></thead><tbody>")
    for row in rows:
        sid = _e(row["stage"])
        if row.get("missing"):
            parts.append(
                f'<tr class="vram-guard-stage vram-guard-skipped" data-stage="{sid}">'
                f"<td>{_e(row['label'])}</td><td>—</td><td>—</td><td></td></tr>"
            )
            continue
        peak = format_bytes(row.get("peak_bytes"))
        if not row.get("exact", True):
            peak = "≥ " + peak
        count = f" ×{int(row['count'])}" if int(row.get("count", 1)) > 1 else ""
        cls = "vram-guard-stage" + ("" if row.get("ok", True) else " vram-guard-failed")
        plan = row.get("plan") or "—"
        if not row.get("ok", True):
            plan = f"{plan} — failed: {row.get('error') or 'error'}"
        parts.append(
            f'<tr class="{cls}" data-stage="{sid}"><td>{_e(row["label"])}{_e(count)}</td>'
            f'<td class="vram-guard-peak">{_e(peak)}</td><td>{_e(plan)}</td>'
            f"<td>{float(row.get('seconds') or 0.0):.2f} s</td></tr>"
        )
    parts.append("</tbody></table>")
    notes = payload.get("notes") or []
    if notes:
        parts.append('<ul class="vram-guard-notes">')
        parts.extend(f"<li>{_e(n)}</li>" for n in notes)
        parts.append("</ul>")
    return "".join(parts)


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
    if memory is None:
        memory = MemoryInfo(
            device="?",
            backend="unknown",
            total=0,
            free=0,
            allocated=None,
            reserved=None,
            peak_allocated=None,
            peak_reserved=None,
            process_rss=0,
            system_total=0,
            system_available=0,
        )
    notes = [note] if note else ["No job measured yet."]
    return status_payload(memory, [], job_running=False, notes=notes)
