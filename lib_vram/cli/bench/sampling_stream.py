"""``python -m lib_vram bench sampling-stream``: the streamed UNet's cases (CLI module: it may print).

* **run** rows, on an emulated card (CPU): a real ldm ``UNetModel`` at reduced width (SD1.5-shaped;
  the full run adds an SDXL-shaped one at transformer depth 1) on cards that hold about 1/3, 1/2
  and 2/3 of it beside the step's activations. Plain: the whole UNet resident; guarded:
  :func:`plan_stream` + :class:`StreamedUNet`, re-planned after an out-of-memory error. Bytes moved
  are the streamer's count; ``--lowvram``'s are its behaviour modelled on the same units.
* **plan** rows for the full-size UNets (SD1.5, SDXL): the same planner on the real unit sizes;
  nothing runs, and the copy time per step is a model at ``--bandwidth``, not a measurement.

Method and columns: docs/benchmarks.md, "Streamed UNet". :func:`cases` and :func:`run_one` are
what ``bench sampling`` runs for its streamed rows; :func:`gpu_stream` is ``bench gpu``'s part.
"""

from __future__ import annotations

import argparse
import contextlib
import time

import torch

from lib_vram.core.emulate import EmulatedCard
from lib_vram.planning import planner
from lib_vram.sampling import (
    UNIT_PARTS,
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
from ._harness import Bench, attempt, mib, runner
from ._unet import _omegaconf_for_ldm

HELP = "Streamed UNet (budgeted residency): bytes per step vs --lowvram, plain vs guarded (emulated card)."
MiB = 1 << 20
GB = 1e9
DEFAULT_BANDWIDTH_GB_S = 12.0


def _config(shape: str, mc: int, context_dim: int) -> dict:
    common = dict(image_size=32, in_channels=4, out_channels=4, model_channels=mc, num_res_blocks=2,
                  use_spatial_transformer=True, context_dim=context_dim, legacy=False)  # fmt: skip
    if shape == "sd15":
        return dict(common, attention_resolutions=[1, 2, 4], channel_mult=(1, 2, 4, 4), num_heads=8)
    if shape == "sdxl":
        return dict(common, attention_resolutions=[2, 4], channel_mult=(1, 2, 4),
                    num_head_channels=min(64, mc), use_linear_in_transformer=True)  # fmt: skip
    raise ValueError(f"`shape` must be sd15 or sdxl, got {shape!r}")


def build_unet(shape: str, mc: int, *, context_dim: int = 64, seed: int = 0, meta: bool = False):
    """A real ldm ``UNetModel`` of ``shape`` at ``mc`` model channels (random weights, eval)."""
    from ldm.modules.diffusionmodules.openaimodel import UNetModel

    torch.manual_seed(seed)
    with _omegaconf_for_ldm(), torch.device("meta") if meta else contextlib.nullcontext():
        unet = UNetModel(**_config(shape, mc, context_dim)).eval()
    if not meta:
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in unet.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    return unet


def full_size_units(arch: str, itemsize: int = 2) -> list[tuple[str, int]]:
    """The unit sizes of the full-size SD1.5 or SDXL UNet at ``itemsize`` bytes per weight."""
    if arch == "sd15":
        unet = build_unet("sd15", 320, context_dim=768, meta=True)
        return [(n, b // 4 * itemsize) for n, b in unit_bytes(unet)]
    if arch != "sdxl":
        raise ValueError(f"`arch` must be sd15 or sdxl, got {arch!r}")
    # ldm's transformer_depth is one number: build at depth 1 (levels 2-3, the middle block), then
    # add SDXL's deeper stacks (2 at level 2, 10 at level 3 and in the middle) from one real block
    from ldm.modules.diffusionmodules.openaimodel import UNetModel

    cfg = dict(_config("sdxl", 320, 2048), transformer_depth=1)
    with _omegaconf_for_ldm(), torch.device("meta"):
        unet = UNetModel(**cfg)
    depths = {}
    for name, m in unet.named_modules():
        blocks = getattr(m, "transformer_blocks", None)
        if blocks is not None:
            width = blocks[0].attn1.to_q.in_features
            per = sum(p.numel() * 4 for p in blocks[0].parameters())
            depths[name] = (2 if width == 640 else 10, per)
    # split the shallow model at 1/64 of *its* size (a little finer than the full-size UNet's
    # 1/64: each transformer block splits, which the full model's split does too)
    out: list[tuple[str, int]] = []
    for name, b in unit_bytes(unet, UNIT_PARTS):
        st = next((t for t in depths if name == t or name.startswith(t + ".")), None)
        if st is None:
            out.append((name, b))
            continue
        d, per = depths[st]
        head = f"{st}.transformer_blocks.0"
        if name == st:  # the whole transformer is one unit
            out.append((name, b + (d - 1) * per))
        elif name == head or name.startswith(head + "."):
            out.append((name, b))
            out.extend((name.replace(head, f"{st}.transformer_blocks.{k}", 1) + "*", b) for k in range(1, d))
        else:
            out.append((name, b))
    out = [(n, b // 4 * itemsize) for n, b in out]
    label = (2816 * 1280 + 1280 + 1280 * 1280 + 1280) * itemsize
    out.insert(1, ("label_emb", label))
    return out


# -- the run on an emulated card -------------------------------------------------------------------


def _forward(unet, kw) -> torch.Tensor:
    with torch.no_grad():
        return unet(**kw)


def _activations(unet, kw) -> int:
    card = EmulatedCard(1 << 40, resident=[unet])
    with card:
        _forward(unet, kw)
    return card.peak_bytes - card.resident_bytes


def run_case(shape: str, mc: int, side: int, fraction: float, *, steps: int = 2, attempts: int = 4) -> dict:
    """One emulated-card case: a card that holds about ``fraction`` of the UNet beside one
    micro-batch's activations, and at least the whole UNet beside the step's output (it was
    resident before the pass: the move back needs that room). Each step is the WebUI's batched
    cond/uncond forward (batch 2), micro-batched as the sampling plan says."""
    unet = build_unet(shape, mc)
    g = torch.Generator().manual_seed(1)
    kw = {"x": torch.randn(2, 4, side, side, generator=g), "timesteps": torch.tensor([10, 700]),
          "context": torch.randn(2, 77, 64, generator=g)}  # fmt: skip
    units = unit_bytes(unet)
    total = sum(b for _, b in units)
    act1 = _activations(unet, {k: v[:1] for k, v in kw.items()})
    out_bytes = kw["x"].numel() * kw["x"].element_size()
    capacity = max(int(act1 + fraction * total + 2 * max(b for _, b in units)), total + 4 * out_bytes)
    spec = unet_spec(unet)
    step = dict(batch=2, latent_hw=(side, side), context_tokens=77, attention="none", dtype=torch.float32)
    mem = planner.PlanMemory()
    sp = plan_sampling(spec, budget_bytes=capacity, backend="cpu", memory=mem, **step)

    def forward(**k):
        return unet(**k)

    fwd = micro_batched(forward, sp.micro_batch, memory=planner.PlanMemory())
    t0 = time.process_time()
    ref = _forward(fwd, kw)
    plain_cpu = time.process_time() - t0
    plain = micro_batched(forward, sp.micro_batch, memory=planner.PlanMemory())
    plain_ok = attempt(lambda: _forward(plain, kw), EmulatedCard(capacity, resident=[unet])).ok
    guarded_ok, identical, tries, plan, s, cpu, peak = False, False, 0, None, None, 0.0, 0
    refs = {sp.micro_batch: (ref, plain_cpu)}
    while tries < attempts:
        tries += 1
        plan = plan_stream(unet, spec, budget_bytes=capacity, backend="cpu", memory=mem, **step)
        m = plan.micro_batch  # the micro-batch that moves the fewest bytes per step
        if m not in refs:
            t0 = time.process_time()
            out = _forward(micro_batched(forward, m, memory=planner.PlanMemory()), kw)
            refs[m] = (out, time.process_time() - t0)
        ref, plain_cpu = refs[m]
        fwd = micro_batched(forward, m, memory=planner.PlanMemory())
        card = EmulatedCard(capacity, resident=[unet])
        try:
            t0 = time.process_time()
            with card, StreamedUNet(unet, plan, "cpu", memory=mem) as s:
                outs = [_forward(fwd, kw) for _ in range(steps)]
            cpu = (time.process_time() - t0) / steps
        except torch.OutOfMemoryError:
            continue
        guarded_ok = True
        # against the unstreamed forward at the same micro-batch: only placement differs
        identical = all(torch.equal(o.view(torch.int32), ref.view(torch.int32)) for o in outs)
        peak = card.peak_bytes
        break
    assert plan is not None
    first = next((b for n, b in units if plan.streamed and n == plan.streamed[0]), 0)
    moved = (s.stats.bytes_in - first) // steps if guarded_ok and s is not None else None
    return {
        "stage": "sampling_stream", "shape": f"{shape} mc{mc}", "latent": side, "card_bytes": capacity,
        "card_holds": round(plan.resident_bytes / total, 3), "plain_ok": plain_ok, "guarded_ok": guarded_ok,
        "identical": identical, "attempts": tries, "plan": plan.label, "micro_batch": plan.micro_batch,
        "unet_bytes": total, "resident_bytes": plan.resident_bytes, "buffer_bytes": plan.buffer_bytes,
        "bytes_moved_per_step": moved, "planned_bytes_per_step": plan.bytes_moved_per_step,
        "lowvram_bytes_per_step": lowvram_bytes_per_forward(units),  # one forward a step (batch_cond_uncond)
        "peak_bytes": peak, "predicted_bytes": plan.predicted_peak_bytes + sp.input_bytes,
        "cpu_ratio": round(cpu / plain_cpu, 2) if plain_cpu > 0 and guarded_ok else None,
    }  # fmt: skip


def plan_case(arch: str, card_gib: float, px: int, bandwidth_gb_s: float, dtype=torch.float16) -> dict:
    """A full-size plan (nothing runs): batch 2 (cond/uncond), SDP attention."""
    units = full_size_units(arch, torch.empty(0, dtype=dtype).element_size())
    spec = reference_spec(arch)
    capacity = int(card_gib * (1 << 30))
    budget = capacity - 300 * MiB  # the WebUI's context and the VAE/text encoders moved off
    lat = (px // 8, px // 8)
    step = dict(batch=2, latent_hw=lat, context_tokens=77, attention="sdp", dtype=dtype)
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
    runs = [("sd15", 32, 32)] if quick else [("sd15", 32, 32), ("sd15", 64, 32), ("sdxl", 64, 32)]
    plans = [("sd15", 3.0, 512, "float32"), ("sdxl", 4.0, 1024, "float16")]
    if not quick:
        plans += [
            ("sd15", 4.0, 1536, "float32"),
            ("sdxl", 6.0, 1024, "float16"),
            ("sdxl", 4.0, 768, "float16"),
        ]
    runs = [("run", s, mc, side, f) for s, mc, side in runs for f in (1 / 3, 1 / 2, 2 / 3)]
    return runs + [("plan", *p) for p in plans]


def run_one(case: tuple, bandwidth_gb_s: float = DEFAULT_BANDWIDTH_GB_S) -> dict:
    """One of :func:`cases`, on one thread (a shared small machine: more threads only thrash; same
    results)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        if case[0] == "run":
            return run_case(*case[1:])
        arch, gib, px, dtype = case[1:]
        return plan_case(arch, gib, px, bandwidth_gb_s, getattr(torch, dtype))
    finally:
        torch.set_num_threads(n)


def stream_cases(quick: bool = False, bandwidth_gb_s: float = DEFAULT_BANDWIDTH_GB_S) -> list[dict]:
    """Every streamed record, in this process."""
    return [run_one(case, bandwidth_gb_s) for case in cases(quick)]


def label(case: tuple) -> str:
    if case[0] == "run":
        return f"{case[1]} mc{case[2]} {case[3]} lat, card holds {case[4]:.2f} of the UNet"
    return f"{case[1]} {case[4]} {case[3]} px on {case[2]:g} GiB (plan)"


def table(rows: list[dict]) -> str:
    head = (
        "| case | card MiB | plain | guarded | bit-identical | micro-batch | UNet MiB | resident MiB | "
        "MiB/step | --lowvram MiB/step | ratio | note |"
    )
    lines = [head, "|" + "---|" * 12]
    for r in rows:
        moved, low = r["bytes_moved_per_step"], r["lowvram_bytes_per_step"]
        ratio = "-" if moved is None or not low else f"{moved / low:.2f}"
        case = f"{r['shape']} {r.get('latent', r.get('px'))}" + ("" if "latent" not in r else " lat")
        if "card_holds" in r:
            note = f"{r['attempts']} attempt(s); CPU x{r['cpu_ratio']}"
        else:
            note = (
                f"copies {r['modelled_copy_s_per_step']} s vs {r['lowvram_modelled_copy_s_per_step']} s "
                f"per step at {r['bandwidth_gb_s']:g} GB/s (model)"
            )
        lines.append(
            f"| {case} | {r['card_bytes'] / MiB:.0f} | {'ok' if r['plain_ok'] else 'OOM'} | "
            f"{'ok' if r['guarded_ok'] else 'OOM'} | {r.get('identical', '-')} | "
            f"{r.get('micro_batch', '-')} of 2 | {mib(r['unet_bytes'])} | "
            f"{mib(r['resident_bytes'])} | {mib(moved)} | {mib(low)} | {ratio} | {note} |"
        )
    return "\n".join(lines)


# -- on a real GPU (``bench gpu``'s ``stream_unet`` part) ----------------------------------------


def _lowvram_hooks(unet, device) -> list:  # noqa: ANN001
    """``--lowvram``'s way, written for this measurement: every unit it swaps (the top-level
    ``time_embed``, input blocks, middle block and output blocks) lives on the CPU and moves to the
    device before its forward; the one there before moves back to the CPU (``module.to``, a full
    copy each way, changed or not). The rest of the UNet stays on the device."""
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


def gpu_stream(  # noqa: ANN001
    device, clock=None, skipped: list[str] | None = None, *, steps: int = 5, side: int = 64
) -> list[dict]:
    """The streamed UNet on a real GPU: the full-size SD1.5-shaped ldm UNet (random weights, FP16),
    one sampling step of a cond/uncond batch of 2 at ``side`` x ``side`` latent, ``steps`` timed
    steps after a warm-up, each case: the untouched UNet (all resident), streamed with 2/3 of it
    resident with prefetch on the side stream and without (the difference is the overlap), the
    streamed bytes copied alone (no compute), and ``--lowvram``'s way (:func:`_lowvram_hooks`).
    Records: seconds per step, bytes moved per step, ``max_memory_allocated``, bit-identity with
    the untouched output (the same kernels on copies of the same bits). Needs CUDA: without it,
    one line in ``skipped`` and no records."""
    skipped = [] if skipped is None else skipped
    if getattr(device, "type", str(device)) != "cuda" or not torch.cuda.is_available():
        skipped.append("stream_unet: needs CUDA (side-stream copy/compute overlap from pinned memory)")
        return []
    if not 1 <= steps <= 100 or not 8 <= side <= 256:
        raise ValueError(f"`steps` must be in 1..100 and `side` in 8..256, got {steps}, {side}")
    dtype = torch.float16
    unet = build_unet("sd15", 320, context_dim=768).to(dtype)
    g = torch.Generator().manual_seed(1)
    kw = {"x": torch.randn(2, 4, side, side, generator=g).to(device, dtype),
          "timesteps": torch.tensor([10, 700], device=device),
          "context": torch.randn(2, 77, 768, generator=g).to(device, dtype)}  # fmt: skip
    units = unit_bytes(unet)
    total = sum(b for _, b in units)
    plan = choose_resident(
        units, weights_budget_bytes=int(total * 2 / 3), activation_bytes=0, micro_batch=2, forwards_per_step=1
    )
    unet.to(device)

    def timed():  # noqa: ANN202
        with torch.no_grad():
            unet(**kw)  # warm-up (and the streamer's order-learning forward)
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            t0 = time.perf_counter()
            for _ in range(steps):
                out = unet(**kw)
            torch.cuda.synchronize(device)
        return (time.perf_counter() - t0) / steps, out, int(torch.cuda.max_memory_allocated(device))

    rows = []
    t_plain, ref, peak = timed()
    base = {"unet_bytes": total, "steps": steps, "latent": side}
    rows.append({**base, "case": "untouched", "seconds_per_step": round(t_plain, 4), "resident_bytes": total,
                 "bytes_moved_per_step": 0, "max_memory_allocated": peak, "identical": True})  # fmt: skip
    secs = {}
    for prefetch in (True, False):
        if clock is not None and clock.left() < 30:
            skipped.append(f"stream_unet prefetch {prefetch}: out of time")
            continue
        with StreamedUNet(unet, plan, device, prefetch=prefetch) as s:
            t, out, peak = timed()
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
    dev.copy_(pinned, non_blocking=True)
    torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        dev.copy_(pinned, non_blocking=True)
    torch.cuda.synchronize(device)
    copy_s = (time.perf_counter() - t0) / steps
    del pinned, dev
    rec = {**base, "case": "streamed bytes copied alone", "seconds_per_step": round(copy_s, 4),
           "bytes_moved_per_step": plan.streamed_bytes,
           "bandwidth_gb_s": round(plan.streamed_bytes / copy_s / GB, 2) if copy_s > 0 else None}  # fmt: skip
    if True in secs and False in secs and copy_s > 0:
        # the share of the copy time prefetch hid behind compute (1: all of it)
        rec["overlap"] = round(max(0.0, min(1.0, (secs[False] - secs[True]) / copy_s)), 3)
    rows.append(rec)
    if clock is None or clock.left() >= 30:
        hooks = _lowvram_hooks(unet, device)
        try:
            t, out, peak = timed()
        finally:
            for h in hooks:
                h.remove()
            unet.to(device)
        rows.append({**base, "case": "--lowvram's way", "seconds_per_step": round(t, 4),
                     "bytes_moved_per_step": lowvram_bytes_per_forward(unit_bytes(unet, 1)),
                     "max_memory_allocated": peak, "identical": bool(torch.equal(out, ref))})  # fmt: skip
    else:
        skipped.append("stream_unet --lowvram: out of time")
    unet.to("cpu")  # the next parts get the card back
    torch.cuda.empty_cache()
    return rows


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="one reduced UNet, two plans (a few minutes)")
    parser.add_argument("--json", action="store_true", help="print one JSON record per case")
    parser.add_argument(
        "--bandwidth",
        type=float,
        default=DEFAULT_BANDWIDTH_GB_S,
        help="host<->device GB/s for the modelled copy time (default 12: PCIe 3.0 x16, pinned)",
    )


def bench(args: argparse.Namespace) -> Bench:
    if not 0.1 <= args.bandwidth <= 1000:
        raise UsageError(f"`--bandwidth` must be in 0.1..1000 GB/s, got {args.bandwidth}")
    return Bench(cases(args.quick), lambda c: run_one(c, args.bandwidth), table, label=label)


run = runner(bench)
