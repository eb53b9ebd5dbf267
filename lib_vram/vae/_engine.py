"""The tile engine: programs that walk a :class:`VAESpec`, and the drivers that run them.

What exact and fast mode compute, and why they match the untiled pass: docs/how-it-works.md,
"Tiled VAE". Here: the parts that need the whole image run once on the whole latent; a tile is a
generator ("program") that yields its core's per-channel statistics at every GroupNorm and gets the
combined whole-image statistics back, so tiles advance in lock-step (the waiting ones parked on the
device or in pinned CPU memory). A window is its core plus the remaining receptive field; each
3x3 conv's invalid ring at interior edges is cropped. Fast mode runs the same programs one by one
with statistics recorded once (:func:`._window.split_first_level` for the decoder).

All ops call the VAE's own submodules (``conv(x)``), so hooks, LoRA patches and weight-casting
wrappers of the host still apply; GroupNorm and SiLU are computed here.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from lib_vram.core import emulate

from ._attention import DEFAULT_SCORE_BYTES, attention, cpu_flash_available, query_chunk
from ._config import Interrupted, Recompute, VAEReport
from ._layout import Attention, Resnet, VAESpec
from ._window import TT, Box, crop, down_box, down_size, resample_needs, up_box

logger = logging.getLogger(__name__)


# -- statistics ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Request:
    """What a program yields at a GroupNorm: the module and its core's per-channel statistics."""

    gn: nn.GroupNorm
    count: int
    mean: torch.Tensor | None
    """(B, C) float64 (None when the run replays given statistics)."""
    var: torch.Tensor | None
    """(B, C) float64, biased."""


Affine = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
"""(mean, scale, bias), each (B, C, 1, 1) float64: ``y = (x - mean) * scale + bias``."""


_BN_STATS = getattr(torch.ops.aten, "batch_norm_update_stats", None)


def channel_stats(c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-(sample, channel) mean and biased variance of ``c`` ``(B, C, h, w)``, float64 ``(B, C)``.

    On the CPU in float32/float64 this is torch's batch-norm statistics kernel on a ``(1, B*C, h,
    w)`` view (two vectorised passes, mean then squared deviations; no copy, no output written):
    measured on a 128 x 512² crop of a larger map, 31 ms against 115 ms for ``torch.var_mean``,
    whose per-element Welford update made the statistics the tiled decode's largest cost after
    the convolutions. Elsewhere (CUDA, half precision) ``var_mean``, in float32 at least."""
    global _BN_STATS
    b, ch = c.shape[:2]
    if (
        _BN_STATS is not None
        and c.device.type == "cpu"
        and c.dtype in (torch.float32, torch.float64)
        and c.shape[-2] * c.shape[-1] > 0
    ):
        try:
            mean, var = _BN_STATS(c.reshape(1, b * ch, *c.shape[-2:]), None, None, 0.0)
        except NotImplementedError:  # a torch build without the CPU kernel: var_mean from now on
            logger.debug("batch_norm_update_stats has no CPU kernel here; using var_mean")
            _BN_STATS = None
        else:
            return mean.double().view(b, ch), var.double().view(b, ch)
    if c.dtype not in (torch.float32, torch.float64):
        c = c.float()
    var, mean = torch.var_mean(c, dim=(2, 3), correction=0)
    return mean.double(), var.double()


def core_stats(t: TT, box: Box) -> tuple[int, torch.Tensor, torch.Tensor]:
    c = crop(t, box).data
    mean, var = channel_stats(c)
    return c.shape[-2] * c.shape[-1], mean, var


def combine(gn: nn.GroupNorm, reqs: list[Request]) -> Affine:
    """Exact whole-image GroupNorm from per-tile core statistics (float64, parallel variance)."""
    total = sum(r.count for r in reqs)
    mean = sum(r.mean * (r.count / total) for r in reqs)
    var = sum((r.var + (r.mean - mean) ** 2) * (r.count / total) for r in reqs)
    assert isinstance(mean, torch.Tensor) and isinstance(var, torch.Tensor)
    b, c = mean.shape
    g = gn.num_groups
    m = mean.view(b, g, c // g)
    gm = m.mean(-1, keepdim=True)
    gv = (var.view(b, g, c // g) + (m - gm) ** 2).mean(-1, keepdim=True)
    rstd = torch.rsqrt(gv + gn.eps)
    gm = gm.expand(b, g, c // g).reshape(b, c)
    scale = rstd.expand(b, g, c // g).reshape(b, c)
    bias = torch.zeros_like(scale)
    if gn.affine and gn.weight is not None:
        scale = scale * gn.weight.detach().to(device=scale.device, dtype=torch.float64)
        bias = bias + gn.bias.detach().to(device=scale.device, dtype=torch.float64)
    return gm.view(b, c, 1, 1), scale.view(b, c, 1, 1), bias.view(b, c, 1, 1)


# -- the run context ---------------------------------------------------------------------------


class TileState:
    """One tile's live tensors (kept here, not in generator locals, so that parking moves them)."""

    __slots__ = ("index", "h", "res", "box", "step", "parked")

    def __init__(self, index: int, h: TT, box: Box) -> None:
        self.index = index
        self.h: TT | None = h
        self.res: TT | None = None
        self.box = box
        self.step = 0
        self.parked = 0


_RUNS: weakref.WeakSet[Run] = weakref.WeakSet()
_RUNS_LOCK = threading.Lock()


def parked_bytes() -> int:
    """Bytes of tile state parked off the compute device right now, over all running passes.

    With ``state_offload="cpu"`` on a CPU device nothing moves (it is the same memory), but the
    bytes are still accounted as parked: this is what lets a CPU benchmark report the peak a GPU
    would hold on the device (live tensor bytes minus parked bytes)."""
    with _RUNS_LOCK:
        runs = list(_RUNS)
    return sum(r.parked_bytes for r in runs)


def _tt_bytes(t: TT | None) -> int:
    return 0 if t is None else t.data.numel() * t.data.element_size()


class Run:
    """Per-call context: dtypes, guard, offload, report, module calls with cast weights."""

    def __init__(
        self,
        *,
        device: torch.device,
        dtype: torch.dtype,
        guard: bool,
        wide: torch.dtype,
        offload: torch.device | None,
        report: VAEReport,
        score_bytes: int = DEFAULT_SCORE_BYTES,
    ) -> None:
        self.device = device
        self.dtype = dtype
        self.guard = guard
        self.wide = wide
        self.offload = offload
        self.report = report
        self.score_bytes = score_bytes
        self.stage = "global"
        self._cast: dict[tuple[int, torch.dtype], dict[str, torch.Tensor]] = {}
        self.parked_bytes = 0
        """Bytes of tile state parked in ``offload`` memory now (see :func:`parked_bytes`)."""
        self.stats = True
        """Whether programs compute their cores' GroupNorm statistics (not when replaying
        recorded ones)."""
        with _RUNS_LOCK:
            _RUNS.add(self)

    # module calls ------------------------------------------------------------------------
    def call(self, mod: nn.Module, x: torch.Tensor) -> torch.Tensor:
        p = next(iter(mod.parameters()), None)
        if p is None or p.dtype == x.dtype:
            return mod(x)
        key = (id(mod), x.dtype)
        params = self._cast.get(key)
        if params is None:
            params = {n: q.detach().to(x.dtype) for n, q in mod.named_parameters()}
            self._cast[key] = params
        return torch.func.functional_call(mod, params, (x,))

    def close(self) -> None:
        self._cast.clear()
        self.parked_bytes = 0
        with _RUNS_LOCK:
            _RUNS.discard(self)

    # parking -----------------------------------------------------------------------------
    def _move(self, t: TT | None, device: torch.device, pin: bool) -> TT | None:
        if t is None or t.data.device == device:
            return t
        if pin:
            dst = torch.empty(t.data.shape, dtype=t.data.dtype, device=device, pin_memory=True)
            dst.copy_(t.data, non_blocking=True)
            return t.with_data(dst)
        return t.with_data(t.data.to(device, non_blocking=True))

    def park(self, st: TileState) -> None:
        if self.offload is None:
            return
        same = st.res is not None and st.h is not None and st.res.data is st.h.data
        pin = self.offload.type == "cpu" and self.device.type == "cuda"
        st.h = self._move(st.h, self.offload, pin)
        st.res = st.h if same else self._move(st.res, self.offload, pin)
        for t in (st.h, None if same else st.res):
            if t is not None:
                emulate.to_host(t.data)  # an emulated card stops counting it (host memory)
        st.parked = _tt_bytes(st.h) + (0 if same else _tt_bytes(st.res))
        self.parked_bytes += st.parked
        self.report.parked_peak_bytes = max(self.report.parked_peak_bytes, self.parked_bytes)

    def unpark(self, st: TileState) -> None:
        if self.offload is None:
            return
        same = st.res is not None and st.h is not None and st.res.data is st.h.data
        self.parked_bytes -= st.parked
        st.parked = 0
        st.h = self._move(st.h, self.device, False)
        st.res = st.h if same else self._move(st.res, self.device, False)
        for t in (st.h, None if same else st.res):
            if t is not None:
                emulate.to_device(t.data)  # back on the (emulated) device: may raise its OOM

    # guarded segments --------------------------------------------------------------------
    def seg(self, st: TileState, fn: Callable[..., TT], *args: Any) -> TT:
        """Run one segment of a tile program (between two GroupNorms) under the precision guard."""
        st.step += 1
        out = fn(self, *args)
        narrow = out.data.dtype
        # fp32/fp64 have nothing wider to recompute in: no per-segment check (the pass checks its
        # output once and says so, see ``_Pass.tiled``)
        if not self.guard or narrow in (torch.float32, torch.float64) or finite(out.data):
            return out
        wide = self.wide if narrow == torch.float16 else torch.float32
        del out
        wargs = tuple(a.with_data(a.data.to(wide)) if isinstance(a, TT) else a for a in args)
        out = fn(self, *wargs)
        del wargs
        back = out.data.to(narrow)
        kept = not finite(back)
        if not kept:
            out = out.with_data(back)
        del back
        self.report.recomputed.append(
            Recompute(
                self.stage,
                st.index,
                st.step,
                str(narrow).replace("torch.", ""),
                str(wide).replace("torch.", ""),
                kept,
            )
        )
        logger.info(
            "precision guard: %s tile %d step %d overflowed in %s, recomputed in %s%s",
            self.stage,
            st.index,
            st.step,
            narrow,
            wide,
            " (continues in the wider dtype)" if kept else "",
        )
        if kept and not finite(out.data):
            self.report.notes.append(
                f"non-finite even in {wide}: {self.stage} tile {st.index} step {st.step}"
            )
        return out


def finite(t: torch.Tensor) -> bool:
    """No NaN/Inf in ``t`` (the precision guard's check; also used by the pass driver)."""
    # min and max propagate NaN, and an infinity is the min or the max: one fused reduction, no
    # per-element mask (``isfinite(t).all()`` allocates a bool copy of the tensor and, measured on
    # a 128 x 600² fp32 tile on this CPU, takes ~15x as long).
    lo, hi = torch.aminmax(t)
    return bool(torch.isfinite(lo) & torch.isfinite(hi))


# -- ops -----------------------------------------------------------------------------------------


def conv_same(run: Run, mod: nn.Conv2d, t: TT) -> TT:
    """A stride-1 'same' conv on a window: run it, drop the invalid ring at interior edges."""
    y = run.call(mod, t.data)
    p = mod.kernel_size[0] // 2
    if not p:
        return t.with_data(y)
    top = p if t.y0 > 0 else 0
    bot = p if t.y1 < t.H else 0
    left = p if t.x0 > 0 else 0
    right = p if t.x1 < t.W else 0
    if top or bot or left or right:
        y = y[..., top : y.shape[-2] - bot, left : y.shape[-1] - right]
    return TT(y, t.y0 + top, t.x0 + left, t.H, t.W)


def conv_down(run: Run, mod: nn.Conv2d, t: TT) -> TT:
    """The VAE's downsampler: zero pad (0,1,0,1) on the whole image, 3x3 conv with stride 2."""
    d, y0, x0 = t.data, t.y0, t.x0
    if y0 % 2:
        d, y0 = d[..., 1:, :], y0 + 1
    if x0 % 2:
        d, x0 = d[..., :, 1:], x0 + 1
    pad_b = 1 if t.y1 >= t.H else 0
    pad_r = 1 if t.x1 >= t.W else 0
    if pad_b or pad_r:
        d = F.pad(d, (0, pad_r, 0, pad_b))
    y = run.call(mod, d)
    return TT(y, y0 // 2, x0 // 2, down_size(t.H), down_size(t.W))


def apply_norm(t: TT, aff: Affine, act: nn.Module | None, *, silu: bool = True) -> torch.Tensor:
    mean, scale, bias = aff
    # One fused pass, as torch's own GroupNorm kernel applies it: y = x * scale + (bias - mean *
    # scale), the coefficients folded in float64. addcmul computes in float32 for fp16/bf16 data,
    # so there is no half-precision intermediate (the guard still sees an overflowing result).
    dt = t.data.dtype
    y = torch.addcmul((bias - mean * scale).to(dt), t.data, scale.to(dt))
    if not silu:
        return y
    if act is None or isinstance(act, nn.SiLU):
        return F.silu(y, inplace=True)
    return act(y)


def _seg_conv(run: Run, t: TT, conv: nn.Conv2d) -> TT:
    return conv_same(run, conv, t)


def _seg_norm_conv(run: Run, t: TT, aff: Affine, act: nn.Module | None, conv: nn.Conv2d) -> TT:
    y = t.with_data(apply_norm(t, aff, act))
    return conv_same(run, conv, y)


def _seg_norm_conv_add(
    run: Run,
    t: TT,
    aff: Affine,
    act: nn.Module | None,
    conv: nn.Conv2d,
    res: TT,
    shortcut: nn.Conv2d | None,
    scale: float,
) -> TT:
    out = _seg_norm_conv(run, t, aff, act, conv)
    box = Box(out.y0, out.y1, out.x0, out.x1)
    if shortcut is None:
        r = crop(res, box).data
    elif shortcut.kernel_size[0] == 1:
        r = run.call(shortcut, crop(res, box).data)
    else:
        r = crop(conv_same(run, shortcut, res), box).data
    data = out.data
    data.add_(r.to(data.dtype))
    if scale != 1.0:
        data.div_(scale)
    return out


def _seg_up(run: Run, t: TT, conv: nn.Conv2d | None, box: Box, need: int) -> TT:
    y = F.interpolate(t.data, scale_factor=2.0, mode="nearest")
    u = crop(TT(y, t.y0 * 2, t.x0 * 2, t.H * 2, t.W * 2), box, need)
    if conv is None:
        return u.with_data(u.data.contiguous())
    return conv_same(run, conv, u)


def _seg_down(run: Run, t: TT, conv: nn.Conv2d, box: Box, need: int) -> TT:
    return crop(conv_down(run, conv, t), box, need)


def _seg_out(run: Run, t: TT, aff: Affine, act: nn.Module | None, conv: nn.Conv2d, tanh: bool) -> TT:
    y = conv_same(run, conv, t.with_data(apply_norm(t, aff, act)))
    if tanh:
        y = y.with_data(torch.tanh(y.data))
    return y


def _seg_attn(run: Run, t: TT, aff: Affine, at: Attention) -> TT:
    x = t.data
    y = apply_norm(t, aff, None, silu=False)
    b, c, h, w = x.shape
    if at.linear:
        flat = y.flatten(2).transpose(1, 2)  # (B, N, C)
        del y
        q, k, v = (run.call(m, flat) for m in (at.q, at.k, at.v))
        del flat
        d = q.shape[-1] // at.heads
        q, k, v = (z.view(b, h * w, at.heads, d).transpose(1, 2) for z in (q, k, v))
    else:
        # (B, 1, N, C), made contiguous one at a time (each 1x1 conv output is dropped after its
        # copy): the attention kernels want the channel dimension contiguous
        q, k, v = (
            run.call(m, y).flatten(2).transpose(1, 2).contiguous().unsqueeze(1) for m in (at.q, at.k, at.v)
        )
        del y
    fused = cpu_flash_available(q)
    run.report.attention_chunk = (
        q.shape[2] if fused else min(q.shape[2], query_chunk(b, q.shape[1], k.shape[2], run.score_bytes))
    )
    o = attention(q, k, v, scale=at.scale, max_bytes=run.score_bytes, fused=fused)
    del q, k, v
    if at.linear:
        o = o.transpose(1, 2).reshape(b, h * w, -1)
        o = run.call(at.out, o).transpose(1, 2).reshape(b, c, h, w)
    else:
        o = o.squeeze(1).transpose(1, 2).reshape(b, c, h, w)
        o = run.call(at.out, o)
    if at.residual:
        o = o + x
    if at.rescale != 1.0:
        o = o / at.rescale
    return t.with_data(o)


# -- programs ------------------------------------------------------------------------------------

Program = Generator[Request, Affine, None]


def _sync(run: Run, st: TileState, gn: nn.GroupNorm) -> Generator[Request, Affine, Affine]:
    assert st.h is not None
    if run.stats:
        n, mean, var = core_stats(st.h, st.box)
    else:  # fast mode's tiles: the statistics are given, the core's would be thrown away
        n, mean, var = 0, None, None
    run.park(st)
    aff = yield Request(gn, n, mean, var)
    run.unpark(st)
    return aff


def _resnet(run: Run, st: TileState, blk: Resnet) -> Generator[Request, Affine, None]:
    st.res = st.h
    aff = yield from _sync(run, st, blk.norm1)
    st.h = run.seg(st, _seg_norm_conv, st.h, aff, blk.act, blk.conv1)
    shortcut = blk.shortcut
    if shortcut is not None and shortcut.kernel_size[0] == 1 and blk.out_channels < blk.in_channels:
        # Park the (smaller) projected residual instead of the block input.
        st.res = run.seg(st, _seg_conv, st.res, shortcut)
        shortcut = None
    aff = yield from _sync(run, st, blk.norm2)
    st.h = run.seg(st, _seg_norm_conv_add, st.h, aff, blk.act, blk.conv2, st.res, shortcut, blk.out_scale)
    st.res = None


def _attn(run: Run, st: TileState, at: Attention) -> Generator[Request, Affine, None]:
    aff = yield from _sync(run, st, at.norm)
    st.h = run.seg(st, _seg_attn, st.h, aff, at)


def _mid(run: Run, st: TileState, spec: VAESpec) -> Generator[Request, Affine, None]:
    for item in spec.mid:
        if isinstance(item, Resnet):
            yield from _resnet(run, st, item)
        else:
            yield from _attn(run, st, item)


def decoder_global(run: Run, st: TileState, spec: VAESpec, blocks: tuple[Resnet, ...] = ()) -> Program:
    """conv_in + mid block (+ ``blocks``, the first level's ResNets in fast mode) on the whole latent."""
    st.h = run.seg(st, _seg_conv, st.h, spec.conv_in)
    yield from _mid(run, st, spec)
    for blk in blocks:
        yield from _resnet(run, st, blk)


def decoder_tiles(run: Run, st: TileState, spec: VAESpec, out: torch.Tensor) -> Program:
    """Up path (+ norm_out, conv_out) of one tile; writes its core into ``out``."""
    rneeds = iter(resample_needs(spec))
    for lv in spec.levels:
        for blk in lv.blocks:
            yield from _resnet(run, st, blk)
        if lv.resample_kind == "up":
            st.box = up_box(st.box)
            st.h = run.seg(st, _seg_up, st.h, lv.resample, st.box, next(rneeds))
    if not spec.give_pre_end:
        aff = yield from _sync(run, st, spec.norm_out)
        st.h = run.seg(st, _seg_out, st.h, aff, spec.act_out, spec.conv_out, spec.tanh_out)
    assert st.h is not None
    b = st.box
    out[:, :, b.y0 : b.y1, b.x0 : b.x1] = crop(st.h, b).data.to(out.dtype)
    st.h = None


def encoder_tiles(run: Run, st: TileState, spec: VAESpec, feat: torch.Tensor) -> Program:
    """conv_in + down path of one tile; writes its latent core into ``feat``."""
    st.h = run.seg(st, _seg_conv, st.h, spec.conv_in)
    rneeds = iter(resample_needs(spec))
    for lv in spec.levels:
        for blk in lv.blocks:
            yield from _resnet(run, st, blk)
        if lv.resample_kind == "down":
            assert st.h is not None and lv.resample is not None
            h = st.h
            st.box = down_box(st.box, h.H, h.W, down_size(h.H), down_size(h.W))
            del h
            st.h = run.seg(st, _seg_down, st.h, lv.resample, st.box, next(rneeds))
    assert st.h is not None
    b = st.box
    feat[:, :, b.y0 : b.y1, b.x0 : b.x1] = crop(st.h, b).data.to(feat.dtype)
    st.h = None


def encoder_global(run: Run, st: TileState, spec: VAESpec) -> Program:
    """Mid block + norm_out + conv_out on the whole latent."""
    yield from _mid(run, st, spec)
    aff = yield from _sync(run, st, spec.norm_out)
    st.h = run.seg(st, _seg_out, st.h, aff, spec.act_out, spec.conv_out, False)


# -- drivers -------------------------------------------------------------------------------------


class Ticker:
    """Between-tile duties: interrupt check, progress callback, tracker sample."""

    def __init__(
        self,
        total: int,
        should_interrupt: Callable[[], bool] | None,
        progress: Callable[[int, int], None] | None,
        sample: Callable[[], None] | None,
    ) -> None:
        self.total = max(1, total)
        self.done = 0
        self.should_interrupt = should_interrupt
        self.progress = progress
        self.sample = sample

    def check(self) -> None:
        if self.should_interrupt is not None and self.should_interrupt():
            raise Interrupted("VAE pass interrupted between tiles")

    def tick(self) -> None:
        self.done = min(self.total, self.done + 1)
        if self.sample is not None:
            self.sample()
        if self.progress is not None:
            self.progress(self.done, self.total)
        self.check()


def lockstep(
    gens: list[Program], ticker: Ticker, record: list[tuple[nn.GroupNorm, Affine]] | None = None
) -> None:
    """Advance all tiles to the next GroupNorm, combine their statistics exactly, repeat."""
    send: list[Affine | None] = [None] * len(gens)
    while True:
        reqs: list[Request | None] = []
        for i, g in enumerate(gens):
            try:
                reqs.append(g.send(send[i]))  # type: ignore[arg-type]
            except StopIteration:
                reqs.append(None)
            ticker.tick()
        done = [r is None for r in reqs]
        if all(done):
            return
        if any(done):
            raise RuntimeError("internal error: tiles fell out of lock-step")
        gn = reqs[0].gn  # type: ignore[union-attr]
        if any(r.gn is not gn for r in reqs):  # type: ignore[union-attr]
            raise RuntimeError("internal error: tiles reached different GroupNorms")
        aff = combine(gn, reqs)  # type: ignore[arg-type]
        del reqs
        if record is not None:
            record.append((gn, aff))
        send = [aff] * len(gens)


def replay(gens: Iterator[Program], stats: list[tuple[nn.GroupNorm, Affine]], ticker: Ticker) -> None:
    """Run tiles one after another to completion with fixed, recorded statistics (fast mode)."""
    for g in gens:
        k = 0
        msg: Affine | None = None
        while True:
            try:
                req = g.send(msg)  # type: ignore[arg-type]
            except StopIteration:
                break
            if k >= len(stats) or req.gn is not stats[k][0]:
                raise RuntimeError("internal error: fast-mode statistics do not match the program")
            msg = stats[k][1]
            k += 1
            del req
        ticker.tick()
        del g
