from __future__ import annotations

import json

import pytest

from lib_vram.cli import main
from lib_vram.cli import plan as _cli_plan
from lib_vram.planning.presets import PRESET_NAMES

RECORD_KEYS = {
    "stage",
    "plan",
    "predicted_peak_bytes",
    "fits",
    "budget_bytes",
    "safety_margin_bytes",
    "warning",
}


def _plan(capsys, *argv: str) -> tuple[int, dict]:
    rc = main(["plan", *argv, "--json"])
    return rc, json.loads(capsys.readouterr().out)


def _stage(rep: dict, name: str) -> dict:
    (s,) = [s for s in rep["stages"] if s["stage"] == name]
    return s


def test_sdxl_2048_decode_plans_to_fit_4gb(capsys):
    rc, rep = _plan(
        capsys, "--arch", "sdxl", "--width", "2048", "--height", "2048", "--vram", "4GB", "--no-place"
    )
    # the decode fits; SDXL's sampling does not on 4 GB unplaced (its UNet alone is 4.8 GiB): exit 3
    assert rc == 3 and not _stage(rep, "sample")["fits"]
    assert rep["preset"] == "Auto" and rep["resolved_from"] == "4GB" and rep["emulated"]
    dec = _stage(rep, "vae_decode")
    assert set(dec) >= RECORD_KEYS
    assert dec["stage"] == "vae_decode" and dec["fits"] and dec["plan"].startswith("exact t")
    assert dec["predicted_peak_bytes"] <= dec["budget_bytes"] < 4 * 2**30
    # Untiled was tried first and did not fit.
    assert dec["candidates"][0]["plan"] == "untiled"
    assert dec["candidates"][0]["predicted_peak_bytes"] > dec["budget_bytes"]


def test_4x_upscale_of_1024_plans_to_fit_4gb(capsys):
    rc, rep = _plan(
        capsys, "--arch", "sd15", "--width", "1024", "--height", "1024", "--upscaler", "rrdb", "--vram", "4GB"
    )
    assert rc == 0
    up = rep["stages"][-1]
    assert up["stage"] == "upscale" and up["fits"] and up["tile"] is not None


def test_doomed_run_is_warned_before_it_starts(capsys):
    rc, rep = _plan(
        capsys,
        "--arch",
        "sd15",
        "--width",
        "512",
        "--height",
        "512",
        "--vram",
        "4GB",
        "--safety-margin",
        "3.9GB",
    )
    assert rc == 3
    dec = _stage(rep, "vae_decode")
    assert not dec["fits"] and "out-of-memory" in dec["warning"]


def test_table_output(capsys):
    assert main(["plan", "--arch", "sd15", "--width", "512", "--height", "512", "--vram", "8GB"]) == 0
    out = capsys.readouterr().out
    assert "vae_decode" in out and "untiled" in out and "preset Auto (8GB)" in out


@pytest.mark.parametrize(
    ("text", "value"), [("6GB", 6 * 2**30), ("5.5GiB", int(5.5 * 2**30)), ("4096MB", 2**32)]
)
def test_parse_size(text, value):
    assert _cli_plan.parse_size(text) == value


def test_parse_size_rejects_garbage():
    with pytest.raises(ValueError, match="`--vram`"):
        _cli_plan.parse_size("lots")


def test_doctor_recommends_a_preset(capsys):
    assert main(["doctor", "--json", "--device", "cpu"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["recommended_preset"] in PRESET_NAMES and rep["recommended_preset"] == rep["tier"]["label"]


def test_bench_planner_is_registered_and_rejects_unknown_cases(capsys):
    assert main(["bench", "planner", "--case", "no-such-case"]) == 2
    assert "`--case`" in capsys.readouterr().err


def _rc(argv: list[str]) -> int:
    """main's exit code; argparse's own checks (``type=``) exit 2 through SystemExit."""
    try:
        return main(argv)
    except SystemExit as exc:
        return int(exc.code)


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--safety-margin=-1GB"], "`--safety-margin` must be >= 0"),
        (["--safety-margin", "lots"], "`--safety-margin` must look like"),
        (["--vram", "0GB"], "`--vram` must be > 0"),
        (["--hires", "inf"], "`--hires`"),
        (["--hires", "nan"], "`--hires`"),
        (["--hires", "1"], "`--hires` must be a finite number > 1"),
        (["--batch", "0"], "`--batch`"),
    ],
)
def test_bad_options_name_themselves(capsys, args, words):
    assert _rc(["plan", "--arch", "sd15", "--width", "512", "--height", "512", *args]) == 2
    err = capsys.readouterr().err
    assert words in err and err.count("\n") == 1


def test_bad_size_is_refused(capsys):
    assert _rc(["plan", "--arch", "sd15", "--width", "500", "--height", "512"]) == 2
    assert "`--width` must be a multiple of 8" in capsys.readouterr().err


def test_zero_safety_margin_is_allowed(capsys):
    rc, rep = _plan(
        capsys, "--arch", "sd15", "--width", "512", "--height", "512", "--vram", "8GB", "--safety-margin", "0"
    )
    assert rc == 0 and rep["stages"][0]["safety_margin_bytes"] == 0


class _Terminal:
    def __init__(self):
        self.parts = []

    def write(self, text):
        self.parts.append(text)

    def flush(self):
        pass

    def isatty(self):
        return True


@pytest.mark.parametrize("tty", [True, False])
def test_a_slow_plan_shows_progress(capsys, monkeypatch, tty):
    """Planning large sizes takes a while: after PROGRESS_AFTER_S the command says it is working
    (an updating line on a terminal, a single line into pipes)."""
    import time

    from lib_vram.cli import stageplan

    real = stageplan.plan_job

    def slow(*a, **k):
        time.sleep(1.3)
        return real(*a, **k)

    monkeypatch.setattr(stageplan, "plan_job", slow)
    monkeypatch.setattr(_cli_plan, "PROGRESS_AFTER_S", 0.05)
    term = _Terminal()
    if tty:
        monkeypatch.setattr("sys.stderr", term)
    rc = main(["plan", "--arch", "sd15", "--width", "512", "--height", "512", "--vram", "8GB", "--json"])
    out = capsys.readouterr()
    assert rc == 0 and json.loads(out.out)["stages"]
    if tty:
        text = "".join(term.parts)
        assert text.count("\rplanning sd15 512x512:") >= 2 and text.endswith("\n")
    else:
        assert out.err == "planning sd15 512x512 (large sizes take a while)...\n"


def test_a_quick_plan_prints_no_progress(capsys, monkeypatch):
    monkeypatch.setattr(_cli_plan, "PROGRESS_AFTER_S", 600.0)  # "quick", whatever the machine's load
    assert main(["plan", "--arch", "sd15", "--width", "512", "--height", "512", "--vram", "8GB"]) == 0
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("target", ["upscale", "vae"])
def test_bench_checks_the_device_first(capsys, target):
    assert main(["bench", target, "--device", "banana"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: `--device banana`: not a device name") and err.count("\n") == 1


def _sdxl_6144(capsys, vram: str, *extra: str) -> tuple[int, dict]:
    """The plain plan (not placed: the checkpoint placement is the WebUI's option)."""
    argv = ("--arch", "sdxl", "--width", "6144", "--height", "6144", "--vram", vram, *extra)
    return _plan(capsys, *argv, *(() if "--medvram" in extra else ("--no-place",)))


def test_a_decode_that_fits_only_without_the_idle_models_plans_them_off_the_card(capsys):
    """8 GB, SDXL 6144²: the UNet and text encoders (6.3 GiB) stay on the card, and the decode's
    whole-latent stage does not fit beside them: the plan moves them off for that pass, as the
    WebUI does (lib_vram.webui.offload)."""
    from lib_vram.planning.reference import vae_arch

    rc, rep = _sdxl_6144(capsys, "8GB")
    assert rep["host_swaps_models"] is None
    dec = _stage(rep, "vae_decode")
    assert dec["moved_off_card"] == ["UNet", "text encoders"] and dec["fits"]
    assert dec["resident_bytes"] == 0
    # with them on the card the same pass would not fit
    a = vae_arch("sdxl")
    assert dec["predicted_peak_bytes"] + a.unet_bytes + a.text_encoder_bytes > dec["budget_bytes"]
    # a smaller image fits beside them: nothing moves
    rc, rep = _plan(
        capsys, "--arch", "sdxl", "--width", "2048", "--height", "2048", "--vram", "8GB", "--no-place"
    )
    dec = _stage(rep, "vae_decode")
    assert dec["moved_off_card"] == [] and dec["resident_bytes"] == a.unet_bytes + a.text_encoder_bytes


def test_a_card_the_models_alone_fill_is_planned_as_the_hosts_own_swapping(capsys):
    rc, rep = _sdxl_6144(capsys, "4GB")
    assert rep["host_swaps_models"] == "inferred"
    assert all(s["resident_bytes"] == 0 and s["moved_off_card"] == [] for s in rep["stages"])
    rc, rep = _sdxl_6144(capsys, "8GB", "--medvram")
    assert rep["host_swaps_models"] == "flag"
    assert all(s["resident_bytes"] == 0 for s in rep["stages"])
    # unplaced, SDXL's sampling does not fit 4 GB at any size (its UNet alone is 4.8 GiB): exit 3, said
    assert (
        main(["plan", "--arch", "sdxl", "--width", "6144", "--height", "6144", "--vram", "4GB", "--no-place"])
        == 3
    )
    out = capsys.readouterr().out
    assert "--medvram/--lowvram" in out and "weights alone do not fit" in out


# -- the sampling stages ---------------------------------------------------------------------------


def test_hires_job_lists_every_stage_with_sampling(capsys):
    rc, rep = _plan(
        capsys, "--arch", "sd15", "--width", "512", "--height", "768", "--hires", "2", "--upscaler", "rrdb",
        "--vram", "4GB",
    )  # fmt: skip
    names = [s["stage"] for s in rep["stages"]]
    want = ["sample", "vae_decode", "hires_upscale", "vae_encode", "sample_hires", "vae_decode_hires"]
    assert names == want
    assert rc == 0
    for name in ("sample", "sample_hires"):
        s = _stage(rep, name)
        assert s["attention"] == "doggettx"  # the WebUI's Automatic on CUDA with no flags
        assert s["fits"] and s["batch"] in (1, 2) and s["activation_bytes"] > 0
        assert s["predicted_peak_bytes"] >= s["model_weights_bytes"] + s["activation_bytes"]
    # the hires pass has 4x the tokens: with ldm's own attention its activations grow ~16x
    rc, rep = _plan(
        capsys, "--arch", "sd15", "--width", "512", "--height", "768", "--hires", "2", "--attention", "None",
        "--vram", "80GB",
    )  # fmt: skip
    assert _stage(rep, "sample_hires")["activation_bytes"] > 10 * _stage(rep, "sample")["activation_bytes"]


def test_sampling_micro_batches_when_activations_do_not_fit(capsys):
    """SD1.5, 8 images at 1024x1024 with SDP on 4 GB: the forward of 16 samples does not fit; a
    smaller micro-batch does."""
    rc, rep = _plan(
        capsys, "--arch", "sd15", "--width", "1024", "--height", "1024", "--batch-size", "8", "--attention",
        "sdp", "--vram", "4GB",
    )  # fmt: skip
    s = _stage(rep, "sample")
    assert s["fits"] and 1 <= s["batch"] < 16 and s["plan"] == f"micro-batch {s['batch']} of 16"
    whole = next(c for c in s["candidates"] if c["batch"] == 16)
    assert whole["predicted_peak_bytes"] > s["budget_bytes"] >= s["predicted_peak_bytes"]


def test_idle_models_leave_the_card_for_sampling_only_when_needed(capsys):
    sd15 = ("--arch", "sd15", "--width", "512", "--height", "512", "--attention", "sdp", "--no-place")
    rc, rep = _plan(capsys, *sd15, "--vram", "2.4GB")
    s = _stage(rep, "sample")
    assert s["fits"] and s["moved_off_card"] == [] and s["resident_bytes"] > 0  # VAE, text encoders stay
    # on 2.3 GB they do not fit beside the step: the VAE and the text encoders leave for it
    rc, rep = _plan(capsys, *sd15, "--vram", "2.3GB")
    s = _stage(rep, "sample")
    assert s["fits"] and s["moved_off_card"] == ["VAE", "text encoders"] and s["resident_bytes"] == 0
    # with --medvram the host moves them itself: nothing is planned off
    rc, rep = _plan(capsys, *sd15, "--vram", "2.3GB", "--medvram")
    assert _stage(rep, "sample")["moved_off_card"] == []


def test_nothing_fits_gives_one_line_with_a_size_and_batch(capsys):
    argv = ("--arch", "sd15", "--width", "2048", "--height", "1536", "--attention", "None", "--vram", "4GB")
    rc, rep = _plan(capsys, *argv)
    assert rc == 3
    s = _stage(rep, "sample")
    assert not s["fits"] and s["batch"] == 1
    line = s["suggestion"]
    assert "\n" not in line and "px fits at batch 1" in line and "no batch fits at this size" in line
    # the suggested size keeps the aspect (4:3) in multiples of 64 and does fit
    import re

    w, h = (int(v) for v in re.search(r"(\d+)x(\d+) px fits", line).groups())
    assert w % 64 == 0 and h % 64 == 0 and abs(w / h - 4 / 3) < 0.1
    rc, rep = _plan(capsys, "--arch", "sd15", "--width", str(w), "--height", str(h), "--attention", "None",
                    "--vram", "4GB")  # fmt: skip
    assert _stage(rep, "sample")["fits"]
    assert main(["plan", "--arch", "sd15", "--width", "2048", "--height", "1536", "--attention", "None",
                 "--vram", "4GB"]) == 3  # fmt: skip
    assert "does not fit: sample:" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--batch-size", "33"], "`--batch` must be <= 32"),
        (["--batch-size", "0"], "`--batch` must be >= 1"),
    ],
)
def test_sampling_batch_is_bounded(capsys, argv, message):
    """The bound is argparse's (refused before any work, exit 2, one line naming the option)."""
    with pytest.raises(SystemExit) as exc:
        main(["plan", "--arch", "sd15", "--width", "512", "--height", "512", *argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_an_unknown_attention_is_refused_in_one_line(capsys):
    argv = ["plan", "--arch", "sd15", "--width", "512", "--height", "512", "--attention", "flash"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: `--attention flash`") and err.count("\n") == 1
