"""PIL modes, model files and the model cache of the upscaler."""

from __future__ import annotations

import gc
import os
import weakref

import numpy as np
import pytest
import torch
from conftest import compact_class, image_like, save_and_load
from PIL import Image
from tolerances import UPSCALE_LSB

from lib_vram.upscale import (
    ModelCache,
    UpscaleConfig,
    UpscaleError,
    UpscaleReport,
    load_model,
    upscale_image,
    upscale_tensor,
)


class Nearest(torch.nn.Module):
    def __init__(self, s: int) -> None:
        super().__init__()
        self.up = torch.nn.Upsample(scale_factor=s, mode="nearest")

    def forward(self, x):
        return self.up(x)


def rgb_image(h: int = 20, w: int = 28) -> Image.Image:
    arr = (image_like(h, w)[0].permute(1, 2, 0).numpy() * 255).round().astype(np.uint8)
    return Image.fromarray(arr, "RGB")


TILED = UpscaleConfig(tile=8, overlap=2, batch=2)


# -- modes --------------------------------------------------------------------------------------------


def test_rgb_through_a_real_spandrel_model(tiny_compact):
    img = rgb_image()
    rep = UpscaleReport()
    # tiles of 8 with the calibrated overlap: the upscaler's exactness bound applies (TILED's 2 px
    # overlap is below this model's context: no bound is promised for it)
    out = upscale_image(tiny_compact, img, config=UpscaleConfig(tile=8, batch=2), report=rep)
    assert out.mode == "RGB" and out.size == (56, 40)
    assert rep.tiled and rep.exact, rep.plan
    ref = tiny_compact(torch.from_numpy(np.array(img)).permute(2, 0, 1)[None].float() / 255)
    ref8 = (ref[0].permute(1, 2, 0) * 255).round().numpy().astype(np.int16)
    assert np.abs(np.asarray(out).astype(np.int16) - ref8).max() <= UPSCALE_LSB


@pytest.mark.parametrize("alpha", ["model", "resize"])
def test_rgba_keeps_alpha(alpha):
    img = rgb_image().convert("RGBA")
    a = np.zeros((20, 28), np.uint8)
    a[5:15, 4:20] = 255
    img.putalpha(Image.fromarray(a, "L"))
    out = upscale_image(Nearest(2), img, scale=2, config=TILED, alpha=alpha)
    assert out.mode == "RGBA" and out.size == (56, 40)
    got = np.asarray(out.getchannel("A"))
    if alpha == "model":  # a nearest model maps alpha exactly
        np.testing.assert_array_equal(got, a.repeat(2, 0).repeat(2, 1))
    else:
        assert got[12, 20] == 255 and got[0, 0] == 0
    np.testing.assert_array_equal(np.asarray(out.convert("RGB"))[::2, ::2], np.asarray(img.convert("RGB")))


def test_grey_palette_and_transparency_modes():
    grey = rgb_image().convert("L")
    out = upscale_image(Nearest(2), grey, scale=2, config=TILED)
    assert out.mode == "L"
    np.testing.assert_array_equal(np.asarray(out)[::2, ::2], np.asarray(grey))

    pal = rgb_image().convert("P", palette=Image.ADAPTIVE, colors=16)
    out = upscale_image(Nearest(2), pal, scale=2, config=TILED)
    assert out.mode == "RGB" and out.size == (56, 40)
    np.testing.assert_array_equal(np.asarray(out)[::2, ::2], np.asarray(pal.convert("RGB")))

    pal.info["transparency"] = 0
    out = upscale_image(Nearest(2), pal, scale=2, config=TILED)
    assert out.mode == "RGBA"
    assert (np.asarray(out.getchannel("A")) == 0).any()

    la = grey.convert("LA")
    assert upscale_image(Nearest(2), la, scale=2, config=TILED).mode == "LA"
    assert upscale_image(Nearest(2), rgb_image().convert("CMYK"), scale=2).mode == "RGB"


@pytest.mark.parametrize("mode", ["I;16", "I"])
def test_16_bit_grey_keeps_16_bit_precision(mode):
    arr = np.random.default_rng(0).integers(0, 65536, size=(12, 10)).astype(np.uint16)
    arr[0, 0], arr[0, 1] = 12345, 12346  # one 16-bit step apart: lost in an 8-bit path
    img = Image.fromarray(arr, "I;16") if mode == "I;16" else Image.fromarray(arr.astype(np.int32), "I")
    out = upscale_image(Nearest(2), img, scale=2, config=TILED)
    assert out.mode == mode and out.size == (20, 24)
    np.testing.assert_array_equal(np.asarray(out).astype(np.int64)[::2, ::2], arr.astype(np.int64))


def test_one_pixel_image_and_image_below_the_minimum(tiny_rrdb):
    one = Image.new("RGB", (1, 1), (200, 30, 90))
    out = upscale_image(tiny_rrdb, one)
    assert out.size == (4, 4) and out.mode == "RGB"
    small = rgb_image(3, 2)  # below a minimum of 8: padded, run, cropped
    tiny_rrdb.size_requirements.minimum = 8
    out = upscale_image(tiny_rrdb, small, config=UpscaleConfig(tile=8, overlap=2))
    assert out.size == (8, 12)


def test_bad_alpha_argument():
    with pytest.raises(ValueError, match="`alpha`"):
        upscale_image(Nearest(2), rgb_image(), scale=2, alpha="drop")


# -- files --------------------------------------------------------------------------------------------


def _compact_file(path, seed=0):
    torch.manual_seed(seed)
    net = compact_class()(num_in_ch=3, num_out_ch=3, num_feat=8, num_conv=2, upscale=2)
    save_and_load(net, path)
    return path


def test_load_model_and_cache(tmp_path):
    a = _compact_file(tmp_path / "a.safetensors")
    b = _compact_file(tmp_path / "b.safetensors", seed=1)
    c = _compact_file(tmp_path / "c.safetensors", seed=2)
    cache = ModelCache(max_models=2)
    m1 = load_model(a, device="cpu", cache=cache)
    assert load_model(a, device="cpu", cache=cache) is m1 and cache.loads == 1
    y = upscale_tensor(m1, image_like(8, 8))
    assert y.shape == (1, 3, 16, 16)
    load_model(b, device="cpu", cache=cache)
    load_model(c, device="cpu", cache=cache)  # evicts a (least recently used)
    assert len(cache) == 2 and cache.loads == 3
    load_model(a, device="cpu", cache=cache)
    assert cache.loads == 4
    st = os.stat(a)
    os.utime(a, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # changed on disk -> reloaded
    load_model(a, device="cpu", cache=cache)
    assert cache.loads == 5
    ref = weakref.ref(load_model(b, device="cpu", cache=cache))
    cache.clear()
    gc.collect()
    assert len(cache) == 0 and ref() is None


@pytest.mark.parametrize(
    ("name", "content", "reason"),
    [
        ("broken.pth", b"this is not a checkpoint", "corrupt or unreadable"),
        ("broken.safetensors", b"\x08\x00\x00\x00\x00\x00\x00\x00{bad", "corrupt or unreadable"),
        ("model.onnx", b"whatever", "unsupported file type"),
    ],
)
def test_bad_model_files_name_the_file_and_reason(tmp_path, name, content, reason):
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(UpscaleError, match=reason) as info:
        load_model(path, device="cpu", cache=ModelCache())
    assert name in str(info.value)


def test_truncated_and_unknown_architecture_files(tmp_path):
    good = _compact_file(tmp_path / "good.safetensors")
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(good.read_bytes()[:-100])
    with pytest.raises(UpscaleError, match="cut.safetensors: corrupt"):
        load_model(cut, device="cpu", cache=ModelCache())
    from safetensors.torch import save_file

    odd = tmp_path / "odd.safetensors"
    save_file({"not.a.known.layer": torch.zeros(3)}, str(odd))
    with pytest.raises(UpscaleError, match="odd.safetensors: unsupported model architecture"):
        load_model(odd, device="cpu", cache=ModelCache())
    with pytest.raises(UpscaleError, match="missing.pth: no such model file"):
        load_model(tmp_path / "missing.pth", device="cpu", cache=ModelCache())


def test_cache_validation():
    with pytest.raises(ValueError, match="`max_models`"):
        ModelCache(max_models=0)
