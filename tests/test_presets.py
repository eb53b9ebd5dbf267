from __future__ import annotations

import ast
from dataclasses import FrozenInstanceError, replace
from pathlib import Path
from types import SimpleNamespace

import pytest

from lib_vram.planning import presets
from lib_vram.planning.presets import (
    PRESET_NAMES,
    PRESETS,
    RELEASE_POINTS,
    allocator_conf,
    resolve_precision,
    resolve_preset,
)
from lib_vram.planning.tiers import TIERS_GB, GiB

TIER_NAMES = [n for n in PRESET_NAMES if n != "Auto"]


def test_table_is_complete_and_valid():
    assert PRESET_NAMES == ("Auto", "4GB", "6GB", "8GB", "12GB", "16GB", "24GB+")
    assert list(PRESETS) == TIER_NAMES
    assert [PRESETS[n].tier_gb for n in TIER_NAMES] == list(TIERS_GB)
    for name, p in PRESETS.items():
        assert p.name == name
        assert p.vae_mode in presets.VAE_MODES
        assert {p.precision_vae, p.precision_upscale} <= set(presets.PRECISIONS)
        assert set(p.release_at) <= set(RELEASE_POINTS)
        assert p.safety_margin_bytes >= 0 and 0.0 <= p.safety_margin_fraction < 0.5
        gct = p.allocator.get("garbage_collection_threshold")
        assert gct is None or 0.0 < float(gct) < 1.0
        assert "failure" in p.release_at, f"{name} must release when a stage fails"
        d = p.to_dict()
        assert set(d["allocator"]) == {"garbage_collection_threshold", "expandable_segments"}


def test_bigger_cards_never_get_more_offload_or_smaller_margins():
    rows = [PRESETS[n] for n in TIER_NAMES]
    for small, big in zip(rows, rows[1:]):
        assert big.release_at <= small.release_at
        assert big.offload_unet_during_vae <= small.offload_unet_during_vae
        assert big.offload_text_encoder_during_vae <= small.offload_text_encoder_during_vae
        assert big.safety_margin_bytes >= small.safety_margin_bytes


def test_presets_are_frozen():
    with pytest.raises(FrozenInstanceError):
        PRESETS["4GB"].vae_mode = "off"  # type: ignore[misc]
    with pytest.raises(TypeError):
        PRESETS["4GB"].allocator["expandable_segments"] = False  # type: ignore[index]


@pytest.mark.parametrize(
    ("total_gib", "expected"),
    [
        (2.0, "4GB"),
        (3.8, "4GB"),
        (5.8, "6GB"),
        (7.6, "8GB"),
        (11.7, "12GB"),
        (15.7, "16GB"),
        (23.6, "24GB+"),
        (80, "24GB+"),
    ],
)
def test_auto_resolves_from_total_memory(total_gib, expected):
    p = resolve_preset("Auto", int(total_gib * GiB))
    assert p.name == "Auto" and p.resolved_from == expected
    assert replace(p, name=expected, resolved_from=None) == PRESETS[expected]


def test_auto_without_half_precision_runs_fp32_and_needs_total():
    caps = SimpleNamespace(backend="cuda", fp16=False, bf16=False)
    p = resolve_preset("Auto", 4 * GiB, caps)
    assert p.precision_vae == p.precision_upscale == "fp32"
    with pytest.raises(ValueError, match="total_bytes"):
        resolve_preset("Auto")


def test_named_preset_and_unknown_name():
    assert resolve_preset("8GB") is PRESETS["8GB"]
    with pytest.raises(ValueError, match="`name`"):
        resolve_preset("5GB", 5 * GiB)


def test_resolve_precision():
    cuda_bf16 = SimpleNamespace(backend="cuda", fp16=True, bf16=True)
    cuda_old = SimpleNamespace(backend="cuda", fp16=True, bf16=False)
    cpu = SimpleNamespace(backend="cpu", fp16=True, bf16=True)
    assert resolve_precision("auto", cuda_bf16) == "bf16"
    assert resolve_precision("auto", cuda_old) == "fp16"
    assert resolve_precision("auto", cpu) == "fp32"
    assert resolve_precision("fp16", cuda_old) == "fp16"
    with pytest.raises(ValueError, match="bf16"):
        resolve_precision("bf16", cuda_old)
    with pytest.raises(ValueError, match="`policy`"):
        resolve_precision("int8", cuda_old)


def test_allocator_conf_per_platform():
    p = PRESETS["4GB"]
    assert allocator_conf(p, "cuda", "linux") == "garbage_collection_threshold:0.6,expandable_segments:True"
    assert allocator_conf(p, "cuda", "win32") == "garbage_collection_threshold:0.6"
    assert allocator_conf(p, "mps", "darwin") == ""
    assert allocator_conf(PRESETS["24GB+"], "cuda", "linux") == "expandable_segments:True"


def test_safety_margin_is_the_larger_of_floor_and_fraction():
    p = PRESETS["4GB"]
    assert p.safety_margin(1 * GiB) == p.safety_margin_bytes
    assert p.safety_margin(100 * GiB) == int(p.safety_margin_fraction * 100 * GiB)
    with pytest.raises(ValueError, match="total_bytes"):
        p.safety_margin(-1)


def test_release_points_are_the_documented_boundaries():
    assert RELEASE_POINTS == (
        "process",
        "before_hr",
        "post_sample",
        "postprocess_batch",
        "job_end",
        "failure",
    )


def test_presets_module_imports_no_torch():
    tree = ast.parse(Path(presets.__file__).read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names.add((node.module or "").split(".")[0])
    assert not names & {"torch", "numpy", "modules", "gradio"}
