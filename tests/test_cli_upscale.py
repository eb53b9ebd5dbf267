"""``python -m lib_vram upscale``: files, folders, options and errors.

The file-handling promises (docs/command-line.md, "`upscale`: your own images") are each tested by causing the
situation: an output that is the input, an existing output, a symlink, a name collision, Ctrl-C in
the middle of a write, a full disk, a read-only folder, a decompression bomb, EXIF orientation,
animated and 16-bit images.
"""

from __future__ import annotations

import errno
import io
import os
import struct
import subprocess
import warnings
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import compact_class, image_like, save_and_load
from PIL import Image

from lib_vram.cli import main
from lib_vram.cli import upscale as _cli_upscale
from lib_vram.upscale import UpscaleConfig, UpscaleError, load_model


@pytest.fixture(autouse=True)
def _restore_lib_vram_logger():
    import logging

    logger = logging.getLogger("lib_vram")
    saved = (list(logger.handlers), logger.level, logger.propagate)
    yield
    logger.handlers[:] = saved[0]
    logger.setLevel(saved[1])
    logger.propagate = saved[2]


def _model(tmp_path):
    torch.manual_seed(0)
    net = compact_class()(num_in_ch=3, num_out_ch=3, num_feat=8, num_conv=2, upscale=2)
    path = tmp_path / "tiny.safetensors"
    save_and_load(net, path)
    return path


def _png(path, h=12, w=10, mode="RGB", seed=0):
    arr = (image_like(h, w, seed=seed)[0].permute(1, 2, 0).numpy() * 255).astype(np.uint8)
    Image.fromarray(arr, "RGB").convert(mode).save(path)
    return path


def _folder(tmp_path, names=("a.png", "b.png", "c.png")):
    folder = tmp_path / "in"
    folder.mkdir()
    for i, n in enumerate(names):
        _png(folder / n, seed=i)
    return folder


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


def _no_partials(folder: Path) -> bool:
    return not [p for p in folder.iterdir() if p.name.endswith(".part")]


def _up(*argv) -> int:
    try:
        return main(["upscale", *map(str, argv)])
    except SystemExit as exc:  # argparse's own checks (type=): one line, exit 2
        return int(exc.code)


# -- basics -----------------------------------------------------------------------------------------


def test_single_file_with_options(tmp_path, capsys):
    model = _model(tmp_path)
    src = _png(tmp_path / "in.png")
    dst = tmp_path / "out.png"
    assert _up(src, dst, "--model", model, "--tile", "8", "--precision", "fp32") == 0
    assert Image.open(dst).size == (20, 24)
    out = capsys.readouterr()
    assert "tiled t8" in out.out
    # stderr is not a terminal here: no progress bar, no carriage returns in logs and pipes.
    assert "\r" not in out.err and "tiles" not in out.err


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_bar_is_drawn_on_a_terminal_only(tmp_path, monkeypatch):
    model = _model(tmp_path)
    src = _png(tmp_path / "in.png")
    term = _Terminal()
    monkeypatch.setattr("sys.stderr", term)
    assert _up(src, tmp_path / "o.png", "--model", model, "--tile", "8") == 0
    assert "\r" in term.getvalue() and "tiles" in term.getvalue()
    term2 = _Terminal()
    monkeypatch.setattr("sys.stderr", term2)
    assert _up(src, tmp_path / "o2.png", "--model", model, "--tile", "8", "--quiet") == 0
    assert "\r" not in term2.getvalue()


def test_folder_and_scale_end_with_a_summary(tmp_path, capsys):
    model = _model(tmp_path)
    folder = tmp_path / "in"
    folder.mkdir()
    _png(folder / "a.png")
    _png(folder / "b.jpg", mode="L")
    (folder / "notes.txt").write_text("not an image")
    out = tmp_path / "out"
    assert _up(folder, out, "--model", model, "--scale", "3", "--quiet") == 0
    a, b = Image.open(out / "a.png"), Image.open(out / "b.png")
    assert a.size == b.size == (30, 36) and b.mode == "L"
    res = capsys.readouterr()
    assert res.out.strip().splitlines()[-1] == "2 done, 0 skipped, 0 failed"
    assert "notes.txt" in res.err and "ignored" in res.err


def test_output_folder_is_created_as_a_folder_even_with_an_image_like_name(tmp_path):
    model = _model(tmp_path)
    folder = _folder(tmp_path, ("a.png",))
    assert _up(folder, tmp_path / "out.png", "--model", model, "--quiet") == 0
    assert (tmp_path / "out.png" / "a.png").is_file()


def test_single_file_into_an_existing_folder(tmp_path):
    model = _model(tmp_path)
    src = _png(tmp_path / "in.jpg")
    (tmp_path / "out").mkdir()
    assert _up(src, tmp_path / "out", "--model", model, "--quiet") == 0
    assert Image.open(tmp_path / "out" / "in.png").size == (20, 24)


# -- never overwrite an input ---------------------------------------------------------------------


def test_output_equal_to_input_is_refused_even_with_overwrite(tmp_path, capsys):
    model = _model(tmp_path)
    src = _png(tmp_path / "in.png")
    before = src.read_bytes()
    for extra in ([], ["--overwrite"]):
        assert _up(src, src, "--model", model, *extra) == 2
        assert "is an input file" in capsys.readouterr().err
    # The same file through another spelling and through a symlink at the output name.
    assert _up(src, tmp_path / "." / "in.png", "--model", model, "--overwrite") == 2
    (tmp_path / "link.png").symlink_to(src)
    assert _up(src, tmp_path / "link.png", "--model", model, "--overwrite") == 2
    os.link(src, tmp_path / "hard.png")
    assert _up(src, tmp_path / "hard.png", "--model", model, "--overwrite") == 2
    assert src.read_bytes() == before


def test_output_folder_equal_to_input_folder_is_refused(tmp_path, capsys):
    model = _model(tmp_path)
    folder = _folder(tmp_path)
    before = _snapshot(folder)
    for target in (folder, tmp_path / "in" / "."):
        assert _up(folder, target, "--model", model, "--overwrite") == 2
        assert "is the `input` folder" in capsys.readouterr().err
    assert _snapshot(folder) == before


def test_folder_output_that_links_to_an_input_is_refused(tmp_path, capsys):
    """A symlink in the output folder pointing back at an input: never written through."""
    model = _model(tmp_path)
    folder = _folder(tmp_path, ("a.jpg", "b.png"))
    out = tmp_path / "out"
    out.mkdir()
    (out / "a.png").symlink_to(folder / "a.jpg")
    before = _snapshot(folder)
    assert _up(folder, out, "--model", model, "--overwrite", "--quiet") == 1
    res = capsys.readouterr()
    assert "error: a.jpg:" in res.err and "is an input file" in res.err
    assert res.out.strip().splitlines()[-1] == "1 done, 0 skipped, 1 failed: a.jpg"
    assert _snapshot(folder) == before and (out / "a.png").is_symlink()


# -- existing outputs -------------------------------------------------------------------------------


def test_existing_single_output_needs_overwrite(tmp_path, capsys):
    model = _model(tmp_path)
    src = _png(tmp_path / "in.png")
    dst = tmp_path / "out.png"
    dst.write_bytes(b"precious")
    assert _up(src, dst, "--model", model) == 2
    assert "exists; pass --overwrite" in capsys.readouterr().err
    assert dst.read_bytes() == b"precious"
    assert _up(src, dst, "--model", model, "--overwrite", "--quiet") == 0
    assert Image.open(dst).size == (20, 24)


def test_folder_run_skips_existing_outputs_and_resumes(tmp_path, capsys):
    model = _model(tmp_path)
    folder = _folder(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    (out / "b.png").write_bytes(b"mine")
    assert _up(folder, out, "--model", model, "--quiet") == 0
    res = capsys.readouterr()
    assert "skipped b.png" in res.err and "--overwrite" in res.err
    assert res.out.strip().splitlines()[-1] == "2 done, 1 skipped, 0 failed"
    assert (out / "b.png").read_bytes() == b"mine"
    # A second run does nothing new.
    assert _up(folder, out, "--model", model, "--quiet") == 0
    assert capsys.readouterr().out.strip().splitlines()[-1] == "0 done, 3 skipped, 0 failed"
    assert _up(folder, out, "--model", model, "--quiet", "--overwrite") == 0
    assert Image.open(out / "b.png").size == (20, 24)


def test_symlink_at_output_is_replaced_not_written_through(tmp_path, capsys):
    model = _model(tmp_path)
    src = _png(tmp_path / "in.png")
    target = tmp_path / "elsewhere.png"
    target.write_bytes(b"keep me")
    dst = tmp_path / "out.png"
    dst.symlink_to(target)
    assert _up(src, dst, "--model", model) == 2  # exists
    capsys.readouterr()
    assert _up(src, dst, "--model", model, "--overwrite", "--quiet") == 0
    assert target.read_bytes() == b"keep me"
    assert not dst.is_symlink() and Image.open(dst).size == (20, 24)


def test_same_stem_different_type_do_not_collide(tmp_path, capsys):
    model = _model(tmp_path)
    folder = tmp_path / "in"
    folder.mkdir()
    _png(folder / "x.png", seed=1)
    _png(folder / "x.jpg", seed=2)
    _png(folder / "y.png", seed=3)
    out = tmp_path / "out"
    assert _up(folder, out, "--model", model, "--quiet") == 0
    assert sorted(p.name for p in out.iterdir()) == ["x_jpg.png", "x_png.png", "y.png"]
    assert "x.jpg -> x_jpg.png" in capsys.readouterr().err
    assert not np.array_equal(
        np.asarray(Image.open(out / "x_jpg.png")), np.asarray(Image.open(out / "x_png.png"))
    )


# -- atomic writes ----------------------------------------------------------------------------------


def test_ctrl_c_during_a_write_leaves_no_partial_file(tmp_path, monkeypatch, capsys):
    model = _model(tmp_path)
    folder = _folder(tmp_path)
    out = tmp_path / "out"
    real_fsync = os.fsync
    calls = []

    def fsync(fd):
        calls.append(fd)
        if len(calls) == 2:  # the second output's bytes are written, not yet renamed into place
            raise KeyboardInterrupt
        real_fsync(fd)

    monkeypatch.setattr(_cli_upscale.os, "fsync", fsync)
    assert _up(folder, out, "--model", model, "--quiet") == 130
    err = capsys.readouterr().err
    assert err == "interrupted: 1 done, 0 skipped, 0 failed; no partial file was left\n"
    assert [p.name for p in out.iterdir()] == ["a.png"] and _no_partials(out)
    Image.open(out / "a.png").load()  # complete
    monkeypatch.setattr(_cli_upscale.os, "fsync", real_fsync)
    assert _up(folder, out, "--model", model, "--quiet") == 0  # a rerun finishes the rest
    assert sorted(p.name for p in out.iterdir()) == ["a.png", "b.png", "c.png"]


def test_ctrl_c_during_an_upscale_writes_nothing_for_that_file(tmp_path, monkeypatch):
    model = _model(tmp_path)
    folder = _folder(tmp_path)
    out = tmp_path / "out"
    seen = []
    real_call = _cli_upscale._Bar.__call__

    def progress(self, done, total):
        seen.append(self.label)
        if self.label.startswith("b.png"):
            raise KeyboardInterrupt
        real_call(self, done, total)

    monkeypatch.setattr(_cli_upscale._Bar, "__call__", progress)
    assert _up(folder, out, "--model", model, "--tile", "8") == 130
    assert [p.name for p in out.iterdir()] == ["a.png"] and _no_partials(out)


def test_disk_full_fails_that_file_and_the_run_goes_on(tmp_path, monkeypatch, capsys):
    model = _model(tmp_path)
    folder = _folder(tmp_path)
    out = tmp_path / "out"
    real_fsync = os.fsync
    calls = []

    def fsync(fd):
        calls.append(fd)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real_fsync(fd)

    monkeypatch.setattr(_cli_upscale.os, "fsync", fsync)
    assert _up(folder, out, "--model", model, "--quiet") == 1
    res = capsys.readouterr()
    assert "error: b.png: No space left on device" in res.err and "Traceback" not in res.err
    assert res.out.strip().splitlines()[-1] == "2 done, 0 skipped, 1 failed: b.png"
    assert sorted(p.name for p in out.iterdir()) == ["a.png", "c.png"] and _no_partials(out)


def _mount(*args) -> bool:
    if os.geteuid() != 0:
        return False
    r = subprocess.run(["mount", *args], capture_output=True, timeout=30)
    return r.returncode == 0


def _umount(path) -> None:
    subprocess.run(["umount", str(path)], capture_output=True, timeout=30)


def test_real_full_disk_on_a_tiny_tmpfs(tmp_path, capsys):
    """A real ENOSPC: the output folder is a 64 KiB tmpfs; larger outputs fail, nothing partial stays."""
    model = _model(tmp_path)
    folder = tmp_path / "in"
    folder.mkdir()
    rng = np.random.default_rng(0)
    for i, n in enumerate(("a.png", "b.png", "c.png")):
        side = 8 if i == 0 else 96  # a: tiny output; b, c: noisy 192x192 PNGs (> 64 KiB each)
        Image.fromarray(rng.integers(0, 256, (side, side, 3), dtype=np.uint8)).save(folder / n)
    out = tmp_path / "out"
    out.mkdir()
    if not _mount("-t", "tmpfs", "-o", "size=64k", "tmpfs", str(out)):
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        assert _up(folder, out, "--model", model, "--quiet") == 1
        res = capsys.readouterr()
        assert "No space left on device" in res.err and "Traceback" not in res.err
        assert "failed: b.png, c.png" in res.out
        assert [p.name for p in out.iterdir()] == ["a.png"]
        Image.open(out / "a.png").load()
    finally:
        _umount(out)


def test_read_only_output_folder(tmp_path, capsys):
    """Permission denied / read-only: every file is tried, each fails with one line, exit 1."""
    model = _model(tmp_path)
    folder = _folder(tmp_path, ("a.png", "b.png"))
    out = tmp_path / "out"
    out.mkdir()
    if os.geteuid() != 0:
        out.chmod(0o555)
        undo = lambda: out.chmod(0o755)  # noqa: E731
    elif _mount("--bind", str(out), str(out)) and _mount("-o", "remount,bind,ro", str(out)):
        undo = lambda: _umount(out)  # noqa: E731
    else:
        pytest.skip("cannot make a read-only folder here")
    try:
        assert _up(folder, out, "--model", model, "--quiet") == 1
        res = capsys.readouterr()
        lines = [ln for ln in res.err.splitlines() if ln.startswith("error:")]
        assert len(lines) == 2 and all(("Read-only" in ln or "Permission denied" in ln) for ln in lines)
        assert res.out.strip().splitlines()[-1] == "0 done, 0 skipped, 2 failed: a.png, b.png"
    finally:
        undo()


def test_a_file_where_the_output_folder_should_be(tmp_path, capsys):
    model = _model(tmp_path)
    folder = _folder(tmp_path, ("a.png",))
    blocker = tmp_path / "file"
    blocker.write_text("x")
    assert _up(folder, blocker / "out", "--model", model) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cannot create it" in err and "Traceback" not in err
    # A folder sitting where one output file should go (with --overwrite): that file fails, others run.
    out = tmp_path / "out"
    (out / "a.png").mkdir(parents=True)
    folder2 = tmp_path / "in2"
    folder2.mkdir()
    _png(folder2 / "a.png")
    _png(folder2 / "b.png")
    assert _up(folder2, out, "--model", model, "--quiet", "--overwrite") == 1
    res = capsys.readouterr()
    assert "error: a.png:" in res.err and "1 done, 0 skipped, 1 failed: a.png" in res.out


# -- images -----------------------------------------------------------------------------------------


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def _raw_png(path: Path, w: int, h: int, depth: int, colour: int, rows: bytes) -> Path:
    ihdr = struct.pack(">IIBBBBB", w, h, depth, colour, 0, 0, 0)
    path.write_bytes(
        b"\x89PNG\r\n\x1a\n"
        + _chunk(b"IHDR", ihdr)
        + _chunk(b"IDAT", zlib.compress(rows))
        + _chunk(b"IEND", b"")
    )
    return path


def test_decompression_bomb_is_one_line_and_the_folder_goes_on(tmp_path, capsys):
    model = _model(tmp_path)
    folder = tmp_path / "in"
    folder.mkdir()
    _raw_png(folder / "bomb.png", 40000, 40000, 8, 2, b"\x00")  # header says 40000x40000
    _png(folder / "ok.png")
    out = tmp_path / "out"
    assert _up(folder, out, "--model", model, "--quiet") == 1
    res = capsys.readouterr()
    assert "error: bomb.png: too large to open safely" in res.err and "Traceback" not in res.err
    assert "1 done, 0 skipped, 1 failed: bomb.png" in res.out
    assert [p.name for p in out.iterdir()] == ["ok.png"]


@pytest.mark.parametrize("folder", [False, True])
def test_an_image_past_pillows_warning_limit_is_one_line_without_pillows_warning(tmp_path, capsys, folder):
    """100 Mpx: above Pillow's limit for untrusted images (89 Mpx), below the size it refuses (179 Mpx).
    Pillow would print its two-line DecompressionBombWarning first; the user gets only the refusal."""
    model = _model(tmp_path)
    src_dir = tmp_path / "in"
    src_dir.mkdir()
    src = _raw_png(src_dir / "huge.png", 10000, 10000, 8, 2, b"\x00")
    limit = Image.MAX_IMAGE_PIXELS
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rc = _up(src_dir if folder else src, tmp_path / ("out" if folder else "out.png"), "--model", model)
    res = capsys.readouterr()
    assert rc == 1
    lines = [line for line in res.err.splitlines() if line.strip()]
    assert lines == [
        "error: huge.png: too large to open safely (Image size (100000000 pixels) exceeds limit of "
        f"{limit} pixels, could be decompression bomb DOS attack.)"
    ]
    assert not [w for w in caught if issubclass(w.category, Image.DecompressionBombWarning)]
    assert "Warning" not in res.err + res.out
    assert limit == Image.MAX_IMAGE_PIXELS  # the limit itself is left alone
    assert not list(tmp_path.glob("out*/*")) and not (tmp_path / "out.png").exists()


def test_exif_orientation_is_applied_and_not_left_for_viewers(tmp_path, capsys):
    model = _model(tmp_path)
    # Stored landscape 40x20, left half white; orientation 6 = "rotate 90 CW to display".
    arr = np.zeros((20, 40, 3), np.uint8)
    arr[:, :20] = 255
    src = tmp_path / "photo.jpg"
    exif = Image.Exif()
    exif[0x0112] = 6
    Image.fromarray(arr).save(src, quality=95, exif=exif)
    dst = tmp_path / "out.png"
    assert _up(src, dst, "--model", model, "--quiet") == 0
    assert "EXIF orientation 6 applied" in capsys.readouterr().err
    out = Image.open(dst)
    assert out.size == (40, 80)  # portrait, as a viewer shows the input
    assert out.getexif().get(0x0112) in (None, 1)
    grey = np.asarray(out.convert("L"), np.float32)
    assert grey[:40].mean() > grey[40:].mean() + 50  # rotated CW: the white half is now on top


def test_animated_gif_is_named_and_included_in_folders(tmp_path, capsys):
    model = _model(tmp_path)
    folder = tmp_path / "in"
    folder.mkdir()
    frames = [Image.new("RGB", (10, 12), c) for c in ((255, 0, 0), (0, 0, 255))]
    frames[0].save(folder / "anim.gif", save_all=True, append_images=frames[1:], duration=100)
    out = tmp_path / "out"
    assert _up(folder, out, "--model", model, "--quiet") == 0
    res = capsys.readouterr()
    assert "anim.gif: animated (2 frames): only the first frame is upscaled" in res.err
    assert Image.open(out / "anim.png").size == (20, 24)


def test_16_bit_rgb_is_named(tmp_path, capsys):
    model = _model(tmp_path)
    w, h = 10, 12
    data = (np.arange(h * w * 3, dtype=np.uint32).reshape(h, w, 3) * 181 % 65536).astype(">u2")
    rows = b"".join(b"\x00" + data[y].tobytes() for y in range(h))
    src = _raw_png(tmp_path / "deep.png", w, h, 16, 2, rows)
    assert _up(src, tmp_path / "o.png", "--model", model, "--quiet") == 0
    assert "16-bit colour is read as 8 bits" in capsys.readouterr().err
    assert Image.open(tmp_path / "o.png").size == (20, 24)


def test_jpeg_output_of_an_rgba_input_says_alpha_was_dropped(tmp_path, capsys):
    model = _model(tmp_path)
    src = _png(tmp_path / "in.png", mode="RGBA")
    assert _up(src, tmp_path / "o.jpg", "--model", model, "--quiet") == 0
    assert "alpha dropped" in capsys.readouterr().err
    assert Image.open(tmp_path / "o.jpg").mode == "RGB"


# -- options and errors -----------------------------------------------------------------------------


def test_errors_name_the_problem(tmp_path, capsys):
    bad = tmp_path / "bad.pth"
    bad.write_bytes(b"garbage")
    src = _png(tmp_path / "in.png")
    assert _up(src, tmp_path / "o.png", "--model", bad) == 2
    assert "bad.pth: corrupt or unreadable" in capsys.readouterr().err
    model = _model(tmp_path)
    assert _up(tmp_path / "nope.png", tmp_path / "o.png", "--model", model) == 2
    assert "`input` not found" in capsys.readouterr().err
    assert _up(src, tmp_path / "o.png", "--model", model, "--tile", "3") == 2
    assert "`--tile`" in capsys.readouterr().err
    broken = tmp_path / "broken.png"
    broken.write_bytes(b"\x89PNG not really")
    assert _up(broken, tmp_path / "o.png", "--model", model, "--quiet") == 1
    err = capsys.readouterr().err
    assert "broken.png: cannot read image" in err and err.count("\n") == 1


@pytest.mark.parametrize("value", ["inf", "nan", "0", "-2", "two"])
def test_bad_scale_is_refused_before_any_work(tmp_path, capsys, value):
    with pytest.raises(SystemExit) as exc:
        main(["upscale", "in.png", "o.png", "--model", "m.pth", f"--scale={value}"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--scale" in err and err.count("\n") == 1


def test_unknown_output_type_is_refused_before_the_model_loads(tmp_path, capsys):
    bad = tmp_path / "bad.pth"
    bad.write_bytes(b"garbage")  # would fail to load: the output check comes first
    src = _png(tmp_path / "in.png")
    for name in ("o.xyz", "o"):
        assert _up(src, tmp_path / name, "--model", bad) == 2
        err = capsys.readouterr().err
        assert "unknown image type" in err and "bad.pth" not in err


@pytest.mark.parametrize(
    ("device", "words"), [("banana", "not a device name"), ("cuda", "no CUDA GPU"), ("cuda:7", "CUDA")]
)
def test_bad_device_is_refused_up_front(tmp_path, capsys, device, words):
    if device.startswith("cuda") and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    model = _model(tmp_path)
    src = _png(tmp_path / "in.png")
    assert _up(src, tmp_path / "o.png", "--model", model, "--device", device) == 2
    err = capsys.readouterr().err
    assert f"`--device {device}`" in err and words in err and "corrupt" not in err
    assert err.count("\n") == 1 and not (tmp_path / "o.png").exists()


def test_debug_shows_the_traceback(tmp_path, capsys, monkeypatch):
    model = _model(tmp_path)
    src = _png(tmp_path / "in.png")

    def broken(*a, **k):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(_cli_upscale.os, "fsync", broken)
    assert _up(src, tmp_path / "o.png", "--model", model, "--quiet") == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and "No space left on device" in err
    assert _up(src, tmp_path / "o.png", "--model", model, "--quiet", "--debug") == 1
    assert "Traceback" in capsys.readouterr().err
    assert not (tmp_path / "o.png").exists() and _no_partials(tmp_path)


def test_library_entry_points_name_bad_arguments():
    with pytest.raises(UpscaleError, match="`path` must be a model file path"):
        load_model(None)
    with pytest.raises(ValueError, match="`device`"):
        UpscaleConfig(device="banana")
    with pytest.raises(UpscaleError, match="`device`"):
        load_model("x.pth", device="banana")


def test_ctrl_c_while_writing_a_single_file(tmp_path, monkeypatch, capsys):
    model = _model(tmp_path)
    src = _png(tmp_path / "in.png")
    dst = tmp_path / "out.png"

    def fsync(fd):
        raise KeyboardInterrupt

    monkeypatch.setattr(_cli_upscale.os, "fsync", fsync)
    assert _up(src, dst, "--model", model, "--quiet") == 130
    assert capsys.readouterr().err == "interrupted\n"
    assert not dst.exists() and _no_partials(tmp_path)


def test_colour_profile_is_kept(tmp_path):
    from PIL import ImageCms

    model = _model(tmp_path)
    icc = ImageCms.ImageCmsProfile(ImageCms.createProfile("sRGB")).tobytes()
    src = tmp_path / "in.png"
    Image.open(_png(tmp_path / "plain.png")).save(src, icc_profile=icc)
    assert _up(src, tmp_path / "o.png", "--model", model, "--quiet") == 0
    assert Image.open(tmp_path / "o.png").info.get("icc_profile") == icc


def test_bad_device_with_emulated_card_is_one_line(tmp_path, capsys):
    src = _png(tmp_path / "in.png")
    rc = _up(
        src, tmp_path / "o.png", "--model", tmp_path / "m.pth", "--device", "banana", "--emulate-vram", "4GB"
    )
    assert rc == 2
    err = capsys.readouterr().err
    assert err.startswith("error: `--device banana`: not a device name") and err.count("\n") == 1
