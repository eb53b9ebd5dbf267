"""``python -m lib_vram bench vae-estimate``: the tiled VAE engine's analytic estimate (what auto mode
uses at run time) against :func:`lib_vram.cli.stageplan.predict_engine_vae` (within 5 % of measured
peaks). Method: docs/benchmarks.md, "The VAE engine's quick estimate".
"""

from __future__ import annotations

import argparse
import time

import torch

from ._harness import Bench, Column, fmt, mib_of, runner
from ._harness import table as grid

HELP = "Tiled VAE: analytic estimate vs the engine's fake-tensor prediction."

# (kind, image px, tile latent px, mode, ch)
CASES: tuple[tuple[str, int, int | None, str, int], ...] = (
    ("decode", 256, 16, "exact", 128), ("decode", 256, 16, "fast", 128), ("decode", 512, 32, "exact", 128),
    ("decode", 512, 32, "fast", 128), ("decode", 512, 16, "exact", 128), ("decode", 1024, 64, "exact", 128),
    ("decode", 1024, 32, "fast", 128), ("decode", 1024, 64, "fast", 128), ("encode", 256, 16, "exact", 128),
    ("encode", 512, 32, "exact", 128), ("decode", 256, None, "untiled", 128),
    ("decode", 384, 16, "exact", 128), ("decode", 768, 24, "exact", 128), ("decode", 768, 48, "fast", 128),
    ("decode", 1024, 32, "exact", 64), ("encode", 384, 16, "exact", 128), ("encode", 768, 48, "exact", 128),
    ("encode", 512, 32, "fast", 128), ("encode", 512, None, "untiled", 128),
)  # fmt: skip


def bench(args: argparse.Namespace) -> Bench:
    return Bench(CASES, lambda case: _record(*case), _table, lines=False,
                 label=lambda c: f"{c[0]} {c[1]}² {c[3]} t{c[2]} ch{c[4]}")  # fmt: skip


def _record(kind: str, px: int, tile: int | None, mode: str, ch: int) -> dict:
    from lib_vram.cli.hostmodels import SD_VAE, build_ldm
    from lib_vram.cli.stageplan import predict_engine_vae
    from lib_vram.vae import decoder_spec, encoder_spec
    from lib_vram.vae._plan import combine, estimate_components, fast_sample_for

    with torch.device("meta"):
        module = build_ldm("decoder" if kind == "decode" else "encoder", {**SD_VAE, "ch": ch}, seed=None)
    spec = (decoder_spec if kind == "decode" else encoder_spec)(module)
    shape = (1, 4, px // 8, px // 8) if kind == "decode" else (1, 3, px, px)
    rec = {"kind": kind, "px": px, "tile": tile, "mode": mode, "ch": ch}
    for backend in ("cpu", "cuda"):
        t0 = time.perf_counter()
        p = predict_engine_vae(module, kind, shape, torch.float32, tile=tile, mode=mode, backend=backend)
        rec[f"predicted_{backend}"] = p.input_bytes + p.activation_bytes
        rec["predict_seconds"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        # the statistics subsampling the engine picks for this shape (what the prediction ran)
        fs = fast_sample_for(None, spec.kind, shape[-2], shape[-1])
        comps = estimate_components(
            spec, shape, torch.float32, tile=tile, mode=mode, backend=backend, fast_sample=fs
        )
        rec[f"estimate_{backend}"] = combine(comps)
        rec["estimate_ms"] = 1000 * (time.perf_counter() - t0)
    return rec


def _table(rows: list[dict]) -> str:
    def case(r: dict) -> str:
        tile = "untiled" if r["tile"] is None else f"{r['mode']} t{r['tile']}"
        return f"{r['kind']} {r['px']}² {tile}" + ("" if r["ch"] == 128 else f" ch{r['ch']}")

    def error(be: str) -> Column:
        return lambda r: f"{100 * (r[f'estimate_{be}'] / r[f'predicted_{be}'] - 1):+.1f} %"

    return grid([("case", case), ("estimate, tensors", mib_of("estimate_cuda")),
                 ("prediction, tensors", mib_of("predicted_cuda")), ("error", error("cuda")),
                 ("estimate, CPU", mib_of("estimate_cpu")), ("prediction, CPU", mib_of("predicted_cpu")),
                 ("error", error("cpu")), ("estimate ms", fmt("estimate_ms", ".1f")),
                 ("prediction s", fmt("predict_seconds", ".1f"))], rows)  # fmt: skip


run = runner(bench)
