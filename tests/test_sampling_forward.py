"""What runs in a UNet's forward (lib_vram.sampling.inspect_unet): the stock blocks, or an
extension's change, found by where its code lives — on the WebUI's own ldm UNet class."""

from __future__ import annotations

import functools
from contextlib import ExitStack

import pytest
import torch
from extension_code import extension_module
from webui_fakes import tiny_xattn_unet

from lib_vram.sampling import ForwardCheck, inspect_unet, origin_of
from lib_vram.webui.patching import patch_attr


@pytest.fixture
def unet():
    return tiny_xattn_unet()


def test_the_stock_ldm_unet_is_the_stock_forward(unet):
    check = inspect_unet(unet)
    assert check == ForwardCheck() and check.per_sample and check.modelled
    assert check.reason() == "the stock forward"


def test_a_module_an_extension_puts_into_a_block_is_found_and_named(unet, tmp_path):
    ext = extension_module(tmp_path, "sd-webui-animatediff")
    unet.input_blocks[1].append(ext.TemporalMix(2))
    check = inspect_unet(unet)
    assert not check.per_sample and not check.modelled
    assert check.names == ("AnimateDiff",)
    assert "module TemporalMix in input_blocks.1.2" in check.reason(), check.reason()


def test_an_unknown_extension_is_neither_per_sample_nor_modelled(unet, tmp_path):
    ext = extension_module(tmp_path, "sd-webui-something-new")
    unet.output_blocks[0].register_forward_pre_hook(ext.count_batches([]))
    check = inspect_unet(unet)
    assert not check.per_sample and not check.modelled
    assert check.names == ("the extension 'sd-webui-something-new'",)
    assert "a hook on output_blocks.0" in check.reason()


def test_a_known_per_sample_change_is_per_sample_but_not_modelled(unet, tmp_path):
    ext = extension_module(tmp_path, "multidiffusion-upscaler-for-automatic1111")
    block = unet.middle_block
    block.forward = ext.wrap(block.forward)
    check = inspect_unet(unet)
    assert check.per_sample and not check.modelled
    assert (
        check.reason()
        == "the UNet's forward is changed by Tiled Diffusion (forward of middle_block replaced)"
    )


def test_a_class_forward_replaced_is_found_where_the_replacement_lives(unet, tmp_path):
    ext = extension_module(tmp_path, "sd-webui-animatediff")
    norm = type(unet.input_blocks[1][0].in_layers[0])  # ldm's GroupNorm32 (AnimateDiff v1 patches it)
    saved = norm.__dict__["forward"]
    norm.forward = ext.wrap(saved)
    try:
        check = inspect_unet(unet)
    finally:
        norm.forward = saved
    assert any(f.what == "GroupNorm32.forward replaced" for f in check.findings), check.findings
    assert check.names == ("AnimateDiff",) and not check.per_sample


def test_a_global_hook_is_a_finding_for_every_module(unet, tmp_path):
    ext = extension_module(tmp_path, "sd-webui-something-new")
    handle = torch.nn.modules.module.register_module_forward_pre_hook(ext.count_batches([]))
    try:
        check = inspect_unet(unet)
    finally:
        handle.remove()
    assert [f.what for f in check.findings] == ["a hook on every module"]


def test_the_file_wins_over_a_copied_module_name(tmp_path):
    """``functools.wraps`` copies ``__module__`` (HyperTile's wrapper says it is the WebUI's)."""
    ext = extension_module(tmp_path, "sd-webui-animatediff")

    def stock() -> None: ...

    wrapped = functools.wraps(stock)(ext.wrap(stock))
    assert wrapped.__module__ == __name__ and origin_of(wrapped) == "sd-webui-animatediff"
    assert origin_of(functools.partial(wrapped, 1)) == "sd-webui-animatediff"
    assert origin_of(torch.nn.Conv2d.forward) == "torch"
    assert origin_of(type(tiny_xattn_unet())) == "model"


def test_vram_guards_own_wrapper_is_looked_through_to_what_it_wraps(unet, tmp_path):
    ext = extension_module(tmp_path, "sd-webui-something-new")
    with ExitStack() as stack:
        patch_attr(unet, "forward", lambda previous, *a, **k: previous(*a, **k), stack)
        assert inspect_unet(unet) == ForwardCheck()  # ours over the class forward: stock
    unet.forward = ext.wrap(unet.forward)
    with ExitStack() as stack:
        patch_attr(unet, "forward", lambda previous, *a, **k: previous(*a, **k), stack)
        assert [f.what for f in inspect_unet(unet).findings] == ["forward of the UNet replaced"]


def test_what_the_caller_handles_is_allowed(unet, tmp_path):
    ext = extension_module(tmp_path, "sd-webui-controlnet")
    unet.forward = ext.wrap(unet.forward)
    assert inspect_unet(unet).names == ("ControlNet",)
    assert inspect_unet(unet, allow=lambda obj, module: module is unet) == ForwardCheck()


def test_checks_add_up_without_repeats(unet, tmp_path):
    ext = extension_module(tmp_path, "sd-webui-animatediff")
    unet.input_blocks[1].append(ext.TemporalMix(2))
    a = inspect_unet(unet)
    assert (a + a) == a and (ForwardCheck() + a) == a


def test_the_webuis_hypertile_is_not_the_stock_forward(unet, tmp_path):
    """HyperTile lives in the WebUI's own ``modules/hypertile.py`` (Settings -> Optimizations):
    its wrappers are named as HyperTile, not as the WebUI's stock code."""
    path = tmp_path / "modules" / "hypertile.py"
    path.parent.mkdir()
    path.write_text(
        "def wrap(fn):\n    def forward(*a, **k):\n        return fn(*a, **k)\n\n    return forward\n"
    )
    namespace: dict = {}
    exec(compile(path.read_text(), str(path), "exec"), namespace)
    other = tmp_path / "modules" / "sd_samplers.py"
    other.write_text("def stock(*a, **k):\n    return None\n")
    exec(compile(other.read_text(), str(other), "exec"), namespace)
    attn = unet.input_blocks[1][1].transformer_blocks[0].attn1
    attn.forward = namespace["wrap"](attn.forward)
    check = inspect_unet(unet)
    assert [f.name for f in check.findings] == ["HyperTile"] and check.per_sample, check
    assert origin_of(namespace["stock"]) == "webui"


def test_vram_guard_installed_as_a_webui_extension_is_its_own_code(unet, tmp_path, monkeypatch):
    """In the WebUI VRAM Guard lives under ``extensions/<folder>/lib_vram/``: its own wrapper on
    the UNet is not another extension's (the real WebUI named it 'vram-guard')."""
    import lib_vram.webui.patching as patching

    path = tmp_path / "extensions" / "vram-guard" / "lib_vram" / "webui" / "patching.py"
    monkeypatch.setattr(patching, "__file__", str(path))  # where the WebUI loads it from
    with ExitStack() as stack:
        patch = patch_attr(unet, "forward", lambda previous, *a, **k: previous(*a, **k), stack)
        assert origin_of(patch) == "lib_vram"
        assert inspect_unet(unet) == ForwardCheck()


def test_a_torch_decorator_over_an_extensions_forward_is_looked_through(tmp_path):
    """Tiled Diffusion's ``kdiff_forward`` is ``@torch.no_grad()`` over its own function: the
    outer code is torch's (the real WebUI planned the stock forward for it)."""
    ext = extension_module(tmp_path, "multidiffusion-upscaler-for-automatic1111")

    class Delegate:
        forward = torch.no_grad()(ext.wrap(lambda *a: None))

    assert origin_of(Delegate().forward) == "multidiffusion-upscaler-for-automatic1111"
    assert origin_of(torch.no_grad()(torch.nn.functional.relu)) == "torch"


def test_tiled_diffusions_sampler_model_in_the_webui_is_found_around_the_unet(unet, tmp_path):
    """MultiDiffusion sets ``p.sampler.model_wrap_cfg.inner_model.forward`` to its own (decorated)
    method when the sampler is made, before ``process_before_every_sampling``."""
    from types import SimpleNamespace

    from lib_vram.webui.forwards import check_pass

    ext = extension_module(tmp_path, "multidiffusion-upscaler-for-automatic1111")
    denoiser = torch.nn.Module()

    class Cfg:  # the WebUI's CFGDenoiserKDiffusion: inner_model is a property
        @property
        def inner_model(self) -> torch.nn.Module:
            return denoiser

    p = SimpleNamespace(sampler=SimpleNamespace(model_wrap_cfg=Cfg()))
    model = SimpleNamespace()
    assert check_pass(p, model, unet) == ForwardCheck()
    denoiser.forward = torch.no_grad()(ext.wrap(lambda *a: None))
    check = check_pass(p, model, unet)
    assert check.names == ("Tiled Diffusion",) and check.per_sample and not check.modelled
    assert "the sampler's model replaced" in check.reason()
