"""Every size/count option of every command has an upper bound (docs/cli.md): one value past it is
one line naming the option and the bound, exit code 2, before any work.

Each case runs ``main`` in-process with the work itself replaced by a function that fails the test
(the planner, the profiled run, the upscale, the benchmark), so a bound that is checked too late, or
not at all, shows as that failure, not as a slow test.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from conftest import compact_class, save_and_load
from PIL import Image

from lib_vram.cli import common as cli_common
from lib_vram.cli import main

SIDE = cli_common.MAX_SIDE


class ReachedWork(AssertionError):
    pass


def _never(*args, **kwargs):
    raise ReachedWork("the command started working before it checked its options")


@pytest.fixture(autouse=True)
def no_work(monkeypatch):
    """Every command's work fails the test; the bench targets' run functions as well."""
    from lib_vram.cli import bench, placed, profile, stageplan
    from lib_vram.cli import upscale as cli_upscale

    monkeypatch.setattr(stageplan, "plan_job", _never)
    monkeypatch.setattr(placed, "place_checkpoint", _never)
    monkeypatch.setattr(placed, "plan_placed_job", _never)
    monkeypatch.setattr(profile, "_profile", _never)
    monkeypatch.setattr(cli_upscale, "_upscale_one", _never)
    for module_name in bench.TARGETS.values():
        module = __import__(module_name, fromlist=["run"])
        monkeypatch.setattr(module, "run", _never)


def _refused(capsys, argv: list[str]) -> str:
    """Run ``argv``: exit code 2 and exactly one line on stderr (returned)."""
    try:
        rc = main(argv)
    except SystemExit as exc:  # argparse's own checks
        rc = exc.code
    out = capsys.readouterr()
    assert rc == 2, (rc, out.err)
    card = "running on an emulated"  # the one line --emulate-vram prints when it takes effect
    lines = [line for line in out.err.splitlines() if line.strip() and card not in line]
    assert len(lines) == 1, out.err
    return lines[0]


PLAN = ["plan", "--arch", "sd15", "--width", "512", "--height", "512"]


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (
            ["plan", "--arch", "sd15", "--width", str(SIDE + 8), "--height", "512"],
            f"`--width` must be <= {SIDE}",
        ),
        (
            ["plan", "--arch", "sd15", "--width", "512", "--height", str(SIDE + 8)],
            f"`--height` must be <= {SIDE}",
        ),
        (
            ["plan", "--arch", "sd15", "--width", "1000000000", "--height", "512"],
            f"`--width` must be <= {SIDE}",
        ),
        ([*PLAN, "--batch", str(cli_common.MAX_IMAGES + 1)], f"`--batch` must be <= {cli_common.MAX_IMAGES}"),
        ([*PLAN, "--hires", "8.01"], "`--hires` must be <= 8"),
        (
            ["plan", "--arch", "sd15", "--width", "8192", "--height", "512", "--hires", "2.01"],
            f"<= {SIDE} px",
        ),
        ([*PLAN, "--vram", "1025GB"], "`--vram` must be <= 1024GB"),
        ([*PLAN, "--safety-margin", "1025GB"], "`--safety-margin` must be <= 1024GB"),
        ([*PLAN, "--vram", "99999999999999999999999GB"], "`--vram` must be <= 1024GB"),
    ],
)
def test_plan_bounds(capsys, argv, words):
    assert words in _refused(capsys, argv)


def test_plan_at_its_bounds_answers(capsys, monkeypatch):
    """The bound itself is accepted: the planner is reached (and answers within the test's time)."""
    from lib_vram.cli import stageplan

    monkeypatch.undo()
    reached = []
    real = stageplan.plan_job
    monkeypatch.setattr(stageplan, "plan_job", lambda *a, **k: reached.append(a[1:3]) or real(*a, **k))
    argv = ["plan", "--arch", "sdxl", "--width", str(SIDE), "--height", str(SIDE), "--vram", "1024GB"]
    assert main([*argv, "--batch", str(cli_common.MAX_IMAGES), "--json"]) in (0, 3)
    assert reached == [(SIDE, SIDE)]
    capsys.readouterr()


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["profile", "vae", "--size", str(SIDE + 8)], f"`--size` must be <= {SIDE}"),
        (
            ["profile", "vae", "--top", str(cli_common.MAX_COUNT + 1)],
            f"`--top` must be <= {cli_common.MAX_COUNT}",
        ),
        (["profile", "vae", "--tile", str(SIDE // 8 + 1)], f"`--tile` must be <= {SIDE // 8}"),
        (["profile", "upscale", "m.pth", "--size", str(SIDE + 1)], f"`--size` must be <= {SIDE}"),
        (["profile", "upscale", "m.pth", "--tile", str(SIDE + 1)], f"`--tile` must be <= {SIDE}"),
        (
            ["profile", "upscale", "m.pth", "--batch", str(cli_common.MAX_TILE_BATCH + 1)],
            "`--batch` must be <= 256",
        ),
        (["profile", "vae", "--emulate-vram", ""], "`--emulate-vram` is empty"),
        (["profile", "vae", "--emulate-vram", "1025GB"], "`--emulate-vram` must be <= 1024GB"),
    ],
)
def test_profile_bounds(capsys, argv, words):
    assert words in _refused(capsys, argv)


def test_profile_vae_that_does_not_fit_is_refused_before_the_run(capsys):
    """At the size bound a pass needs far more than a 4 GB card: one line before the profiled run."""
    for mode in ("exact", "untiled"):
        line = _refused(
            capsys, ["profile", "vae", "--size", str(SIDE), "--mode", mode, "--emulate-vram", "4GB"]
        )
        assert f"`--size {SIDE}`: the {mode} pass needs about" in line and "GiB is free" in line


def test_profile_out_that_cannot_be_written_is_refused_before_the_run(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    line = _refused(capsys, ["profile", "vae", "--size", "64", "--out", str(blocker / "sub")])
    assert "`--out`" in line and "cannot write there" in line


def _model(tmp_path, scale: int = 2):
    torch.manual_seed(0)
    net = compact_class()(num_in_ch=3, num_out_ch=3, num_feat=8, num_conv=2, upscale=scale)
    path = tmp_path / "m.safetensors"
    save_and_load(net, path)
    return path


def test_profile_upscale_output_side_is_bounded(tmp_path, capsys):
    model = _model(tmp_path)
    line = _refused(capsys, ["profile", "upscale", str(model), "--size", str(SIDE // 2 + 1)])
    assert f"its side must be <= {SIDE}" in line


UP = ["upscale", "in.png", "o.png", "--model", "m.pth"]


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        ([*UP, "--tile", str(SIDE + 1)], f"`--tile` must be <= {SIDE}"),
        ([*UP, "--batch", str(cli_common.MAX_TILE_BATCH + 1)], "`--batch` must be <= 256"),
        ([*UP, "--overlap", str(cli_common.MAX_OVERLAP + 1)], "`--overlap` must be <= 512"),
        ([*UP, "--scale", "16.5"], "`--scale` must be <= 16"),
        ([*UP, "--budget-mb", str(2**20 + 1)], "`--budget-mb` must be <= 1048576"),
        ([*UP, "--emulate-vram", ""], "`--emulate-vram` is empty"),
    ],
)
def test_upscale_option_bounds(capsys, argv, words):
    assert words in _refused(capsys, argv)


def test_upscale_image_whose_largest_pass_is_too_big_is_refused_before_any_work(tmp_path, capsys):
    model = _model(tmp_path)
    src = tmp_path / "in.png"
    Image.new("RGB", (1025, 1025)).save(src)
    # x2 model, --scale 16: passes of x2 up to 3 (x8), then a resize to x16: 16400² > 16384²
    line = _refused(
        capsys, ["upscale", str(src), str(tmp_path / "o.png"), "--model", str(model), "--scale", "16"]
    )
    assert "16400x16400" in line and f"({SIDE}²)" in line
    assert not (tmp_path / "o.png").exists()


def test_largest_pass_follows_the_passes():
    from lib_vram.cli.upscale import largest_pass

    assert largest_pass(100, 50, 4.0, 4) == (400, 200)  # one pass
    assert largest_pass(100, 50, 5.0, 4) == (1600, 800)  # two passes (x16), resized down to x5
    assert largest_pass(100, 50, 16.0, 2) == (1600, 800)  # three passes (x8), resized up to x16


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["bench", "emulate", "--cards", "4,1025"], "`--cards` must be <= 1024 GB"),
        (["bench", "emulate", "--cards", ""], "--cards: expected comma-separated integers"),
        (["bench", "emulate", "--cards", "4,x"], "--cards: expected comma-separated integers"),
        (["bench", "emulate", "--emulate-vram", "1025GB"], "`--emulate-vram` must be <= 1024GB"),
        (["bench", "gpu", "--cards", "1025"], "`--cards` must be <= 1024 GB"),
        (["bench", "gpu", "--budget-s", "86401"], "`--budget-s` must be <= 86400"),
        (["bench", "planner", "--timeout", "86401"], "`--timeout` must be <= 86400"),
        (["bench", "timeline", "--reps", "1001"], "`--reps` must be <= 1000"),
        (["bench", "timeline", "--threads", "1025"], "`--threads` must be <= 1024"),
        (["bench", "vae", "--sizes", f"512,{SIDE + 8}"], f"`--sizes` must be <= {SIDE}"),
        (["bench", "vae", "--predict", str(SIDE + 8)], f"`--predict` must be <= {SIDE}"),
        (["bench", "vae", "--tile", str(SIDE // 8 + 1)], f"`--tile` must be <= {SIDE // 8}"),
        (["bench", "vae", "--threads", "1025"], "`--threads` must be <= 1024"),
        (["bench", "vae", "--fast-sample", "257"], "`--fast-sample` must be <= 256"),
    ],
)
def test_bench_bounds(capsys, argv, words):
    assert words in _refused(capsys, argv)


def test_the_bounds_are_checked_where_a_bound_is_off(capsys, monkeypatch):
    """The tests above can fail: with the width bound lifted, the planner is reached."""
    monkeypatch.setattr(cli_common, "check_int", lambda value, *a, **k: value)
    assert main(["plan", "--arch", "sd15", "--width", "1000000000", "--height", "512"]) == 1
    assert "started working before it checked" in capsys.readouterr().err


# -- torch's own noise -------------------------------------------------------------------------------


def test_torch_jit_load_deprecation_goes_to_the_debug_log(monkeypatch):
    import logging

    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.DEBUG)
    handler.emit = records.append  # type: ignore[method-assign]
    log = logging.getLogger("lib_vram.cli.common")
    monkeypatch.setattr(log, "level", logging.DEBUG)
    log.addHandler(handler)
    shown: list[str] = []
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = lambda message, *a, **k: shown.append(str(message))
        with cli_common.warnings_filtered():
            warnings.warn(
                "`torch.jit.load` is deprecated. Please switch to `torch.export`.", FutureWarning, 1
            )
            warnings.warn("something else is deprecated", FutureWarning, 1)
    assert shown == ["something else is deprecated"]  # every other warning is shown as before
    log.removeHandler(handler)
    assert any("torch.jit.load" in r.getMessage() for r in records)


def test_the_profilers_native_noise_is_filtered_and_the_rest_kept():
    """Kineto writes to file descriptor 2 from C++: checked in a child process with a real stderr."""
    import subprocess
    import sys

    code = (
        "import os\n"
        "from lib_vram.cli.common import native_stderr_filtered\n"
        "with native_stderr_filtered():\n"
        "    os.write(2, b'USDT:2026-12-01 23:31:24 29125:29125 SyncActivityProfilerHandler.cpp:39] "
        "profiler_start\\n')\n"
        "    os.write(2, b'ERROR:2026-12-01 23:31:31 29125:29125 DeviceProperties.cpp:56] "
        "gpuGetDeviceCount failed with code 35\\n')\n"
        "    os.write(2, b'a real problem\\n')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == "a real problem\n"


def test_bench_json_is_strict_json():
    """An identical picture's PSNR is infinite: ``--json`` writes ``null``, not Python's
    ``Infinity`` that strict JSON parsers reject."""
    import json

    text = cli_common.strict_json({"psnr": float("inf"), "rows": [float("nan"), 1.5], "n": 2})
    assert json.loads(text, parse_constant=lambda c: pytest.fail(f"non-JSON constant {c}")) == {
        "psnr": None,
        "rows": [None, 1.5],
        "n": 2,
    }
