"""``python -m lib_vram upscale``: files, folders, options and errors."""

from __future__ import annotations

import numpy as np
import torch
from conftest import compact_class, image_like, save_and_load
from PIL import Image

from lib_vram.cli import main


def _model(tmp_path):
    torch.manual_seed(0)
    net = compact_class()(num_in_ch=3, num_out_ch=3, num_feat=8, num_conv=2, upscale=2)
    path = tmp_path / "tiny.safetensors"
    save_and_load(net, path)
    return path


def _png(path, h=12, w=10, mode="RGB"):
    arr = (image_like(h, w)[0].permute(1, 2, 0).numpy() * 255).astype(np.uint8)
    Image.fromarray(arr, "RGB").convert(mode).save(path)
    return path


def test_single_file_with_options(tmp_path, capsys):
    model = _model(tmp_path)
    src = _png(tmp_path / "in.png")
    dst = tmp_path / "out.png"
    rc = main(["upscale", str(src), str(dst), "--model", str(model), "--tile", "8", "--precision", "fp32"])
    assert rc == 0
    assert Image.open(dst).size == (20, 24)
    out = capsys.readouterr()
    assert "tiled t8" in out.out and "tiles" in out.err  # plan line + progress bar


def test_folder_and_scale(tmp_path):
    model = _model(tmp_path)
    folder = tmp_path / "in"
    folder.mkdir()
    _png(folder / "a.png")
    _png(folder / "b.jpg", mode="L")
    (folder / "notes.txt").write_text("not an image")
    out = tmp_path / "out"
    rc = main(["upscale", str(folder), str(out), "--model", str(model), "--scale", "3", "--quiet"])
    assert rc == 0
    a, b = Image.open(tmp_path / "out" / "a.png"), Image.open(tmp_path / "out" / "b.png")
    assert a.size == b.size == (30, 36) and b.mode == "L"


def test_errors_name_the_problem(tmp_path, capsys):
    bad = tmp_path / "bad.pth"
    bad.write_bytes(b"garbage")
    src = _png(tmp_path / "in.png")
    assert main(["upscale", str(src), str(tmp_path / "o.png"), "--model", str(bad)]) == 2
    assert "bad.pth: corrupt or unreadable" in capsys.readouterr().err
    model = _model(tmp_path)
    assert main(["upscale", str(tmp_path / "nope.png"), str(tmp_path / "o.png"), "--model", str(model)]) == 2
    assert "`input` not found" in capsys.readouterr().err
    assert main(["upscale", str(src), str(tmp_path / "o.png"), "--model", str(model), "--tile", "3"]) == 2
    assert "`tile`" in capsys.readouterr().err
    broken = tmp_path / "broken.png"
    broken.write_bytes(b"\x89PNG not really")
    assert main(["upscale", str(broken), str(tmp_path / "o.png"), "--model", str(model), "--quiet"]) == 1
    assert "broken.png: cannot read image" in capsys.readouterr().err
