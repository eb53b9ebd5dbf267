"""What every ``bench`` target promises its users: its command-line options and the fields of its
JSON records (issue 32: one bench runner). Written before the targets moved onto one harness and
run unchanged after, so that the move keeps every target, option and field.

Each target runs for real on its smallest inputs, through ``main`` where a quick run is cheap
(``--json``: the records, strict JSON, nothing else on stdout); where even the quick run takes
minutes, the target's case table is cut to its smallest case or its record-building function runs
on real inputs. Nothing of the targets is mocked. The two runs of full-size models (``bench gpu``,
``bench emulate --overhead``) are ``slow`` (``VRAM_GUARD_SLOW=1``).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import pytest
import torch

from lib_vram.cli import build_parser, main

# option strings -> (dest, default, choices, nargs, const); the hidden child-process options
# (help=SUPPRESS) are the runner's own business and not listed
OPTIONS: dict[str, dict[tuple[str, ...], tuple]] = {
    "vae": {
        ("--emulate-vram",): ("emulate_vram", None, None, None, None),
        ("--quick",): ("quick", False, None, 0, True),
        ("--json",): ("json", False, None, 0, True),
        ("--device",): ("device", "cpu", None, None, None),
        ("--dtype",): ("dtype", "fp32", ("fp32", "fp16", "bf16"), None, None),
        ("--sizes",): ("sizes", None, None, None, None),
        ("--modes",): ("modes", None, None, None, None),
        ("--workdir",): ("workdir", ".bench/vae", None, None, None),
        ("--diff-image",): ("diff_image", None, None, None, None),
        ("--threads",): ("threads", 0, None, None, None),
        ("--state-offload",): ("state_offload", "cpu", ("cpu", "device", "auto"), None, None),
        ("--fast-sample",): ("fast_sample", None, None, None, None),
        ("--predict",): ("predict", None, None, None, None),
        ("--tile",): ("tile", 64, None, None, None),
    },
    "upscale": {
        ("--emulate-vram",): ("emulate_vram", None, None, None, None),
        ("--quick",): ("quick", False, None, 0, True),
        ("--large",): ("large", False, None, 0, True),
        ("--json",): ("json", False, None, 0, True),
        ("--device",): ("device", None, None, None, None),
        ("--precision",): ("precision", "auto", ("auto", "fp16", "bf16", "fp32"), None, None),
        ("--workdir",): ("workdir", None, None, None, None),
        ("--only",): ("only", None, None, None, None),
        ("--archs",): ("archs", None, None, "?", "all"),
        ("--fallback",): ("fallback", None, None, "?", "auto"),
        ("--fallback-px",): ("fallback_px", 512, None, None, None),
    },
    "planner": {
        ("--emulate-vram",): ("emulate_vram", None, None, None, None),
        ("--quick",): ("quick", False, None, 0, True),
        ("--case",): ("case", None, None, None, None),
        ("--json",): ("json", False, None, 0, True),
        ("--glibc-default",): ("glibc_default", False, None, 0, True),
        ("--timeout",): ("timeout", 900.0, None, None, None),
    },
    "vae-estimate": {
        ("--emulate-vram",): ("emulate_vram", None, None, None, None),
        ("--json",): ("json", False, None, 0, True),
    },
    "emulate": {
        ("--emulate-vram",): ("emulate_vram", None, None, None, None),
        ("--quick",): ("quick", False, None, 0, True),
        ("--json",): ("json", False, None, 0, True),
        ("--cards",): ("cards", "4,6,8", None, None, None),
        ("--stages",): ("stages", None, None, None, None),
        ("--overhead",): ("overhead", False, None, 0, True),
    },
    "gpu": {
        ("--emulate-vram",): ("emulate_vram", None, None, None, None),
        ("--out",): ("out", Path("vram_guard_gpu.json"), None, None, None),
        ("--budget-s",): ("budget_s", 420.0, None, None, None),
        ("--cards",): ("cards", "4,6,8", None, None, None),
    },
    "timeline": {
        ("--emulate-vram",): ("emulate_vram", None, None, None, None),
        ("--reps",): ("reps", 5, None, None, None),
        ("--quick",): ("quick", False, None, 0, True),
        ("--json",): ("json", False, None, 0, True),
        ("--device",): ("device", "cpu", None, None, None),
        ("--threads",): ("threads", None, None, None, None),
    },
    "sampling": {
        ("--emulate-vram",): ("emulate_vram", None, None, None, None),
        ("--quick",): ("quick", False, None, 0, True),
        ("--json",): ("json", False, None, 0, True),
    },
    "sampling-stream": {
        ("--emulate-vram",): ("emulate_vram", None, None, None, None),
        ("--quick",): ("quick", False, None, 0, True),
        ("--json",): ("json", False, None, 0, True),
        ("--bandwidth",): ("bandwidth", 12.0, None, None, None),
    },
}


def _fields(names: str) -> set[str]:
    return set(names.split())


VAE = _fields(
    "method mode image_px tile device dtype seconds cpu_seconds peak_bytes peak_measure "
    "device_peak_bytes live_peak_bytes parked_peak_bytes state_offload fast_sample peak_estimate_bytes "
    "tiles psnr_db max_abs_err seam_ratio torch threads numpy"
)
VAE_PREDICT = _fields(
    "method mode image_px tile predicted_device_peak_bytes predicted_live_peak_bytes flops "
    "conv_flops fast_sample predict_seconds"
)
UPSCALE = _fields(
    "method arch image_px tile batch seconds cpu_seconds peak_bytes psnr_db max_err_lsb flop_ratio "
    "overlap rss_peak_bytes dtype device calib_seconds plan"
)
UPSCALE_ARCHS = _fields("arch spandrel kind grid tile plan max_err_lsb psnr_db exact note seconds")
UPSCALE_FALLBACK = _fields(
    "arch spandrel image_px tile overlap exact max_err_lsb pct_over_1lsb psnr_db why seconds"
)
PLANNER = _fields(
    "case engine kind size ch plan predicted_bytes measured_bytes error weights_bytes input_bytes "
    "predict_seconds run_seconds exact"
)
VAE_ESTIMATE = _fields(
    "kind px tile mode ch predicted_cpu predict_seconds estimate_cpu estimate_ms predicted_cuda estimate_cuda"
)
EMULATE = _fields(
    "stage image_px card_gb card_bytes resident_bytes scale plain_ok plain_error plain_peak_bytes "
    "guarded_ok plan seconds cpu_ratio psnr_db max_err max_err_lsb finite peak_bytes peak_over_cap"
)
EMULATE_OVERHEAD = _fields("stage case cpu_s_plain cpu_s_emulated cpu_ratio wall_ratio counted_peak_bytes")
GPU = _fields(
    "schema device env matrix decode_2048 upscale_batch cudnn_workspace stream_unet seconds skipped"
)
GPU_ENV = _fields("capabilities memory torch cudnn")
GPU_MATRIX = _fields(
    "stage image_px card_gb card_bytes device plain_seconds plain_ok plain_peak_bytes "
    "guarded_seconds guarded_ok psnr_db max_err max_err_lsb finite plan guarded_peak_bytes "
    "peak_over_cap ref_cpu_s"
)
GPU_UPSCALE_BATCH = _fields("case plan seconds max_memory_allocated")
TIMELINE = _fields(
    "job reps clock wall_s none_s tracker_s timeline_s timeline_vs_tracker_pct "
    "timeline_vs_none_pct min_s min_timeline_vs_tracker_pct samples points sample_us_tracker "
    "sample_us_timeline implied_timeline_pct implied_all_sampling_pct"
)
VARIANTS = _fields("none tracker timeline")
SAMPLING = _fields(
    "stage shape latent batch attention card_gib scale card_bytes plain_ok guarded_ok plan "
    "moved_off micro_batch fits_predicted predicted_bytes peak_bytes cpu_ratio max_abs_diff"
)
STREAM_RUN = _fields(
    "stage shape latent card_bytes card_holds plain_ok guarded_ok identical attempts plan "
    "micro_batch unet_bytes resident_bytes buffer_bytes bytes_moved_per_step "
    "planned_bytes_per_step lowvram_bytes_per_step peak_bytes predicted_bytes cpu_ratio"
)
STREAM_PLAN = _fields(
    "stage shape px card_bytes plain_ok guarded_ok plan micro_batch unet_bytes resident_bytes "
    "bytes_moved_per_step lowvram_bytes_per_step bandwidth_gb_s modelled_copy_s_per_step "
    "lowvram_modelled_copy_s_per_step"
)

slow = pytest.mark.skipif(os.environ.get("VRAM_GUARD_SLOW") != "1", reason="slow: set VRAM_GUARD_SLOW=1")


def _target_parsers() -> dict[str, argparse.ArgumentParser]:
    def sub(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
        return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices

    return sub(sub(build_parser())["bench"])


def _strict(text: str) -> object:
    return json.loads(text, parse_constant=lambda c: pytest.fail(f"--json wrote {c}, not strict JSON"))


def _records(capsys, argv: list[str], *, lines: bool) -> list[dict]:
    """``main(argv)`` with ``--json``: exit code 0 and only JSON on stdout, one record a line
    (``lines``) or one list."""
    assert main(["bench", *argv, "--json"]) == 0
    out = capsys.readouterr().out
    if lines:
        return [_strict(line) for line in out.splitlines() if line.strip()]
    records = _strict(out)
    assert isinstance(records, list)
    return records


def _keys(records: list[dict], expected: set[str]) -> None:
    assert records
    for rec in records:
        assert set(rec) == expected, (sorted(set(rec) - expected), sorted(expected - set(rec)))


def test_every_target_keeps_its_options():
    parsers = _target_parsers()
    assert set(OPTIONS) <= set(parsers)
    for name, expected in OPTIONS.items():
        got = {
            tuple(a.option_strings): (a.dest, a.default, a.choices, a.nargs, a.const)
            for a in parsers[name]._actions
            if not isinstance(a, argparse._HelpAction) and a.help != argparse.SUPPRESS
        }
        assert got == expected, name


def test_vae_records(capsys, tmp_path):
    recs = _records(capsys, ["vae", "--quick", "--modes", "fast", "--workdir", str(tmp_path)], lines=True)
    assert [(r["method"], r["mode"], r["image_px"]) for r in recs] == [("decode", "fast", 256)]
    _keys(recs, VAE)
    recs = _records(capsys, ["vae", "--predict", "64", "--tile", "4"], lines=True)
    assert [r["mode"] for r in recs] == ["untiled", "exact", "fast"]
    _keys(recs, VAE_PREDICT)


def test_upscale_records(capsys, tmp_path):
    work = ["--workdir", str(tmp_path)]
    recs = _records(capsys, ["upscale", "--quick", "--only", "compact-s:128", *work], lines=False)
    assert [(r["method"], r["arch"]) for r in recs] == [("engine", "compact-s")]
    _keys(recs, UPSCALE)
    _keys(_records(capsys, ["upscale", "--archs", "compact-x2", *work], lines=False), UPSCALE_ARCHS)
    fallback = ["upscale", "--fallback", "compact-x2", "--fallback-px", "160", *work]
    _keys(_records(capsys, fallback, lines=False), UPSCALE_FALLBACK)


def test_planner_records(capsys):
    recs = _records(capsys, ["planner", "--case", "compact-512"], lines=False)
    assert [r["case"] for r in recs] == ["compact-512"]
    _keys(recs, PLANNER)


def test_vae_estimate_records(capsys, monkeypatch):
    from lib_vram.cli.bench import vae_estimate

    monkeypatch.setattr(vae_estimate, "CASES", (("decode", 128, 8, "exact", 64),))  # the smallest case
    _keys(_records(capsys, ["vae-estimate"], lines=False), VAE_ESTIMATE)


def test_emulate_records(capsys, monkeypatch):
    from lib_vram.cli.bench import emulate

    monkeypatch.setitem(emulate.QUICK, "upscale", (64,))  # the quick run's upscale, at 64 px
    recs = _records(capsys, ["emulate", "--quick", "--stages", "upscale", "--cards", "4"], lines=True)
    assert [(r["stage"], r["plain_ok"], r["guarded_ok"]) for r in recs] == [("upscale", True, True)]
    _keys(recs, EMULATE)


@slow
def test_emulate_overhead_records(capsys, monkeypatch):
    from lib_vram.cli.bench import emulate

    monkeypatch.setitem(emulate.QUICK, "upscale", (64,))
    argv = ["emulate", "--quick", "--stages", "upscale", "--cards", "4", "--overhead"]
    recs = _records(capsys, argv, lines=True)
    _keys(recs[:1], EMULATE)
    _keys(recs[1:], EMULATE_OVERHEAD)


@slow
def test_gpu_records(tmp_path, capsys):
    out = tmp_path / "gpu.json"
    assert main(["bench", "gpu", "--out", str(out), "--cards", "4"]) == 0
    data = _strict(out.read_text())
    assert set(data) == GPU and set(data["env"]) == GPU_ENV
    _keys(data["matrix"], GPU_MATRIX)
    _keys(data["upscale_batch"], GPU_UPSCALE_BATCH)


def test_timeline_records(capsys):
    recs = _records(capsys, ["timeline", "--quick", "--reps", "1"], lines=True)
    assert len(recs) == 2
    _keys(recs, TIMELINE)
    assert all(set(r["wall_s"]) == set(r["min_s"]) == VARIANTS for r in recs)


def test_sampling_records():
    from lib_vram.cli.bench import sampling

    recs = sampling.case_records(("sd15", 16, 16, 2, "none"), {})  # the smallest case
    assert [r["card_gib"] for r in recs] == list(sampling.CARDS)
    _keys(recs, SAMPLING)


def test_sampling_stream_records():
    from lib_vram.cli.bench import sampling_stream

    _keys([sampling_stream.run_case("sd15", 32, 16, 1 / 2)], STREAM_RUN)
    _keys([sampling_stream.plan_case("sd15", 3.0, 512, 12.0, torch.float32)], STREAM_PLAN)


def test_sampling_controlnet_records():
    """``bench sampling``'s ControlNet records (issue 30 item 5) on the smallest case."""
    from lib_vram.cli.bench import sampling

    recs = sampling.case_records(("sd15", 16, 16, 2, "none"), {}, control=True)
    assert [r["card_gib"] for r in recs] == list(sampling.CARDS)
    keys = ("plain_ok", "guarded_ok", "controlnet_bytes", "controlnet_resident_bytes", "bytes_moved_per_step",
            "controlnet_lowvram_bytes_per_step", "predicted_bytes", "peak_bytes")  # fmt: skip
    for key in keys:
        assert all(key in r for r in recs), key
    assert all(r["bytes_moved_per_step"] < r["controlnet_lowvram_bytes_per_step"] for r in recs)
    assert "ControlNet" in sampling._table(recs)
