"""``python -m lib_vram bench sampling-stream``: the streamed UNet, plain vs guarded: **run** rows on
emulated cards (:func:`run_case`), **plan** rows of the full-size UNets (:func:`plan_case`, nothing
runs). Method and columns: docs/benchmarks.md, "Streamed UNet". :func:`gpu_stream`: ``bench gpu``'s.
"""

from __future__ import annotations

import argparse
import functools

import torch

from lib_vram.core.emulate import EmulatedCard
from lib_vram.planning import planner
from lib_vram.sampling import (
    StreamedUNet,
    choose_resident,
    lowvram_bytes_per_forward,
    micro_batched,
    plan_sampling,
    plan_stream,
    reference_spec,
    unet_spec,
    unit_bytes,
)

from ..common import UsageError
from ..models.unet import build_unet
from ..refunet import reference_units
from ._harness import Bench, attempt, mib_of, ok, runner, timed
from ._harness import table as grid

HELP = "Streamed UNet (budgeted residency): bytes per step vs --lowvram, plain vs guarded (emulated card)."
MiB = 1 << 20
GB = 1e9
DEFAULT_BANDWIDTH_GB_S = 12.0


# -- the run on an emulated card -------------------------------------------------------------------


def _inputs(side: int, ctx: int) -> dict:
    """The WebUI's batched cond/uncond forward (batch 2) at ``side`` x ``side`` latent."""
    g = torch.Generator().manual_seed(1)
    return {"x": torch.randn(2, 4, side, side, generator=g), "timesteps": torch.tensor([10, 700]),
            "context": torch.randn(2, 77, ctx, generator=g)}  # fmt: skip


@torch.no_grad()
def run_case(shape: str, mc: int, side: int, fraction: float, *, steps: int = 2, attempts: int = 4) -> dict:
    """One emulated-card case: a card that holds about ``fraction`` of the UNet beside one
    micro-batch's activations, and at least the whole UNet beside the step's output (the move back
    needs that room); each step the batched cond/uncond forward, micro-batched as planned."""
    unet = build_unet("sdxl-d1" if shape == "sdxl" else shape, mc, context_dim=64, init=True)
    kw = _inputs(side, 64)
    units = unit_bytes(unet)
    total = sum(b for _, b in units)
    with EmulatedCard(1 << 40, resident=[unet]) as probe:  # one micro-batch's activations
        unet(**{k: v[:1] for k, v in kw.items()})
    act1 = probe.peak_bytes - probe.resident_bytes
    out_bytes = kw["x"].numel() * kw["x"].element_size()
    capacity = max(int(act1 + fraction * total + 2 * max(b for _, b in units)), total + 4 * out_bytes)
    spec = unet_spec(unet)
    step = dict(batch=2, latent_hw=(side, side), context_tokens=77, attention="none", dtype=torch.float32)
    mem = planner.PlanMemory()
    sp = plan_sampling(spec, budget_bytes=capacity, backend="cpu", memory=mem, **step)

    def micro(m: int):  # noqa: ANN202
        return micro_batched(lambda **k: unet(**k), m, memory=planner.PlanMemory())

    @functools.cache
    def unstreamed(m: int) -> tuple[torch.Tensor, float, float]:
        """The output, wall and CPU seconds of the unstreamed forward at micro-batch ``m``."""
        return timed(lambda: micro(m)(**kw))

    def streamed(s: StreamedUNet, fwd) -> list[torch.Tensor]:  # noqa: ANN001
        with s:
            return [fwd(**kw) for _ in range(steps)]

    unstreamed(sp.micro_batch)
    plain = attempt(lambda: micro(sp.micro_batch)(**kw), EmulatedCard(capacity, resident=[unet]))
    for tries in range(1, attempts + 1):  # noqa: B007 (re-planned after an out-of-memory error)
        plan = plan_stream(unet, spec, budget_bytes=capacity, backend="cpu", memory=mem, **step)
        ref, _, plain_cpu = unstreamed(plan.micro_batch)  # the micro-batch that moves the fewest bytes
        s, card = StreamedUNet(unet, plan, "cpu", memory=mem), EmulatedCard(capacity, resident=[unet])
        got = attempt(functools.partial(streamed, s, micro(plan.micro_batch)), card)
        if got.ok:
            break
    # against the unstreamed forward at the same micro-batch: only placement differs
    identical = got.ok and all(torch.equal(o.view(torch.int32), ref.view(torch.int32)) for o in got.out)
    first = next((b for n, b in units if plan.streamed and n == plan.streamed[0]), 0)
    moved, peak = ((s.stats.bytes_in - first) // steps, card.peak_bytes) if got.ok else (None, 0)
    return {
        "stage": "sampling_stream", "shape": f"{shape} mc{mc}", "latent": side, "card_bytes": capacity,
        "card_holds": round(plan.resident_bytes / total, 3), "plain_ok": plain.ok, "guarded_ok": got.ok,
        "identical": identical, "attempts": tries, "plan": plan.label, "micro_batch": plan.micro_batch,
        "unet_bytes": total, "resident_bytes": plan.resident_bytes, "buffer_bytes": plan.buffer_bytes,
        "bytes_moved_per_step": moved, "planned_bytes_per_step": plan.bytes_moved_per_step,
        "lowvram_bytes_per_step": lowvram_bytes_per_forward(units),  # one forward a step (batch_cond_uncond)
        "peak_bytes": peak, "predicted_bytes": plan.predicted_peak_bytes + sp.input_bytes,
        "cpu_ratio": round(got.cpu_seconds / steps / plain_cpu, 2) if plain_cpu > 0 and got.ok else None,
    }  # fmt: skip


def plan_case(arch: str, card_gib: float, px: int, bandwidth_gb_s: float, dtype=torch.float16) -> dict:
    """A full-size plan (nothing runs): batch 2 (cond/uncond), SDP attention."""
    units = reference_units(arch, dtype.itemsize)  # what `plan` and the placement use
    spec = reference_spec(arch)
    capacity = int(card_gib * (1 << 30))
    budget = capacity - 300 * MiB  # the WebUI's context and the VAE/text encoders moved off
    step = dict(batch=2, latent_hw=(px // 8, px // 8), context_tokens=77, attention="sdp", dtype=dtype)
    mem = planner.PlanMemory()
    sp = plan_sampling(spec, budget_bytes=budget, memory=mem, **step)
    plan = plan_stream(units, spec, budget_bytes=budget, sampling=sp, memory=mem, **step)
    bw, streamed = bandwidth_gb_s * GB, not sp.fits
    moved = plan.bytes_moved_per_step if streamed else 0
    return {
        "stage": "sampling_stream_plan", "shape": f"{arch} {str(dtype).replace('torch.', '')}", "px": px,
        "card_bytes": capacity, "plain_ok": sp.fits, "guarded_ok": plan.fits,
        "plan": plan.label if streamed else "whole UNet resident",
        "micro_batch": plan.micro_batch if streamed else sp.micro_batch, "unet_bytes": plan.unet_bytes,
        "resident_bytes": plan.resident_bytes if streamed else plan.unet_bytes, "bytes_moved_per_step": moved,
        "lowvram_bytes_per_step": plan.lowvram_bytes_per_step, "bandwidth_gb_s": bandwidth_gb_s,
        "modelled_copy_s_per_step": round(moved / bw, 3),
        "lowvram_modelled_copy_s_per_step": round(plan.lowvram_bytes_per_step / bw, 3),
    }  # fmt: skip


def cases(quick: bool = False) -> list[tuple]:
    """The streamed cases (what ``bench sampling`` adds): runs on the emulated card, then plans."""
    runs = [("sd15", 32, 32)] + ([] if quick else [("sd15", 64, 32), ("sdxl", 64, 32)])
    plans = [("sd15", 3.0, 512, "float32"), ("sdxl", 4.0, 1024, "float16")]
    if not quick:
        plans += [("sd15", 4.0, 1536, "float32"), ("sdxl", 6.0, 1024, "float16"),
                  ("sdxl", 4.0, 768, "float16")]  # fmt: skip
    runs = [("run", s, mc, side, f) for s, mc, side in runs for f in (1 / 3, 1 / 2, 2 / 3)]
    return runs + [("plan", *p) for p in plans]


def run_one(case: tuple, bandwidth_gb_s: float = DEFAULT_BANDWIDTH_GB_S) -> dict:
    """One of :func:`cases`, on one thread (on a shared small machine more only thrash)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        if case[0] == "run":
            return run_case(*case[1:])
        return plan_case(*case[1:4], bandwidth_gb_s, getattr(torch, case[4]))
    finally:
        torch.set_num_threads(n)


def label(case: tuple) -> str:
    if case[0] == "run":
        return f"{case[1]} mc{case[2]} {case[3]} lat, card holds {case[4]:.2f} of the UNet"
    return f"{case[1]} {case[4]} {case[3]} px on {case[2]:g} GiB (plan)"


def _note(r: dict) -> str:
    if "card_holds" in r:
        return f"{r['attempts']} attempt(s); CPU x{r['cpu_ratio']}"
    return (f"copies {r['modelled_copy_s_per_step']} s vs {r['lowvram_modelled_copy_s_per_step']} s per step "
            f"at {r['bandwidth_gb_s']:g} GB/s (model)")  # fmt: skip


def table(rows: list[dict]) -> str:
    def ratio(r: dict) -> str:
        moved, low = r["bytes_moved_per_step"], r["lowvram_bytes_per_step"]
        return "-" if moved is None or not low else f"{moved / low:.2f}"

    return grid([
        ("case", lambda r: f"{r['shape']} {r['latent']} lat" if "latent" in r else f"{r['shape']} {r['px']}"),
        ("card MiB", mib_of("card_bytes", 0)), ("plain", ok("plain_ok", "ok")),
        ("guarded", ok("guarded_ok", "ok")), ("bit-identical", lambda r: r.get("identical", "-")),
        ("micro-batch", lambda r: f"{r.get('micro_batch', '-')} of 2"), ("UNet MiB", mib_of("unet_bytes")),
        ("resident MiB", mib_of("resident_bytes")), ("MiB/step", mib_of("bytes_moved_per_step")),
        ("--lowvram MiB/step", mib_of("lowvram_bytes_per_step")), ("ratio", ratio), ("note", _note),
    ], rows)  # fmt: skip


# -- on a real GPU (``bench gpu``'s ``stream_unet`` part) ----------------------------------------


def _lowvram_hooks(unet, device) -> list:  # noqa: ANN001
    """``--lowvram``'s way: each unit it swaps lives on the CPU and moves to the device before its
    forward, the one there before back to the CPU (a full copy each way); the rest stays."""
    swapped = [unet.time_embed, *unet.input_blocks, unet.middle_block, *unet.output_blocks]
    for m in swapped:
        m.to("cpu")
    state = {"here": None}

    def pre(module, args):  # noqa: ANN001, ANN202
        if state["here"] is not None and state["here"] is not module:
            state["here"].to("cpu")
        module.to(device)
        state["here"] = module

    return [m.register_forward_pre_hook(pre) for m in swapped]


def gpu_stream(device, clock=None, skipped: list[str] | None = None) -> list[dict]:  # noqa: ANN001
    """The full-size SD1.5-shaped UNet (FP16) on a real GPU, 5 timed cond/uncond steps at 64x64
    latent: untouched, streamed with 2/3 resident with and without prefetch, the streamed
    bytes copied alone, and ``--lowvram``'s way. Without CUDA: one line in ``skipped``."""
    skipped = [] if skipped is None else skipped
    if getattr(device, "type", str(device)) != "cuda" or not torch.cuda.is_available():
        skipped.append("stream_unet: needs CUDA (side-stream copy/compute overlap from pinned memory)")
        return []
    dtype, steps, side = torch.float16, 5, 64
    unet = build_unet("sd15", 320, context_dim=768, init=True).to(dtype)
    unet.dtype = dtype  # ldm casts the input to it; the WebUI sets it for a half UNet
    kw = {k: v.to(device, dtype if v.is_floating_point() else None) for k, v in _inputs(side, 768).items()}
    units = unit_bytes(unet)
    total = sum(b for _, b in units)
    plan = choose_resident(units, weights_budget_bytes=int(total * 2 / 3), activation_bytes=0, micro_batch=2,
                           forwards_per_step=1)  # fmt: skip
    unet.to(device)

    def forward() -> torch.Tensor:  # under autocast, as the WebUI runs a half UNet: its time
        with torch.autocast("cuda", dtype=dtype):  # embedding is float32, its norms run in float32
            return unet(**kw)

    def per_step(fn=forward):  # noqa: ANN001, ANN202
        """Seconds per call of ``fn`` over ``steps`` calls after one to warm up (the streamer learns
        its order in it), the last output and the peak allocated."""

        def run():  # noqa: ANN202 (each output is dropped when the next returns, as a sampler's)
            for _ in range(steps):
                out = fn()
            return out

        with torch.no_grad():
            fn()
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            out, seconds, _ = timed(run, device)
        return seconds / steps, out, int(torch.cuda.max_memory_allocated(device))

    rows = []
    t_plain, ref, peak = per_step()
    base = {"unet_bytes": total, "steps": steps, "latent": side}
    rows.append({**base, "case": "untouched", "seconds_per_step": round(t_plain, 4), "resident_bytes": total,
                 "bytes_moved_per_step": 0, "max_memory_allocated": peak, "identical": True})  # fmt: skip
    secs = {}
    for prefetch in (True, False):
        if clock is not None and clock.late(skipped, f"stream_unet prefetch {prefetch}", 30):
            continue
        with StreamedUNet(unet, plan, device, prefetch=prefetch) as s:
            t, out, peak = per_step()
        st = s.stats
        secs[prefetch] = t
        rows.append({**base, "case": f"streamed, prefetch {'on' if prefetch else 'off'}",
                     "seconds_per_step": round(t, 4), "resident_bytes": plan.resident_bytes,
                     "bytes_moved_per_step": st.bytes_in // max(1, st.forwards), "max_memory_allocated": peak,
                     "prefetched": st.prefetched, "on_demand": st.on_demand,
                     "identical": bool(torch.equal(out, ref))})  # fmt: skip
    # the streamed bytes' copies alone, pinned host -> device: what prefetch has to hide
    pinned = torch.empty(plan.streamed_bytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty_like(pinned, device=device)
    copy_s = per_step(functools.partial(dev.copy_, pinned, non_blocking=True))[0]
    del pinned, dev
    rec = {**base, "case": "streamed bytes copied alone", "seconds_per_step": round(copy_s, 4),
           "bytes_moved_per_step": plan.streamed_bytes,
           "bandwidth_gb_s": round(plan.streamed_bytes / copy_s / GB, 2) if copy_s > 0 else None}  # fmt: skip
    if True in secs and False in secs and copy_s > 0:
        # the share of the copy time prefetch hid behind compute (1: all of it)
        rec["overlap"] = round(max(0.0, min(1.0, (secs[False] - secs[True]) / copy_s)), 3)
    rows.append(rec)
    if clock is None or not clock.late(skipped, "stream_unet --lowvram", 30):
        hooks = _lowvram_hooks(unet, device)
        try:
            t, out, peak = per_step()
        finally:
            for h in hooks:
                h.remove()
            unet.to(device)
        rows.append({**base, "case": "--lowvram's way", "seconds_per_step": round(t, 4),
                     "bytes_moved_per_step": lowvram_bytes_per_forward(unit_bytes(unet, 1)),
                     "max_memory_allocated": peak, "identical": bool(torch.equal(out, ref))})  # fmt: skip
    unet.to("cpu")  # the next parts get the card back
    torch.cuda.empty_cache()
    return rows


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="one reduced UNet, two plans (a few minutes)")
    parser.add_argument("--bandwidth", type=float, default=DEFAULT_BANDWIDTH_GB_S, help="host<->device "
                        "GB/s for the modelled copy time (default 12: PCIe 3.0 x16, pinned)")  # fmt: skip


def bench(args: argparse.Namespace) -> Bench:
    if not 0.1 <= args.bandwidth <= 1000:
        raise UsageError(f"`--bandwidth` must be in 0.1..1000 GB/s, got {args.bandwidth}")
    return Bench(cases(args.quick), lambda c: run_one(c, args.bandwidth), table, label=label)


run = runner(bench)
