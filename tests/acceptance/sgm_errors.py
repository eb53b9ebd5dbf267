"""Print the numbers behind ``tests/test_vae_sgm.py``: the engine's errors against the untiled sgm
modules, the precision guard, and the two ways the tests cause out-of-memory errors.

    VRAM_GUARD_SGM_PATH=/path/to/generative-models python tests/acceptance/sgm_errors.py

Same modules, inputs and settings as the tests (it uses their helpers); one line per case.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parents[2]))
sys.path.insert(0, str(HERE.parents[1]))

import torch  # noqa: E402
from vae_models import smooth_latent  # noqa: E402

from lib_vram.core.emulate import EmulatedCard  # noqa: E402
from lib_vram.vae import TiledVAEConfig, VAEReport, tiled_decode, tiled_encode  # noqa: E402


def err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


def main() -> int:
    if not os.environ.get("VRAM_GUARD_SGM_PATH"):
        print("set VRAM_GUARD_SGM_PATH to a Stability-AI/generative-models checkout")
        return 2
    import test_vae_sgm as t

    m = t.import_sgm_model(Path(os.environ["VRAM_GUARD_SGM_PATH"]))
    try:
        for at in ("vanilla", "none"):
            d = t.sgm_decoder(m, attn_type=at)
            z = smooth_latent(2, 4, 13, 17)
            ref = t._ref(d, z)
            for tile in (4, 7):
                rep = VAEReport()
                out = tiled_decode(d, z, config=TiledVAEConfig(mode="exact", tile=tile), report=rep)
                print(f"decode {at} 2x4x13x17 t{tile}: {rep.tiles} tiles, max abs err {err(out, ref):.2e}")
        x = t._image(2, 44, 62, 4)
        for at in ("vanilla", "vanilla-xformers", "none"):
            e = t.sgm_encoder(m, attn_type=at, ch_mult=(1, 2, 2))
            twin = t.sgm_encoder(
                m, attn_type="none" if at == "none" else "vanilla", ch_mult=(1, 2, 2), seed=9
            )
            twin.load_state_dict(e.state_dict())
            ref = t._ref(twin, x)
            for tile in (4, 6):
                rep = VAEReport()
                out = tiled_encode(e, x, config=TiledVAEConfig(mode="exact", tile=tile), report=rep)
                print(f"encode {at} 2x3x44x62 t{tile}: {rep.tiles} tiles, max abs err {err(out, ref):.2e}")
        xd = t.sgm_decoder(m, attn_type="vanilla-xformers", seed=2)
        vd = t.sgm_decoder(m, seed=3)
        vd.load_state_dict(xd.state_dict())
        z = smooth_latent(1, 4, 12, 10, seed=2)
        ref = t._ref(vd, z)
        try:
            t._ref(xd, z)
            print("vanilla-xformers forward: ran (xformers installed)")
        except NameError as exc:
            print(f"vanilla-xformers forward without xformers: NameError: {exc}")
        out = tiled_decode(xd, z, config=TiledVAEConfig(mode="exact", tile=4))
        print(f"decode vanilla-xformers t4 vs its vanilla twin: max abs err {err(out, ref):.2e}")

        d = t.sgm_decoder(m, ch_mult=(1, 2, 2))
        z = smooth_latent(1, 4, 16, 12, seed=7)
        ref = t._ref(d, z)
        full = tiled_decode(d, z, config=TiledVAEConfig(mode="fast", tile=8, fast_sample=1))
        print(f"fast decode, fast_sample=1: max abs err {err(full, ref):.2e}")
        a = tiled_decode(d, z, config=TiledVAEConfig(mode="fast", tile=6, fast_sample=2))
        b = tiled_decode(d, z, config=TiledVAEConfig(mode="fast", tile=8, fast_sample=2))
        print(f"fast decode, fast_sample=2: t6 vs t8 {err(a, b):.2e}, vs untiled {err(a, ref):.2e}")

        d = t.sgm_decoder(m)
        t._blow_up(d.up[0].block[0].conv1)
        z = smooth_latent(1, 4, 10, 10, seed=8)
        ref = t._ref(d, z)
        rep = VAEReport()
        cfg = TiledVAEConfig(mode="exact", tile=5, dtype=torch.float16, guard_dtype=torch.float32)
        out = tiled_decode(d, z, config=cfg, report=rep)
        raw = tiled_decode(
            d, z, config=TiledVAEConfig(mode="exact", tile=5, dtype=torch.float16, guard=False)
        )
        print(
            f"fp16 with a 1e5-scaled conv: unguarded finite={bool(torch.isfinite(raw).all())}; guarded max abs "
            f"err {err(out, ref):.2e} vs fp32, {len(rep.recomputed)} of {rep.tiles} tiles recomputed"
        )

        d = t.sgm_decoder(m)
        z = smooth_latent(1, 4, 16, 16, seed=10)
        ref = t._ref(d, z)
        hook = t._OOMAbove(limit_px=20 * 20)
        handle = d.conv_out.register_forward_pre_hook(hook)
        rep = VAEReport()
        try:
            cfg = TiledVAEConfig(mode="auto", budget_bytes=2**40)
            out = tiled_decode(d, z, config=cfg, original_forward=d.forward, report=rep)
        finally:
            handle.remove()
        print(
            f"OOM by pre-hook on conv_out (> 20x20 px): raised {hook.raised}x, oom_retries {rep.oom_retries} "
            f"(0 = the sgm forward), ran {rep.plan}, max abs err {err(out, ref):.2e}"
        )

        d = t.sgm_decoder(m, ch_mult=(1, 2, 2))
        z = smooth_latent(1, 4, 16, 16, seed=11)
        ref = t._ref(d, z)

        def peak(fn) -> int:
            with EmulatedCard(2**40) as card, torch.no_grad():
                fn()
            return card.peak_bytes

        untiled = peak(lambda: d(z))
        tiled = peak(lambda: tiled_decode(d, z, config=TiledVAEConfig(mode="exact", tile=8)))
        cap = (tiled + untiled) // 2
        rep = VAEReport()
        with EmulatedCard(cap) as card:
            cfg = TiledVAEConfig(mode="auto", budget_bytes=2**40)
            out = tiled_decode(d, z, config=cfg, original_forward=d.forward, report=rep)
        print(
            f"emulated card: sgm forward peak {untiled} B, engine t8 peak {tiled} B, capacity {cap} B; "
            f"refused {card.ooms} allocation(s); oom_retries {rep.oom_retries}; ran {rep.plan}; "
            f"card peak {card.peak_bytes} B; max abs err {err(out, ref):.2e}"
        )
    finally:
        t.forget_sgm()
    return 0


if __name__ == "__main__":
    sys.exit(main())
