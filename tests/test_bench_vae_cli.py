"""The `bench` command line: target registry and the VAE table (no heavy run here)."""

from __future__ import annotations

import pytest

from lib_vram.cli import build_parser
from lib_vram.cli.bench.vae import select_cases, table
from lib_vram.cli.models.synthetic import image_latent


def test_bench_vae_is_registered_and_parses():
    args = build_parser().parse_args(
        ["bench", "vae", "--quick", "--json", "--device", "cpu", "--dtype", "fp16"]
    )
    assert args.target == "vae" and args.quick and args.json and args.dtype == "fp16"


def test_table_reports_ratios_against_untiled():
    base = {"method": "decode", "mode": "untiled", "image_px": 512, "tile": None, "seconds": 10.0}
    base.update(cpu_seconds=10.0, peak_bytes=1000 * 2**20, psnr_db=None, max_abs_err=None)
    exact = dict(base, mode="exact", tile=32, cpu_seconds=11.0, peak_bytes=200 * 2**20, psnr_db=120.0)
    exact["max_abs_err"] = 1e-5
    text = table([base, exact])
    row = text.splitlines()[-1]
    assert "1.10x" in row and "20 %" in row and "120.0" in row


def test_benchmark_latent_is_image_like_not_white_noise():
    z = image_latent(128)
    assert z.shape == (1, 4, 16, 16)
    # Neighbouring latent pixels are correlated (white noise would give ~0).
    a, b = z[..., :, :-1].flatten(), z[..., :, 1:].flatten()
    corr = float(((a - a.mean()) * (b - b.mean())).mean() / (a.std() * b.std()))
    assert corr > 0.3


def test_case_filter_by_size_and_mode():
    args = build_parser().parse_args(["bench", "vae", "--sizes", "512", "--modes", "untiled,fast"])
    cases = select_cases(args)
    assert cases and {c[2] for c in cases} == {512}
    assert {c[1] for c in cases} == {"untiled", "fast"}
    bad = build_parser().parse_args(["bench", "vae", "--modes", "fastest"])
    with pytest.raises(ValueError, match="--modes"):
        select_cases(bad)
