"""Shared test helpers.

The spandrel architecture imports live in one place, :mod:`lib_vram.cli.models.synthetic` (shared with
the benchmark), re-exported here: a spandrel version bump touches one line there.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import settings

from lib_vram.cli.models.synthetic import compact_class, image_like, make_imagelike_rrdb, rrdb_class

# Property tests check logic, not speed: on a loaded 2-core machine an example can take longer than
# hypothesis' default 200 ms deadline, which would make CI flaky.
settings.register_profile("vram_guard", deadline=None)
settings.load_profile("vram_guard")

NUMERIC_MODULES = frozenset(
    {
        "test_cli_emulate",
        "test_emulate",
        "test_hooks",
        "test_learning",
        "test_preprocessors",
        "test_upscale",
        "test_upscale_archs",
        "test_upscale_io",
        "test_vae_engine",
        "test_vae_fast_range",
        "test_vae_forge",
        "test_vae_sgm",
        "test_webui_emulate",
        "test_webui_engines",
        "test_webui_forge",
        "test_webui_job",
        "test_webui_offload",
        "test_webui_unet",
        "test_webui_upscalers",
    }
)
"""Test modules that compare computed tensors or images: against a bound of ``tests/tolerances.py``,
or bit for bit where both sides run the same operations. Their tests are marked ``numeric``; CI
runs them a second time under another CPU kernel set and one thread (docs/development.md). A new
module with such comparisons belongs here."""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    numeric = pytest.mark.numeric
    for item in items:
        if item.path.stem in NUMERIC_MODULES:
            item.add_marker(numeric)


__all__ = [
    "compact_class", "image_like", "learned_keys", "make_imagelike_rrdb", "rrdb_class", "save_and_load"
]  # fmt: skip


def learned_keys(mem) -> list:  # noqa: ANN001
    """Every key the plan memory ``mem`` recorded an outcome for."""
    return list(mem._history)


def save_and_load(net: torch.nn.Module, path: Path):
    """Save ``net``'s weights as safetensors and load them back through spandrel's ModelLoader."""
    import spandrel
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in net.state_dict().items()}, str(path))
    return spandrel.ModelLoader().load_from_file(str(path))


@pytest.fixture(autouse=True)
def _lib_vram_logger_restored():
    """A CLI ``main()`` configures the ``lib_vram`` logger (its handler, level, ``propagate``
    False); put it back after every test, so that a later test's ``caplog`` (on the root logger)
    sees the library's records whatever ran before it."""
    import logging

    logger = logging.getLogger("lib_vram")
    saved = (list(logger.handlers), logger.level, logger.propagate)
    yield
    logger.handlers[:] = saved[0]
    logger.setLevel(saved[1])
    logger.propagate = saved[2]


@pytest.fixture(autouse=True)
def _fresh_plan_memory():
    """Every test starts with an empty process-wide planner memory (the engines learn into it)."""
    from lib_vram.planning import planner

    planner.MEMORY.clear()
    yield
    planner.MEMORY.clear()


@pytest.fixture
def tiny_compact(tmp_path):
    """A real spandrel Compact x2 (8 features, 2 convs), random weights, loaded from a file."""
    torch.manual_seed(0)
    net = compact_class()(num_in_ch=3, num_out_ch=3, num_feat=8, num_conv=2, upscale=2)
    return save_and_load(net, tmp_path / "tiny_compact.safetensors")


@pytest.fixture
def tiny_rrdb(tmp_path):
    """A real spandrel ESRGAN (RRDBNet x4, 8 filters, 1 block), image-like, loaded from a file."""
    torch.manual_seed(0)
    net = make_imagelike_rrdb(rrdb_class()(in_nc=3, out_nc=3, num_filters=8, num_blocks=1, scale=4))
    return save_and_load(net, tmp_path / "tiny_rrdb.safetensors")


@pytest.fixture(autouse=True)
def _no_leaked_emulated_card():
    """``--emulate-vram`` exports VRAM_GUARD_EMULATE_VRAM for the benchmarks' child processes; a test
    that ran ``main`` with it must not leave the next test on an emulated card."""
    import os

    saved = os.environ.get("VRAM_GUARD_EMULATE_VRAM")
    yield
    if saved is None:
        os.environ.pop("VRAM_GUARD_EMULATE_VRAM", None)
    else:
        os.environ["VRAM_GUARD_EMULATE_VRAM"] = saved
