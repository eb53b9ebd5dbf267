"""The one bench runner: a target says what differs (a :class:`Bench`), this module does the rest.

A case whose fresh process fails becomes a record with ``error``; the others still run and the exit
code is 1. :func:`attempt` is the plain-vs-guarded step the emulated-card targets share.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from lib_vram.core.device import is_oom_error
from lib_vram.core.emulate import install as install_card

from ..common import strict_json

Column = str | tuple[str, Callable[[dict], object]]
"""A table column: a record's key (also the header), or (header, the cell from a record)."""


@dataclass
class Bench:
    """What one run of a target does."""

    cases: Sequence[Any]
    """In order; JSON-able for a fresh process (its ``--child`` gets the case as JSON)."""
    run_case: Callable[[Any], dict | list[dict]] | None
    """Runs one case in this process (``None``: in a fresh process, :func:`runner`'s ``child``)."""
    table: Sequence[Column] | Callable[[list[dict]], str] = ()
    """The table's columns, or the function that writes the whole text from the records."""
    lines: bool = True
    """``--json``: a record a line as each case ends (else one indented list at the end)."""
    label: Callable[[Any], str] = str
    done: Callable[[dict], str] | None = None
    """The progress line after a case, from its record."""
    env: dict[str, str] = field(default_factory=dict)
    """Set in the child processes' environment."""
    timeout: float | None = None
    hold: contextlib.AbstractContextManager | None = None
    """Entered before the cases and left after them (what the cases share, e.g. a loaded model)."""
    summary: Callable[[list[dict]], dict] | None = None
    """A summary of all records, printed last (``--json``: ``{"summary": ...}``; else as JSON under
    the table); ``passed`` False in it makes the exit code 1."""


class CaseFailed(Exception):
    def __init__(self, record: dict, text: str) -> None:
        super().__init__(text)
        self.record = record


def runner(
    make: Callable[[argparse.Namespace], Bench], child: Callable[[Any], dict | list[dict]] | None = None
) -> Callable[[argparse.Namespace], int]:
    """A target's ``run(args)``: ``make(args)`` (options checked first, then what the cases share set
    up), then the run. In a child process (``--child CASE``) only ``child(case)`` runs: the record(s) of one
    case of a bench whose cases run in fresh processes."""

    def run(args: argparse.Namespace) -> int:
        if child is not None and getattr(args, "child", None):
            print("BENCH_RECORD " + strict_json(child(json.loads(args.child))), flush=True)
            return 0
        return _run(make(args), args)

    return run


def _run(bench: Bench, args: argparse.Namespace) -> int:
    as_json, records = getattr(args, "json", False), []
    failed: dict[int, str] = {}  # id(record) -> the case's label
    with bench.hold or contextlib.nullcontext():
        for i, case in enumerate(bench.cases, 1):
            label = bench.label(case)
            print(f"[{i}/{len(bench.cases)}] {label}", file=sys.stderr, flush=True)
            try:
                got = bench.run_case(case) if bench.run_case is not None else _child(args.target, case, bench)
            except CaseFailed as exc:
                print(f"{label} failed:\n{exc}", file=sys.stderr, flush=True)
                got = exc.record
                failed[id(got)] = label
            for rec in got if isinstance(got, list) else [got]:
                records.append(rec)
                if bench.done is not None and id(rec) not in failed:
                    print("    " + bench.done(rec), file=sys.stderr, flush=True)
                if as_json and bench.lines:
                    print(strict_json(rec), flush=True)
    summary = bench.summary(records) if bench.summary is not None else {}
    if as_json and not bench.lines:
        print(strict_json(records, indent=2))
    elif not as_json:
        ok = [r for r in records if id(r) not in failed]
        print(bench.table(ok) if callable(bench.table) else table(bench.table, ok))
        if failed:
            print(f"\nfailed: {', '.join(failed.values())}")
    if summary:
        print(strict_json({"summary": summary} if as_json else summary))
    return 1 if failed or summary.get("passed") is False else 0


def _child(target: str, case: Any, bench: Bench) -> dict | list[dict]:
    """``case`` in a fresh ``python -m lib_vram bench TARGET --child CASE``: its record(s). Raises
    :class:`CaseFailed` with the case and ``error`` (the end of the child's output)."""
    cmd = [sys.executable, "-m", "lib_vram", "bench", target, "--child", json.dumps(case)]
    env = {**os.environ, **bench.env}
    root = str(Path(__file__).resolve().parents[3])  # the child imports this lib_vram from anywhere
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=bench.timeout)
        out, err = proc.stdout, proc.stderr
    except subprocess.TimeoutExpired as exc:
        out, err = "", f"timed out after {exc.timeout:g} s"
    for line in reversed(out.splitlines()):
        if line.startswith("BENCH_RECORD "):
            return json.loads(line[len("BENCH_RECORD ") :])
    text = (err or out)[-800:]
    raise CaseFailed({**(case if isinstance(case, dict) else {"case": case}), "error": text}, text)


def cell(value: object) -> str:
    """A table cell: ``-`` for none, a float to 2 decimals (``inf``), the rest as text."""
    if value is None:
        return "-"
    if isinstance(value, float):
        return "inf" if math.isinf(value) else f"{value:.2f}"
    return str(value)


def table(columns: Sequence[Column], records: Sequence[dict]) -> str:
    """A markdown table: a row per record."""
    heads = [c if isinstance(c, str) else c[0] for c in columns]
    lines = ["| " + " | ".join(heads) + " |", "|" + "---|" * len(heads)]
    for r in records:
        cells = (cell(r.get(c) if isinstance(c, str) else c[1](r)) for c in columns)
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def mib(n: float | None, digits: int = 1) -> str:
    return "-" if n is None else f"{n / 2**20:.{digits}f}"


def mib_of(key: str, digits: int = 1, unit: str = "") -> Callable[[dict], str]:
    """A table cell: the record's ``key`` (bytes) in MiB, then ``unit``."""
    return lambda r: mib(r.get(key), digits) + unit


def fmt(key: str, spec: str = "", unit: str = "") -> Callable[[dict], str]:
    """A table cell: the record's ``key`` formatted by ``spec``, then ``unit`` (``-`` when it is missing)."""
    return lambda r: "-" if r.get(key) is None else format(r[key], spec) + unit


def known(option: str, text: str | None, choices: Sequence[str], every: str | None = None) -> list[str]:
    """The comma-separated names of ``option`` (all of ``choices`` for ``every``); unknown ones:
    ValueError naming the option."""
    names = list(choices) if text == every else str(text).split(",")
    unknown = [n for n in names if n not in choices]
    if unknown:
        raise ValueError(f"`{option}`: unknown {unknown}; known: {', '.join(choices)}")
    return names


def psnr(mse: float, peak: float) -> float:
    """PSNR in dB of a mean squared error against a value range of ``peak`` (inf when equal)."""
    return math.inf if mse == 0 else 10 * math.log10(peak**2 / mse)


def ok(key: str, yes: str = "OK", no: str = "OOM") -> Callable[[dict], str]:
    """A table cell: ``yes`` or ``no``, by the record's ``key``."""
    return lambda r: yes if r[key] else no


def timed(fn: Callable[[], Any], device: object = None) -> tuple[Any, float, float]:
    """``fn()``, its wall and process CPU seconds (on a CUDA ``device``: synchronized before and after)."""
    sync = torch.cuda.synchronize if str(device).startswith("cuda") else lambda device: None
    sync(device)
    t0, c0 = time.perf_counter(), time.process_time()
    out = fn()
    sync(device)
    return out, time.perf_counter() - t0, time.process_time() - c0


@dataclass
class Attempt:
    ok: bool
    out: Any = None
    error: str | None = None
    seconds: float = 0.0
    cpu_seconds: float = 0.0


def attempt(fn: Callable[[], Any], card: Any = None, *, install: bool = False) -> Attempt:
    """``fn()`` on the emulated ``card`` (``None``: uncapped), timed; ``install``: the card is also the
    process's (what a guarded run's memory probes read). An out-of-memory error is the result
    (``ok`` False, the time until it); any other error propagates."""

    previous = install_card(card) if install else None
    t0, c0 = time.perf_counter(), time.process_time()
    try:
        with card if card is not None else contextlib.nullcontext():
            out, seconds, cpu_seconds = timed(fn)
    except Exception as exc:  # the card's out-of-memory error is a result; anything else is not
        if not is_oom_error(exc):
            raise
        return Attempt(False, None, str(exc), time.perf_counter() - t0, time.process_time() - c0)
    finally:
        if install:
            install_card(previous)
    return Attempt(True, out, None, seconds, cpu_seconds)
