"""The hook registry on real ldm VAE modules: install, remove, stacking, exceptions, threads.

Every comparison is bit-identity (``torch.equal``): a hook calls the original forward unchanged and
then the same elementwise operations, in the same order, as the reference it is compared with.
"""

from __future__ import annotations

import threading

import pytest
import torch
from webui_fakes import tiny_decoder, tiny_encoder

from lib_vram.core.hooks import ATTR, HookRegistry, register_hook, remove_hook


@pytest.fixture(scope="module")
def z() -> torch.Tensor:
    return torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(3))


def plus_one(module, call_next, *args, **kwargs):
    return call_next(*args, **kwargs) + 1.0


def test_hook_runs_and_removal_restores_exactly(z):
    dec = tiny_decoder()
    with torch.no_grad():
        plain = dec(z)
        assert "forward" not in dec.__dict__
        register_hook(dec, "vram_guard", plus_one)
        assert "forward" in dec.__dict__ and ATTR in dec.__dict__
        assert torch.equal(dec(z), plain + 1.0)
        assert remove_hook(dec, "vram_guard")
        assert "forward" not in dec.__dict__ and ATTR not in dec.__dict__
        assert torch.equal(dec(z), plain)
    assert not remove_hook(dec, "vram_guard")


def test_encoder_hook_sees_args(z):
    enc = tiny_encoder()
    x = torch.randn(1, 3, 16, 16, generator=torch.Generator().manual_seed(4))
    seen = []

    def spy(module, call_next, inp):
        seen.append((module, inp.shape))
        return call_next(inp)

    with torch.no_grad():
        plain = enc(x)
        register_hook(enc, "spy", spy)
        out = enc(x)
    assert seen == [(enc, x.shape)]
    assert torch.equal(out, plain)
    remove_hook(enc, "spy")
    assert HookRegistry.of(enc) is None  # the last hook gone: the registry too


def test_double_install_raises_and_replace_swaps(z):
    dec = tiny_decoder()
    register_hook(dec, "vram_guard", plus_one)
    with pytest.raises(ValueError, match="already registered"):
        register_hook(dec, "vram_guard", plus_one)
    register_hook(dec, "vram_guard", lambda m, nxt, *a, **k: nxt(*a, **k) * 0.0, replace=True)
    with torch.no_grad():
        assert torch.count_nonzero(dec(z)) == 0
    assert HookRegistry.of(dec).names == ("vram_guard",)
    remove_hook(dec, "vram_guard")
    assert "forward" not in dec.__dict__


def test_exception_in_hook_propagates_and_removal_still_restores(z):
    dec = tiny_decoder()
    with torch.no_grad():
        plain = dec(z)

    def boom(module, call_next, *args, **kwargs):
        raise RuntimeError("simulated failure inside the hook")

    register_hook(dec, "vram_guard", boom)
    try:
        with pytest.raises(RuntimeError, match="simulated failure"), torch.no_grad():
            dec(z)
    finally:
        remove_hook(dec, "vram_guard")
    with torch.no_grad():
        assert torch.equal(dec(z), plain)
    assert "forward" not in dec.__dict__


def test_two_named_hooks_removal_relinks_chain(z):
    dec = tiny_decoder()
    with torch.no_grad():
        plain = dec(z)
        register_hook(dec, "a", plus_one)
        register_hook(dec, "b", lambda m, nxt, *a, **k: nxt(*a, **k) * 2.0)
        assert torch.equal(dec(z), (plain + 1.0) * 2.0)
        remove_hook(dec, "a")
        assert torch.equal(dec(z), plain * 2.0)
        remove_hook(dec, "b")
        assert torch.equal(dec(z), plain)


def test_foreign_wrapper_installed_after_ours_survives_our_removal(z):
    dec = tiny_decoder()
    with torch.no_grad():
        plain = dec(z)
    register_hook(dec, "vram_guard", plus_one)
    # Another extension wraps forward the naive way, after us.
    theirs_original = dec.forward

    def foreign(*args, **kwargs):
        return theirs_original(*args, **kwargs) * 3.0

    dec.forward = foreign
    with torch.no_grad():
        assert torch.equal(dec(z), (plain + 1.0) * 3.0)
        remove_hook(dec, "vram_guard")
        assert dec.forward is foreign  # theirs is still in place
        assert torch.equal(dec(z), plain * 3.0)  # = foreign(original)
        # They restore what they saw (our pass-through trampoline): still the original output.
        dec.forward = theirs_original
        assert torch.equal(dec(z), plain)
        # Installing again reuses the pass-through trampoline.
        register_hook(dec, "vram_guard", plus_one)
        assert torch.equal(dec(z), plain + 1.0)
        remove_hook(dec, "vram_guard")
        assert "forward" not in dec.__dict__
        assert torch.equal(dec(z), plain)


def test_foreign_wrapper_installed_before_ours_is_kept(z):
    dec = tiny_decoder()
    with torch.no_grad():
        plain = dec(z)
    original = dec.forward

    def foreign(*args, **kwargs):
        return original(*args, **kwargs) - 5.0

    dec.forward = foreign
    register_hook(dec, "vram_guard", plus_one)
    with torch.no_grad():
        assert torch.equal(dec(z), plain - 5.0 + 1.0)
    remove_hook(dec, "vram_guard")
    assert dec.forward is foreign


def test_foreign_removed_without_restoring_ours_is_detected(z):
    dec = tiny_decoder()
    with torch.no_grad():
        plain = dec(z)
    register_hook(dec, "vram_guard", plus_one)
    dec.forward = lambda *a, **k: None
    remove_hook(dec, "vram_guard")
    del dec.forward  # the other party deletes the instance attribute altogether
    register_hook(dec, "vram_guard", plus_one)
    with torch.no_grad():
        assert torch.equal(dec(z), plain + 1.0)
    remove_hook(dec, "vram_guard")
    assert "forward" not in dec.__dict__


def test_registry_does_not_keep_the_module_alive():
    import gc
    import weakref

    dec = tiny_decoder()
    register_hook(dec, "vram_guard", plus_one)
    ref = weakref.ref(dec)
    del dec
    gc.collect()
    assert ref() is None


def test_of_rejects_non_modules():
    with pytest.raises(TypeError, match="module"):
        HookRegistry.of(object())  # type: ignore[arg-type]


def test_concurrent_calls_while_hooks_come_and_go(z):
    """Two threads decode while the main thread installs/removes: each result is plain or hooked."""
    dec = tiny_decoder()
    with torch.no_grad():
        plain = dec(z)
    hooked = plain + 1.0
    errors: list[BaseException] = []
    seen = {"plain": 0, "hooked": 0}
    lock = threading.Lock()
    stop = threading.Event()

    def worker() -> None:
        try:
            with torch.no_grad():
                while not stop.is_set():
                    out = dec(z)
                    if torch.equal(out, plain):
                        key = "plain"
                    elif torch.equal(out, hooked):
                        key = "hooked"
                    else:
                        raise AssertionError("a call saw a half-built hook chain")
                    with lock:
                        seen[key] += 1
        except BaseException as exc:  # collected and re-raised in the main thread
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(2)]
    for t in threads:
        t.start()
    try:
        for _ in range(60):
            register_hook(dec, "vram_guard", plus_one)
            remove_hook(dec, "vram_guard")
        # Make sure both states were observed at least once.
        register_hook(dec, "vram_guard", plus_one)
        while seen["hooked"] == 0 and not errors:
            threading.Event().wait(0.01)
        remove_hook(dec, "vram_guard")
        before = seen["plain"]
        while seen["plain"] == before and not errors:
            threading.Event().wait(0.01)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=60)
    assert not errors, errors
    assert seen["plain"] > 0 and seen["hooked"] > 0
    assert "forward" not in dec.__dict__
