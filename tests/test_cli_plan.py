from __future__ import annotations

import json

import pytest

from lib_vram.cli import main
from lib_vram.cli import plan as _cli_plan
from lib_vram.core.emulate import parse_size
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
    assert parse_size(text, "--vram") == value


def test_parse_size_rejects_garbage():
    with pytest.raises(ValueError, match="`--vram`"):
        parse_size("lots", "--vram")


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
    # on 2.25 GB they do not fit beside the step: the VAE and the text encoders leave for it
    rc, rep = _plan(capsys, *sd15, "--vram", "2.25GB")
    s = _stage(rep, "sample")
    assert s["fits"] and s["moved_off_card"] == ["VAE", "text encoders"] and s["resident_bytes"] == 0
    # with --medvram the host moves them itself: nothing is planned off
    rc, rep = _plan(capsys, *sd15, "--vram", "2.25GB", "--medvram")
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


# -- the checkpoint placement (issue 29 item 3) ----------------------------------------------------

PLAIN_KEYS = {
    "schema", "arch", "width", "height", "batch", "hires", "upscaler", "preset", "resolved_from",
    "total_bytes", "free_bytes", "emulated", "memory_fraction_set", "host_swaps_models", "models_bytes",
    "stages", "planning_seconds", "controlnets", "controlnet_hires",
}  # fmt: skip
"""The top-level keys of the plain plan (before the placement; the ControlNet units since issue 30)."""
STAGE_KEYS = RECORD_KEYS | {
    "resident_bytes", "model_weights_bytes", "input_bytes", "activation_bytes", "tile", "batch", "dtype",
    "moved_off_card", "candidates",
}  # fmt: skip
PLACED_KEYS = {
    "placed",
    "models",
    "resident_mib",
    "streamed_mib",
    "bytes_moved_per_step",
    "lowvram_bytes_per_step",
}
MiB = 1 << 20


@pytest.mark.parametrize(
    ("arch", "side", "vram"),
    [("sdxl", "1024", "4GB"), ("sd15", "512", "2GB")],
)
def test_a_checkpoint_larger_than_the_card_is_planned_placed(capsys, arch, side, vram):
    """SDXL 1024² on 4 GB and SD1.5 512² on 2 GB: the plain plan says the UNet does not fit; the
    WebUI's placement runs them (text encoders and VAE on the CPU until used, part of the UNet
    resident, the rest streamed): ``plan`` plans that, per stage, and it fits."""
    rc, rep = _plan(capsys, "--arch", arch, "--width", side, "--height", side, "--vram", vram)
    assert rc == 0 and rep["placed"] is True and rep["placed_by"] == "auto"
    assert set(rep) >= PLAIN_KEYS and rep["host_swaps_models"] is None
    p = rep["placement"]
    assert p["needed"] and p["fits"] and p["line"] is None
    assert p["checkpoint_bytes"] + p["working_margin_bytes"] > rep["total_bytes"]
    assert 0 < p["unet_resident_bytes"] < p["unet_bytes"] and p["units_streamed"] > 0
    # host memory: the parked parts and the streamed units' copies
    parked = sum(m["mib"] for m in p["parked"]) * MiB
    assert rep["host_bytes"] == p["host_bytes"]
    assert abs(rep["host_bytes"] - (p["unet_streamed_bytes"] + parked)) < MiB
    assert [s["stage"] for s in rep["stages"]] == ["conditioning", "sample", "vae_decode"]
    where = {}
    for s in rep["stages"]:
        assert set(s) >= STAGE_KEYS | PLACED_KEYS and s["placed"] is True
        assert s["fits"] and s["predicted_peak_bytes"] <= s["budget_bytes"]
        assert s["resident_mib"] > 0 and s["streamed_mib"] == pytest.approx(
            p["unet_streamed_bytes"] / MiB, abs=0.1
        )
        models = {m["name"]: m for m in s["models"]}
        assert set(models) == {"UNet", "text encoders", "VAE"}
        assert models["UNet"]["where"] == "streamed"
        assert models["UNet"]["card_mib"] == pytest.approx(p["unet_resident_bytes"] / MiB, abs=0.1)
        where[s["stage"]] = (models["text encoders"]["where"], models["VAE"]["where"])
        on_card = p["leftover_bytes"] + sum(m["card_mib"] for m in s["models"]) * MiB
        assert s["resident_mib"] == pytest.approx(on_card / MiB, abs=0.3)
    assert where == {
        "conditioning": ("card", "host"),
        "sample": ("host", "host"),
        "vae_decode": ("host", "card"),
    }
    # sampling: the UNet's resident part + the stream buffer, the activations and the inputs; the
    # bytes moved per step are a fraction of --lowvram's
    s = _stage(rep, "sample")
    assert s["model_weights_bytes"] == p["unet_resident_bytes"] + p["stream_buffer_bytes"]
    assert s["predicted_peak_bytes"] == (
        s["model_weights_bytes"] + s["resident_bytes"] + s["input_bytes"] + s["activation_bytes"]
    )
    assert 0 < s["bytes_moved_per_step"] < s["lowvram_bytes_per_step"]
    assert s["lowvram_ratio"] == pytest.approx(
        s["bytes_moved_per_step"] / s["lowvram_bytes_per_step"], abs=1e-3
    )
    # the text: where the parts are, the bytes per step against --lowvram's, the host memory
    assert main(["plan", "--arch", arch, "--width", side, "--height", side, "--vram", vram]) == 0
    out = capsys.readouterr().out
    assert "checkpoint placed" in out and "on the CPU until used" in out and "host memory it needs" in out
    assert f"{s['lowvram_ratio']:.2f}x" in out and "does not fit" not in out


def test_a_card_too_small_even_placed_says_in_one_line_what_would_fit(capsys):
    """SDXL on 1 GB: even placed it does not fit (its text encoders alone fill the card): one line
    naming the card that would, and that card does."""
    import re

    rc, rep = _plan(capsys, "--arch", "sdxl", "--width", "1024", "--height", "1024", "--vram", "1GB")
    assert rc == 3 and rep["placed"] and not rep["placement"]["fits"]
    line = rep["placement"]["line"]
    assert "\n" not in line and "cannot be placed" in line
    gb = re.search(r"a card of ([\d.]+) GB or more would", line).group(1)
    assert rep["placement"]["smallest_card_bytes"] == int(float(gb) * 2**30)
    assert main(["plan", "--arch", "sdxl", "--width", "1024", "--height", "1024", "--vram", "1GB"]) == 3
    out = capsys.readouterr().out
    told = [ln for ln in out.splitlines() if ln.startswith(("does not fit", "warning"))]
    assert told == [f"does not fit: {line}"]
    rc, rep = _plan(capsys, "--arch", "sdxl", "--width", "1024", "--height", "1024", "--vram", f"{gb}GB")
    assert rc == 0 and rep["placed"] and rep["placement"]["fits"]
    # 256 MiB less does not
    less = f"{int(float(gb) * 1024) - 256}MB"
    rc, rep = _plan(
        capsys, "--arch", "sdxl", "--width", "1024", "--height", "1024", "--vram", less, "--place"
    )
    assert rc == 3 and not rep["placement"]["fits"]


def test_a_pass_too_large_for_the_placed_checkpoint_names_what_would_fit(capsys):
    rc, rep = _plan(capsys, "--arch", "sd15", "--width", "4096", "--height", "4096", "--attention", "None",
                    "--vram", "2GB")  # fmt: skip
    assert rc == 3 and rep["placed"] and rep["placement"]["fits"]
    s = _stage(rep, "sample")
    assert (
        not s["fits"]
        and "with the checkpoint placed" in s["suggestion"]
        and "fits at batch" in s["suggestion"]
    )


def test_no_place_gives_the_plain_plan_unchanged(capsys):
    argv = ["plan", "--arch", "sdxl", "--width", "1024", "--height", "1024", "--vram", "4GB", "--no-place"]
    assert main(argv) == 3
    out = capsys.readouterr().out
    assert "weights alone do not fit" in out and "placed" not in out and "conditioning" not in out
    rc, rep = _plan(capsys, *argv[1:])
    assert set(rep) == PLAIN_KEYS and rep["host_swaps_models"] == "inferred"
    assert [s["stage"] for s in rep["stages"]] == ["sample", "vae_decode"]
    assert all(set(s).isdisjoint(PLACED_KEYS) for s in rep["stages"])
    # a checkpoint that fits the card is not placed: the same plain plan with or without the flag
    fits = ["plan", "--arch", "sd15", "--width", "512", "--height", "512", "--vram", "8GB"]
    assert main(fits) == 0
    plain = capsys.readouterr().out
    assert main([*fits, "--no-place"]) == 0
    assert capsys.readouterr().out == plain and "placed" not in plain


def test_place_plans_the_placement_where_the_webui_would_not(capsys):
    rc, rep = _plan(
        capsys, "--arch", "sd15", "--width", "512", "--height", "512", "--vram", "24GB", "--place"
    )
    assert rc == 0 and rep["placed_by"] == "flag" and not rep["placement"]["needed"]
    assert rep["placement"]["units_streamed"] == 0 and _stage(rep, "sample")["bytes_moved_per_step"] == 0
    assert (
        main(["plan", "--arch", "sd15", "--width", "512", "--height", "512", "--vram", "24GB", "--place"])
        == 0
    )
    assert "the WebUI would not place it" in capsys.readouterr().out


def test_a_placed_hires_job_plans_every_stage(capsys):
    rc, rep = _plan(
        capsys, "--arch", "sdxl", "--width", "1024", "--height", "1024", "--hires", "1.5",
        "--upscaler", "rrdb", "--vram", "6GB",
    )  # fmt: skip
    want = [
        "conditioning",
        "sample",
        "vae_decode",
        "hires_upscale",
        "vae_encode",
        "sample_hires",
        "vae_decode_hires",
    ]
    assert rep["placed"] and [s["stage"] for s in rep["stages"]] == want
    for s in rep["stages"]:
        models = {m["name"]: m["where"] for m in s["models"]}
        vae = "card" if s["stage"].startswith("vae_") else "host"
        assert models["VAE"] == vae and models["UNet"] == "streamed"
        assert (s["bytes_moved_per_step"] is not None) == s["stage"].startswith("sample")
    assert (
        _stage(rep, "sample_hires")["bytes_moved_per_step"] >= _stage(rep, "sample")["bytes_moved_per_step"]
    )


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--place", "--medvram"], "`--place` and `--medvram` exclude each other"),
        (["--place", "--no-place"], "not allowed with argument"),
    ],
)
def test_place_conflicts_are_refused_in_one_line(capsys, argv, words):
    assert _rc(["plan", "--arch", "sdxl", "--width", "1024", "--height", "1024", *argv]) == 2
    err = capsys.readouterr().err
    assert words in err and err.count("\n") == 1


def test_sd3_is_not_placed_in_one_line(capsys):
    rc, rep = _plan(
        capsys, "--arch", "sd3", "--width", "1024", "--height", "1024", "--vram", "24GB", "--place"
    )
    assert rep["placed"] is False and "not placed" in rep["place_note"]
    assert [s["stage"] for s in rep["stages"]] == ["vae_decode"]
    assert (
        main(["plan", "--arch", "sd3", "--width", "1024", "--height", "1024", "--vram", "24GB", "--place"])
        == 0
    )
    out = capsys.readouterr().out
    assert sum("not placed" in ln for ln in out.splitlines()) == 1


# -- the reference UNet's units --------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["sd15", "sd2", "sdxl"])
def test_reference_units_sum_to_the_closed_form_parameter_count(arch):
    from lib_vram.cli.refunet import reference_units
    from lib_vram.sampling import param_count, reference_spec

    units = reference_units(arch, 2)
    total = sum(b for _, b in units)
    assert total == 2 * param_count(reference_spec(arch))
    assert len({n for n, _ in units}) == len(units)


def test_reference_units_match_ldm_unet_for_sd15():
    """Name for name and byte for byte: the SD1.5 UNet of ldm (the WebUI's) on the meta device."""
    pytest.importorskip("ldm")
    from lib_vram.cli.models.unet import build_unet
    from lib_vram.cli.refunet import reference_units
    from lib_vram.sampling import unit_bytes

    ldm_units = [(n, b // 2) for n, b in unit_bytes(build_unet("sd15", 320, context_dim=768, meta=True))]
    assert reference_units("sd15", 2) == ldm_units


def test_plan_checkpoint_of_a_card_too_small_for_any_micro_batch_does_not_fit():
    """The attention refuses every micro-batch at this budget: the placed plan does not fit (the
    WebUI's placement then says so in its line) instead of raising."""
    import torch

    from lib_vram.cli.refunet import reference_units
    from lib_vram.residency import plan_checkpoint
    from lib_vram.sampling import reference_spec

    cp = plan_checkpoint(
        reference_units("sdxl", 2), reference_spec("sdxl"), card_bytes=1 << 30, safety_bytes=256 * MiB,
        leftover_bytes=0, parked=[("text encoders", 1564 * MiB), ("VAE", 160 * MiB)], batch=2,
        latent_hw=(128, 128), context_tokens=77, attention="doggettx", dtype=torch.float16,
    )  # fmt: skip
    assert not cp.fits and cp.unet_resident_bytes == 0 and "can be planned" in cp.stream.notes[0]


def test_a_size_past_the_bound_names_vram_guard(capsys):
    """The refusal's reason names the product (it said 'VAE Guard')."""
    with pytest.raises(SystemExit):
        main(["plan", "--arch", "sd15", "--width", "99992", "--height", "512"])
    err = capsys.readouterr().err
    assert "the largest image side VRAM Guard plans" in err and "VAE Guard" not in err


def test_invokeai_on_a_card_its_weights_fill_plans_without_a_division_by_zero(capsys):
    """InvokeAI slices by the free memory; with none left (the weights took it) the plan still
    answers (found by the sampling refactor: ZeroDivisionError)."""
    from lib_vram.__main__ import main

    rc = main(["plan", "--arch", "sd15", "--width", "768", "--height", "512", "--vram", "2GB",
               "--attention", "invokeai", "--json"])  # fmt: skip
    out = capsys.readouterr()
    assert "ZeroDivisionError" not in out.out + out.err and rc in (0, 3), out


def test_controlnet_units_are_in_the_sampling_stages(capsys):
    """``--controlnet`` (issue 30): each unit's weights are in the sampling passes' peaks and JSON;
    ``--controlnet-hires lowres`` leaves the hires pass without them; a unit of another family is
    refused in one line."""
    from lib_vram.sampling import reference_control

    base = ("--arch", "sd15", "--width", "512", "--height", "512", "--vram", "24GB", "--no-place")
    base += ("--hires", "2")
    cn = ("--controlnet", "sd15")
    _, bare = _plan(capsys, *base)
    _, one = _plan(capsys, *base, *cn)
    _, two = _plan(capsys, *base, *cn, *cn)
    _, low = _plan(capsys, *base, *cn, "--controlnet-hires", "lowres")
    cb = reference_control("sd15").params * 2  # fp16
    for stage in ("sample", "sample_hires"):
        s1 = _stage(one, stage)
        assert _stage(bare, stage)["controlnet_bytes"] == 0
        assert s1["controlnet_bytes"] == cb and "ControlNet 689 MiB" in s1["plan"], s1
        assert _stage(two, stage)["controlnet_bytes"] == 2 * cb
        grow = s1["predicted_peak_bytes"] - _stage(bare, stage)["predicted_peak_bytes"]
        assert grow > cb  # the weights and the control model's forward
    assert _stage(low, "sample")["controlnet_bytes"] == cb
    assert _stage(low, "sample_hires")["controlnet_bytes"] == 0
    assert one["controlnets"] == ["sd15"] and low["controlnet_hires"] == "lowres"
    assert main(["plan", *base, "--controlnet", "sdxl"]) == 2
    assert "is not a ControlNet for `--arch sd15`" in capsys.readouterr().err


def test_ip_adapter_is_in_the_plan(capsys):
    """``--ip-adapter`` (issue 42 item 4): its CLIP vision encoder's stage first (the weights of
    transformers' CLIPVisionModelWithProjection with sd-webui-controlnet's configs, float32: 632 M
    parameters for ViT-H, 1845 M for ViT-bigG, counted once with transformers 4.30.2), the
    adapter in host memory (ip-adapter_sd15: 22.3 M parameters; ip-adapter-plus_sdxl_vit-h: 423.7 M,
    counted on sd-webui-controlnet's own classes), the sampling passes with its image tokens, whole."""
    from lib_vram.cli.stageplan import ip_adapter_bytes

    base = ("--arch", "sd15", "--width", "512", "--height", "512", "--vram", "24GB", "--no-place")
    _, bare = _plan(capsys, *base)
    _, ip = _plan(capsys, *base, "--ip-adapter", "sd15")
    _, plus = _plan(capsys, *base, "--ip-adapter", "sd15-plus")
    enc = _stage(ip, "ip_adapter_encode")
    assert ip["stages"][0]["stage"] == "ip_adapter_encode"
    assert enc["model_weights_bytes"] == 4 * 632_076_800 and "adapter 85 MiB in host memory" in enc["plan"]
    assert ip_adapter_bytes("sd15", "sd15")["adapter"] == 4 * 22_319_616
    assert ip_adapter_bytes("sdxl-plus", "sdxl")["adapter"] == 4 * 423_748_864
    assert ip_adapter_bytes("sdxl", "sdxl")["encoder"] == 4 * 1_844_907_264
    peaks = [_stage(r, "sample")["predicted_peak_bytes"] for r in (bare, ip, plus)]
    assert peaks[0] < peaks[1] < peaks[2]  # the encoder's output, then 16 image tokens
    assert main(["plan", *base, "--ip-adapter", "sdxl"]) == 2
    assert "is not an IP-Adapter for `--arch sd15`" in capsys.readouterr().err
    _, placed = _plan(capsys, "--arch", "sdxl", "--width", "1024", "--height", "1024", "--vram", "8GB",
                      "--ip-adapter", "sdxl-plus", "--place")  # fmt: skip
    assert [s["stage"] for s in placed["stages"]][:2] == ["ip_adapter_encode", "conditioning"]


def test_sdxl_controlnets_in_the_placed_plan(capsys):
    """``--controlnet sdxl`` (issue 42 item 4) with the SDXL checkpoint placed: the control model's
    bytes in the pass; where the pass is then short, more UNet blocks stream for it (as the run's
    second streamer does) and it fits; the smaller SDXL layouts are counted by their own size."""
    from lib_vram.sampling import reference_control

    base = ("--arch", "sdxl", "--width", "1024", "--height", "1024", "--vram", "6GB", "--place")
    _, bare = _plan(capsys, *base)
    _, full = _plan(capsys, *base, "--controlnet", "sdxl")
    _, mid = _plan(capsys, *base, "--controlnet", "sdxl-mid")
    b, f, m = (_stage(r, "sample") for r in (bare, full, mid))
    assert f["controlnet_bytes"] == reference_control("sdxl").params * 2  # FP16
    assert m["controlnet_bytes"] == reference_control("sdxl-mid").params * 2
    assert f["fits"] and "more UNet blocks" in f["plan"] and "more UNet" not in m["plan"] + b["plan"]
    assert f["predicted_peak_bytes"] <= f["budget_bytes"]
    assert f["bytes_moved_per_step"] > b["bytes_moved_per_step"] == m["bytes_moved_per_step"]
    sd15 = ("--arch", "sd15", "--width", "512", "--height", "512")
    assert main(["plan", *sd15, "--controlnet", "sdxl-mid"]) == 2
    assert "is not a ControlNet for `--arch sd15`" in capsys.readouterr().err


RUN13 = ("--arch", "sdxl", "--width", "128", "--height", "128", "--vram", "8000MiB", "--hires", "2",
         "--controlnet", "sdxl-mid", "--attention", "InvokeAI", "--device", "cpu", "--no-half")  # fmt: skip
"""Run 13's job (docs/webui-acceptance.md): the WebUI with --no-half on an emulated card on the CPU."""


def test_no_half_plans_the_checkpoint_in_fp32_and_places_it_as_run_13_did(capsys):
    """``--no-half`` (issue 42): the whole checkpoint in FP32, as the WebUI loads it with its own
    ``--no-half`` (UNet, text encoders, VAE, the ControlNet), placed and plain. The pinned numbers
    are the real WebUI's Run 13 log (docs/webui-acceptance.md: SDXL with --no-half placed on an
    emulated 8000 MiB card on the CPU: ``--device cpu``): UNet 4479 of 9794 MiB resident, 68 of 111
    blocks streamed, 5315 MiB per step (--lowvram 19548), text encoders 3119 MiB, VAE 319 MiB,
    ControlNet 1034 MiB; sampling predicted 5902 MiB (activations 124), the hires pass 5936 (157)."""
    from lib_vram.planning.reference import vae_arch
    from lib_vram.sampling import reference_control, reference_spec

    rc, rep = _plan(capsys, *RUN13)
    p = rep["placement"]
    assert rc == 0 and rep["placed_by"] == "auto" and p["unet_bytes"] == 4 * reference_spec("sdxl").params
    got = {k: round(p[k] / MiB) for k in ("unet_bytes", "unet_resident_bytes", "bytes_moved_per_step")}
    assert got == {"unet_bytes": 9794, "unet_resident_bytes": 4479, "bytes_moved_per_step": 5315}
    units = (p["units_resident"], p["units_streamed"], round(p["lowvram_bytes_per_step"] / MiB))
    assert units == (43, 68, 19548)
    assert {m["name"]: round(m["mib"]) for m in p["parked"]} == {"text encoders": 3119, "VAE": 319}
    assert p["default_pass"]["dtype"] == "fp32" and {s["dtype"] for s in rep["stages"]} == {"fp32"}
    assert _stage(rep, "sample")["controlnet_bytes"] == 4 * reference_control("sdxl-mid").params
    for name, want in (("sample", (5902, 124)), ("sample_hires", (5936, 157))):
        s = _stage(rep, name)
        assert (round(s["predicted_peak_bytes"] / MiB), round(s["activation_bytes"] / MiB)) == want
    # on a GPU of that size (no --device cpu): the same placement
    _, gpu = _plan(capsys, *RUN13[:-3], "--no-half")
    assert gpu["placement"]["unet_resident_bytes"] == p["unet_resident_bytes"]
    # the plain plan: the UNet and text encoders in FP32 beside the decode
    _, plain = _plan(capsys, *RUN13, "--no-place")
    a = vae_arch("sdxl")
    assert plain["models_bytes"] == 2 * (a.unet_bytes + a.text_encoder_bytes)
    assert _stage(plain, "sample")["model_weights_bytes"] == p["unet_bytes"]


# -- the sampling forward's options (issue 41 item 4) -------------------------------------------

SD15_2K = ("--arch", "sd15", "--width", "2048", "--height", "2048", "--vram", "6GB", "--no-place")


def test_token_merging_and_hypertile_are_in_the_sampling_prediction(capsys):
    """With SDP token merging's similarity matrix adds to the pass; with ldm's own attention both
    shrink it; each prediction is the estimate's with the option (lib_vram.sampling.SelfAttention)."""
    import torch

    from lib_vram.sampling import HyperTile, SelfAttention, TokenMerging, estimate_sampling, reference_spec

    def act(sa: SelfAttention | None, attention: str) -> int:
        kw = dict(batch=2, latent_hw=(256, 256), context_tokens=77, dtype=torch.float16, attention=attention)
        return estimate_sampling(reference_spec("sd15"), self_attention=sa, **kw).activation_bytes

    big = ("--vram", "1024GB")
    _, plain = _plan(capsys, *SD15_2K, *big, "--attention", "sdp")
    _, merged = _plan(capsys, *SD15_2K, *big, "--attention", "sdp", "--token-merging", "0.5")
    sample = _stage(merged, "sample")
    assert sample["activation_bytes"] > _stage(plain, "sample")["activation_bytes"]
    assert sample["activation_bytes"] == act(SelfAttention(merging=TokenMerging(0.5)), "sdp")
    assert merged["forward"] == ["token merging 0.5"] and "token merging 0.5" in _table(
        SD15_2K, "--token-merging", "0.5"
    )
    _, tiled = _plan(capsys, *SD15_2K, *big, "--attention", "none", "--hypertile-tile", "128")
    want = act(SelfAttention(hypertile=HyperTile(max_tile_px=128)), "none")
    assert _stage(tiled, "sample")["activation_bytes"] == want < act(None, "none") / 2
    assert tiled["forward"] == ["HyperTile (max tile 128 px)"]
    # its tiles are drawn at random per forward (swap size 3): the batch is never split
    assert [c["batch"] for c in _stage(tiled, "sample")["candidates"]] == [2]


def _table(argv, *more: str) -> str:
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        main(["plan", *argv, *more])
    return out.getvalue()


def test_tiled_diffusion_plans_one_tile_batch_whole(capsys):
    """768 px tiles at 2048 px: MultiDiffusion's 5 x 5 grid (overlap 48), batches of 4 evened to
    4: the forward is 4 tiles x cond/uncond on a 96 x 96 latent, never micro-batched, far below
    the whole-latent forward's prediction."""
    _, plain = _plan(capsys, *SD15_2K, "--vram", "1024GB")
    _, rep = _plan(capsys, *SD15_2K, "--vram", "1024GB", "--tiled-diffusion", "768")
    s = _stage(rep, "sample")
    assert s["plan"].startswith("Tiled Diffusion: 25 tiles of 768x768 px, 4 per forward (7 forwards of 8")
    assert s["batch"] == 8 and [c["batch"] for c in s["candidates"]] == [8]
    assert s["predicted_peak_bytes"] < _stage(plain, "sample")["predicted_peak_bytes"] / 2
    rc, small = _plan(capsys, *SD15_2K, "--tiled-diffusion", "2048", "--vram", "3GB", "--medvram")
    assert rc == 3 and "Tiled Diffusion needs" in _stage(small, "sample")["suggestion"]


def test_animatediff_frames_are_never_split(capsys):
    """The batch is frames x cond/uncond in one forward: no micro-batch candidate even where it
    does not fit; the line says which frame count would."""
    rc, rep = _plan(capsys, "--arch", "sd15", "--width", "512", "--height", "512", "--vram", "6GB",
                    "--no-place", "--animatediff", "16", "--attention", "none")  # fmt: skip
    s = _stage(rep, "sample")
    assert "frames are never split" in s["plan"]
    assert [c["batch"] for c in s["candidates"]] == [32] and s["batch"] == 32
    assert rc == 3 and not s["fits"] and s["suggestion"].startswith("AnimateDiff needs")
    assert s["suggestion"].endswith("frames fit")


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--token-merging", "0.95"], "`--token-merging` must be <= 0.9"),
        (["--token-merging", "0"], "`--token-merging` must be a finite number > 0"),
        (["--hypertile-tile", "513"], "`--hypertile-tile` must be <= 512"),
        (["--tiled-diffusion", "100"], "`--tiled-diffusion` must be >= 128"),
        (["--tiled-diffusion", "2176"], "`--tiled-diffusion` must be <= 2048"),
        (["--tiled-diffusion", "700"], "multiple of 128"),
        (
            ["--tiled-diffusion", "768", "--tiled-diffusion-batch", "9"],
            "`--tiled-diffusion-batch` must be <= 8",
        ),
        (["--tiled-diffusion", "768", "--tiled-diffusion-batch", "8", "--batch", "5"], "over the UNet batch"),
        (["--animatediff", "33"], "`--animatediff` must be <= 32"),
        (["--animatediff", "0"], "`--animatediff` must be >= 1"),
        (["--animatediff", "16", "--batch", "2"], "AnimateDiff's frames are the batch"),
        (["--animatediff", "16", "--tiled-diffusion", "768"], "exclude each other"),
    ],
)
def test_forward_options_are_bounded_in_one_line(capsys, argv, words):
    rc = None
    try:
        rc = main(["plan", "--arch", "sd15", "--width", "512", "--height", "512", *argv])
    except SystemExit as exc:
        rc = exc.code
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert rc == 2 and len(err) == 1 and words in err[0], err
