"""``python -m lib_vram profile``: the operators that took the memory, on the CPU with real modules
(ldm VAE of the SD layout at small widths, a spandrel model loaded from a file)."""

from __future__ import annotations

import contextlib
import io
import json

import pytest
import torch
from conftest import compact_class, save_and_load

from lib_vram.cli import EMULATE_ENV, main
from lib_vram.core import emulate
from lib_vram.core.profiling import StageProfiler, profiler_running


@pytest.fixture(autouse=True)
def _no_inherited_card(monkeypatch):
    monkeypatch.delenv(EMULATE_ENV, raising=False)
    yield
    assert emulate.installed() is None and emulate.current() is None
    assert not profiler_running()


def _json(capsys, argv) -> dict:
    assert main(argv) == 0
    out = capsys.readouterr().out
    return json.loads(out)


def _err(capsys, argv) -> str:
    try:
        rc = main(argv)
    except SystemExit as exc:  # argparse's own checks (one line, exit 2)
        rc = exc.code
    err = capsys.readouterr().err
    assert rc == 2, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    return lines[0]


def test_untiled_decode_top_operators_and_peak_match_the_emulated_card(capsys):
    """On an emulated card the tracker counts every tensor byte on the device: the profiler's own
    count of the stage's tensors at once must agree with it, and the convolutions lead."""
    rec = _json(
        capsys,
        [
            "profile",
            "vae",
            "--size",
            "64",
            "--mode",
            "untiled",
            "--emulate-vram",
            "8GB",
            "--json",
            "--top",
            "5",
        ],
    )
    ops = rec["profile"]["ops"]
    assert ops[0]["name"] == "aten::conv2d" and ops[0]["calls"] == 39  # the SD decoder's 39 convs
    assert {"aten::group_norm", "aten::conv2d"} <= {o["name"] for o in ops}
    # the largest convolution's output (ch 32 x 64x64 fp32 at the last level) was allocated by it
    assert ops[0]["largest_call_bytes"] >= 32 * 64 * 64 * 4
    assert rec["plan"] == "untiled" and rec["tracker"]["measure"] == "emulated"
    tracker_peak = rec["tracker"]["peak_above_start_bytes"]
    assert tracker_peak > 0
    assert rec["profile"]["peak_bytes"] == pytest.approx(tracker_peak, rel=0.02)
    assert rec["profile"]["alloc_bytes"] >= sum(o["alloc_bytes"] for o in ops)


def test_exact_tiles_lower_the_peak(capsys):
    argv = ["profile", "vae", "--size", "64", "--emulate-vram", "8GB", "--json"]
    whole = _json(capsys, [*argv, "--mode", "untiled"])
    tiled = _json(capsys, [*argv, "--tile", "4"])
    assert tiled["plan"] == "exact t4 x4"
    assert tiled["profile"]["ops"][0]["name"] == "aten::conv2d"
    assert tiled["profile"]["peak_bytes"] < whole["profile"]["peak_bytes"]
    assert tiled["profile"]["peak_bytes"] == pytest.approx(
        tiled["tracker"]["peak_above_start_bytes"], rel=0.02
    )


def test_encode_fast_and_diffusers_run(capsys):
    rec = _json(
        capsys, ["profile", "vae", "--size", "32", "--encode", "--mode", "fast", "--tile", "2", "--json"]
    )
    assert rec["stage"] == "vae_encode" and rec["plan"].startswith("fast t2")
    assert "aten::conv2d" in [o["name"] for o in rec["profile"]["ops"]]
    rec = _json(capsys, ["profile", "vae", "--size", "32", "--family", "diffusers", "--json"])
    assert "diffusers small" in rec["description"]
    assert "aten::conv2d" in [o["name"] for o in rec["profile"]["ops"]]


def test_out_writes_trace_and_summary_atomically_and_never_overwrites(tmp_path, capsys):
    out = tmp_path / "prof"
    argv = ["profile", "vae", "--size", "32", "--mode", "untiled", "--out", str(out)]
    assert main(argv) == 0
    cap = capsys.readouterr()
    assert "untiled" in cap.out.splitlines()[0] and "aten::conv2d" in cap.out
    peak_line = next(line for line in cap.out.splitlines() if line.startswith("peak:"))
    assert "above the stage's start (tracker, " in peak_line and "tensors allocated at once" in peak_line
    trace = out / "vae_decode-32-untiled.trace.json"
    summary = out / "vae_decode-32-untiled.summary.json"
    assert f"wrote {trace}" in cap.out and f"wrote {summary}" in cap.out
    assert "CUDA-only" in cap.err  # no snapshot on the CPU, and it says so
    events = json.loads(trace.read_text())["traceEvents"]
    assert any(e.get("name") == "aten::conv2d" for e in events)
    assert any(e.get("name") == "[memory]" for e in events)
    data = json.loads(summary.read_text())
    assert data["ops"][0]["name"] == "aten::conv2d" and data["files"]["trace"] == str(trace)
    assert sorted(p.name for p in out.iterdir()) == sorted([trace.name, summary.name])  # no temp left
    before = trace.stat().st_mtime_ns
    line = _err(capsys, argv)
    assert "exists" in line and "--overwrite" in line and trace.stat().st_mtime_ns == before
    assert main([*argv, "--overwrite"]) == 0
    assert trace.stat().st_mtime_ns != before


def test_upscale_profile_with_a_model_file(tmp_path, capsys):
    torch.manual_seed(0)
    net = compact_class()(num_in_ch=3, num_out_ch=3, num_feat=8, num_conv=2, upscale=2)
    path = tmp_path / "tiny.safetensors"
    save_and_load(net, path)
    rec = _json(capsys, ["profile", "upscale", str(path), "--size", "32", "--tile", "16", "--json"])
    assert rec["stage"] == "upscale" and "16" in rec["plan"]
    names = [o["name"] for o in rec["profile"]["ops"]]
    assert "aten::conv2d" in names[:3]


def test_checkpoint_weights_are_loaded_and_bad_files_are_one_line(tmp_path, capsys):
    from safetensors.torch import save_file

    with contextlib.redirect_stdout(io.StringIO()):
        from ldm.modules.diffusionmodules.model import Decoder

        from lib_vram.cli.hostmodels import SD_VAE

        torch.manual_seed(3)
        dec = Decoder(**{**SD_VAE, "ch": 32, "ch_mult": (1, 2)}).eval()
    ckpt = tmp_path / "vae.safetensors"
    save_file({f"first_stage_model.decoder.{k}": v.contiguous() for k, v in dec.state_dict().items()}, ckpt)
    rec = _json(capsys, ["profile", "vae", "--size", "32", "--checkpoint", str(ckpt), "--json"])
    assert "vae.safetensors" in rec["description"]
    pt = tmp_path / "vae.pt"  # a torch file of the VAE alone (keys decoder.*, encoder.*)
    torch.save({f"decoder.{k}": v for k, v in dec.state_dict().items()}, pt)
    rec = _json(capsys, ["profile", "vae", "--size", "32", "--checkpoint", str(pt), "--json"])
    assert "vae.pt" in rec["description"] and rec["profile"]["ops"][0]["name"] == "aten::conv2d"
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"not a model")
    assert "cannot read" in _err(capsys, ["profile", "vae", "--checkpoint", str(bad)])
    other = tmp_path / "other.safetensors"
    save_file({"unet.weight": torch.zeros(2)}, other)
    assert "no ldm-layout VAE decoder" in _err(capsys, ["profile", "vae", "--checkpoint", str(other)])
    assert "not found" in _err(capsys, ["profile", "vae", "--checkpoint", str(tmp_path / "missing.pt")])


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["vae", "--size", "60"], "multiple of 8"),
        (["vae", "--size", "0"], "--size"),
        (["vae", "--mode", "untiled", "--tile", "8"], "--tile"),
        (["vae", "--top", "0"], "--top"),
        (["vae", "--layout", "xl"], "--layout"),
        (["vae", "--device", "cuda:7"], "--device"),
        (["vae", "--emulate-vram", "lots"], "--emulate-vram"),
        (["upscale", "missing.pth"], "not found"),
    ],
)
def test_bad_options_are_one_line_before_any_work(argv, words, capsys):
    assert words in _err(capsys, ["profile", *argv])


def test_out_that_is_a_file_and_a_corrupt_model_are_one_line(tmp_path, capsys):
    f = tmp_path / "file"
    f.write_text("x")
    assert "is a file" in _err(capsys, ["profile", "vae", "--out", str(f)])
    model = tmp_path / "model.pth"
    model.write_bytes(b"\x00garbage")
    assert "model" in _err(capsys, ["profile", "upscale", str(model)])


@pytest.mark.parametrize("exc", [RuntimeError("boom"), KeyboardInterrupt()])
def test_the_profiler_is_stopped_when_the_stage_fails_or_is_interrupted(exc):
    conv = torch.nn.Conv2d(3, 8, 3)
    prof = StageProfiler("x", "cpu")
    with pytest.raises(type(exc)), prof:
        conv(torch.randn(1, 3, 16, 16))
        raise exc
    assert not profiler_running()
    assert prof.summary is not None and not prof.summary.ok
    assert prof.summary.ops[0].name == "aten::conv2d"
    with StageProfiler("again", "cpu"):  # a new profile can start
        pass


def test_a_size_past_the_bound_names_vram_guard(capsys):
    """The refusal's reason names the product (it said 'VAE Guard')."""
    err = _err(capsys, ["profile", "vae", "--size", "99992"])
    assert "the largest image side VRAM Guard makes" in err and "VAE Guard" not in err
