"""``python -m lib_vram bench vae-estimate``: the tiled VAE engine's quick analytic estimate
against the fake-tensor prediction of the engine itself (:func:`lib_vram.cli.stageplan.predict_engine_vae`).

The analytic estimate (:func:`lib_vram.vae.estimate_peak_bytes`) is what ``mode="auto"`` and the
automatic tile use at run time: milliseconds, no model run. The fake-tensor prediction runs the
engine's own code on fake tensors (seconds): it counts every tensor the engine allocates, in
order, plus the backend's convolution scratch, and is within 5 % of measured peaks (``bench
planner``). So the prediction is the reference the estimate is checked against: the table gives
both for every case, tensors only (what a GPU run uses: cuDNN's workspace is not modelled by
either) and with the CPU backend's convolution term. The estimate has no fitted factors: each term
is counted as the engine holds it (``tests/test_plan_path.py`` checks it within 10 % over a
randomized set of architectures, sizes, tiles, modes and dtypes).

Models: the real ldm ``Decoder``/``Encoder`` with the SD ``ddconfig`` (``ch`` 128, or 64), built on
the meta device (no weights, no memory). ``ldm`` is imported only here (benchmark, not core).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import time

HELP = "Tiled VAE: analytic estimate vs the engine's fake-tensor prediction."

# (kind, image px, tile latent px, mode, ch)
CASES: tuple[tuple[str, int, int | None, str, int], ...] = (
    ("decode", 256, 16, "exact", 128),
    ("decode", 256, 16, "fast", 128),
    ("decode", 512, 32, "exact", 128),
    ("decode", 512, 32, "fast", 128),
    ("decode", 512, 16, "exact", 128),
    ("decode", 1024, 64, "exact", 128),
    ("decode", 1024, 32, "fast", 128),
    ("decode", 1024, 64, "fast", 128),
    ("encode", 256, 16, "exact", 128),
    ("encode", 512, 32, "exact", 128),
    ("decode", 256, None, "untiled", 128),
    ("decode", 384, 16, "exact", 128),
    ("decode", 768, 24, "exact", 128),
    ("decode", 768, 48, "fast", 128),
    ("decode", 1024, 32, "exact", 64),
    ("encode", 384, 16, "exact", 128),
    ("encode", 768, 48, "exact", 128),
    ("encode", 512, 32, "fast", 128),
    ("encode", 512, None, "untiled", 128),
)


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print JSON records instead of the table")


def _models(ch: int):
    import torch

    from .planner import _ldm_config

    with contextlib.redirect_stdout(io.StringIO()):
        from ldm.modules.diffusionmodules.model import Decoder, Encoder

        with torch.device("meta"):
            return Decoder(**_ldm_config(ch)).eval(), Encoder(**_ldm_config(ch)).eval()


def _records() -> list[dict]:
    import torch

    from lib_vram.cli.stageplan import predict_engine_vae
    from lib_vram.vae import decoder_spec, encoder_spec
    from lib_vram.vae._plan import combine, estimate_components, fast_sample_for

    models = {ch: _models(ch) for ch in sorted({c[4] for c in CASES})}
    out = []
    for kind, px, tile, mode, ch in CASES:
        dec, enc = models[ch]
        module, spec = (dec, decoder_spec(dec)) if kind == "decode" else (enc, encoder_spec(enc))
        shape = (1, 4, px // 8, px // 8) if kind == "decode" else (1, 3, px, px)
        rec = {"kind": kind, "px": px, "tile": tile, "mode": mode, "ch": ch}
        for backend in ("cpu", "cuda"):
            t0 = time.perf_counter()
            pm = "exact" if mode == "untiled" else mode
            p = predict_engine_vae(module, kind, shape, torch.float32, tile=tile, mode=pm, backend=backend)
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
            rec[f"components_{backend}"] = comps
        out.append(rec)
    return out


def run(args: argparse.Namespace) -> int:
    records = _records()
    rows = [{k: v for k, v in r.items() if not k.startswith("components")} for r in records]
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    mib = 2**20
    print(
        "| case | estimate, tensors | prediction, tensors | error | estimate, CPU | "
        "prediction, CPU | error | estimate ms | prediction s |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        tile = "untiled" if r["tile"] is None else f"{r['mode']} t{r['tile']}"
        name = f"{r['kind']} {r['px']}² {tile}" + ("" if r["ch"] == 128 else f" ch{r['ch']}")
        cells = [name]
        for be in ("cuda", "cpu"):
            est, pred = r[f"estimate_{be}"], r[f"predicted_{be}"]
            cells += [f"{est / mib:.1f}", f"{pred / mib:.1f}", f"{100 * (est / pred - 1):+.1f} %"]
        cells += [f"{r['estimate_ms']:.1f}", f"{r['predict_seconds']:.1f}"]
        print("| " + " | ".join(cells) + " |")
    return 0
