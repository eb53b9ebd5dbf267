"""``--emulate-vram`` on the CLI, and the benchmarks built on the emulated card (CPU runs)."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from conftest import image_like, make_imagelike_rrdb, rrdb_class, save_and_load
from PIL import Image
from tolerances import UPSCALE_LSB, VAE_EXACT

from lib_vram.cli import EMULATE_ENV, main
from lib_vram.core import emulate


@pytest.fixture(autouse=True)
def _no_inherited_card(monkeypatch):
    monkeypatch.delenv(EMULATE_ENV, raising=False)
    yield
    assert emulate.installed() is None and emulate.current() is None


def _rrdb_file(tmp_path):
    torch.manual_seed(0)
    net = make_imagelike_rrdb(rrdb_class()(in_nc=3, out_nc=3, num_filters=8, num_blocks=1, scale=4))
    path = tmp_path / "rrdb.safetensors"
    save_and_load(net, path)
    return path


def _png(path, h, w):
    arr = (image_like(h, w, seed=5)[0].permute(1, 2, 0).numpy() * 255).astype(np.uint8)
    Image.fromarray(arr, "RGB").save(path)
    return path


def test_upscale_on_an_emulated_card_tiles_where_the_whole_image_cannot_fit(tmp_path, capsys):
    model = _rrdb_file(tmp_path)
    src = _png(tmp_path / "in.png", 64, 80)
    big, small = tmp_path / "big.png", tmp_path / "small.png"
    assert main(["upscale", str(src), str(big), "--model", str(model), "--emulate-vram", "8GB"]) == 0
    assert "whole" in capsys.readouterr().out
    assert main(["upscale", str(src), str(small), "--model", str(model), "--emulate-vram", "8MB"]) == 0
    out = capsys.readouterr()
    assert "tiled" in out.out and "emulated 8.00 MiB card" in out.err
    a = np.asarray(Image.open(big), dtype=np.int16)
    b = np.asarray(Image.open(small), dtype=np.int16)
    assert a.shape == b.shape == (256, 320, 3) and np.abs(a - b).max() <= UPSCALE_LSB  # whole vs tiled


def test_a_card_too_small_for_anything_is_one_clear_line(tmp_path, capsys):
    model = _rrdb_file(tmp_path)
    src = _png(tmp_path / "in.png", 64, 80)
    for size in ("1MB", "3MB"):  # the model does not load / no tile fits
        rc = main(
            ["upscale", str(src), str(tmp_path / "o.png"), "--model", str(model), "--emulate-vram", size]
        )
        err = capsys.readouterr().err
        assert rc != 0 and "out of memory" in err and "Traceback" not in err and "corrupt" not in err
    assert not (tmp_path / "o.png").exists()


@pytest.mark.parametrize("value", ["banana", "0GB", "-4GB"])
def test_bad_size_names_the_option(tmp_path, capsys, value):
    src = _png(tmp_path / "in.png", 8, 8)
    rc = main(["upscale", str(src), str(tmp_path / "o.png"), "--model", "x.pth", f"--emulate-vram={value}"])
    assert rc == 2 and "--emulate-vram" in capsys.readouterr().err


def test_bench_emulate_records_plain_and_guarded(capsys):
    assert main(["bench", "emulate", "--quick", "--stages", "vae_encode", "--cards", "4", "--json"]) == 0
    # --json: JSON only on stdout (no table after the records)
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.strip()]
    assert len(lines) == 1
    rec = lines[0]
    for key in ("stage", "card_bytes", "plain_ok", "guarded_ok", "plan", "peak_bytes", "psnr_db", "max_err",
                "cpu_ratio"):  # fmt: skip
        assert key in rec
    assert rec["guarded_ok"] and rec["peak_bytes"] <= rec["card_bytes"]
    assert rec["plain_ok"] is False  # 1024² encode does not fit the (scaled) 4 GB card untiled
    assert rec["max_err"] <= VAE_EXACT


def test_bench_gpu_runs_its_cpu_parts_and_says_what_it_skipped(tmp_path, capsys):
    out = tmp_path / "gpu.json"
    assert main(["bench", "gpu", "--out", str(out), "--cards", "4"]) == 0
    data = json.loads(out.read_text())
    assert {"env", "matrix", "decode_2048", "upscale_batch", "cudnn_workspace", "skipped"} <= set(data)
    assert any("needs CUDA" in s for s in data["skipped"])
    assert {r["stage"] for r in data["matrix"]} == {"vae_decode", "vae_encode", "upscale"}
    assert all(r["guarded_ok"] for r in data["matrix"])
    assert [r["case"] for r in data["upscale_batch"]] == ["batched (auto)", "one tile at a time"]
    assert not list(tmp_path.glob("*.tmp"))
    assert EMULATE_ENV not in os.environ
