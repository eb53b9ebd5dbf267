"""Analytic peak-memory estimate of a VAE pass and the tile choice built on it.

The estimate walks the same :class:`VAESpec` the engine runs and adds up, op by op, the tensors
that are alive at once (inputs kept for the residual, the normalised copy, the conv output), at
the window size a tile has at that level, plus what is held across the whole tiled stage (the
mid-block output, the output image, and in exact mode the activations of the tiles waiting at a
GroupNorm when they stay on the device). It counts tensor bytes only: framework workspaces and
allocator rounding are not in it (the planner calibrates them by a dry run).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lib_vram.core.geometry import split_axis
from lib_vram.core.livebytes import itemsize
from lib_vram.core.predict import WORKSPACE_TERMS
from lib_vram.planning import planner

from ._attention import DEFAULT_SCORE_BYTES, cpu_flash_kernel
from ._layout import Resnet, VAESpec, decoder_spec, encoder_spec, signature
from ._window import needs, split_first_level

TILE_CANDIDATES = (256, 192, 160, 128, 112, 96, 80, 64, 56, 48, 40, 32, 24, 16, 8)
"""Tile sizes (latent px) tried by the auto planner and the out-of-memory retry, largest first."""


def _resnet_units(blk: Resnet) -> tuple[int, int]:
    """(working channels, parked channels) of one ResNet block, in channel x pixel units."""
    cin, cout = blk.in_channels, blk.out_channels
    seg_a = 2 * cin + cout
    res = cout if (blk.shortcut is not None and cout < cin) else cin
    seg_b = res + 3 * cout
    parked = max(cin, cout + res)
    return max(seg_a, seg_b), parked


def _levels(spec: VAESpec, h: int, w: int) -> list[tuple[int, int]]:
    """(H, W) at each level's blocks, in processing order, starting from the tiled input size."""
    sizes = []
    for lv in spec.levels:
        sizes.append((h, w))
        if lv.resample_kind == "up":
            h, w = h * 2, w * 2
        elif lv.resample_kind == "down":
            h, w = (h + 1 - 3) // 2 + 1, (w + 1 - 3) // 2 + 1
    sizes.append((h, w))
    return sizes


def _axis_samples(n: int, frac: float, align: int) -> list[tuple[int, int]]:
    want = max(1, math.ceil(n * frac))
    k = 1 if want < 16 else 2 if want < 64 else 4
    size = max(align, math.ceil(want / k / align) * align)
    out = []
    for i in range(k):
        centre = (i + 0.5) * n / k
        a = max(0, min(n - size, int(centre - size / 2)))
        a = (a // align) * align
        out.append((a, min(n, a + size)))
    return sorted(set(out))


def sample_boxes(h: int, w: int, sample: int, align: int) -> list[tuple[int, int, int, int]]:
    """Cores of the fast-mode statistics pass: a few crops spread over the image, covering about
    ``1/sample`` of each axis (the whole image when ``sample`` is 1)."""
    if sample <= 1:
        return [(0, h, 0, w)]
    ys = _axis_samples(h, 1 / sample, align)
    xs = _axis_samples(w, 1 / sample, align)
    return [(y0, y1, x0, x1) for y0, y1 in ys for x0, x1 in xs]


def _overhead(h: int, w: int, core: int, halo: int) -> float:
    """Window pixels of the tile grid over image pixels (:func:`lib_vram.core.geometry.overhead`
    of ``grid(h, w, core, core, halo)``): the grid is the product of its two axes' spans, so the
    sum over its tiles is the product of the axes' sums (no list of tiles at any size)."""
    sy = sum(sp.size for sp in split_axis(h, core, halo))
    sx = sy if w == h else sum(sp.size for sp in split_axis(w, core, halo))
    return sy * sx / float(h * w)


def _window(n: int, core: float, tiles: int, need: int) -> int:
    """The largest tile window along an axis of ``n`` pixels cut into ``tiles`` cores of at most
    ``core``: the halo is on both sides only for an inner tile (three tiles or more), on one side
    with two tiles, and there is none with one."""
    return min(n, int(math.ceil(core)) + need * min(2, tiles - 1))


def _level_needs(spec: VAESpec) -> list[int]:
    """Halo at the start of each level (tiled part), at that level's resolution."""
    start, after = needs(spec)
    out = [start]
    i = 1 if spec.kind == "encoder" else 0
    for lv in spec.levels:
        i += 2 * len(lv.blocks)
        if lv.resample_kind == "up":
            i += 1 + (1 if lv.resample is not None else 0)
            out.append(after[i - 1])
        elif lv.resample_kind == "down":
            i += 1
            out.append(after[i - 1])
        else:
            out.append(out[-1])
    return out


@dataclass(frozen=True)
class Step:
    """One level of the tiled path (the decoder's output convolution is a step of its own)."""

    work: int
    """The largest working set of one tile at this level: the inputs a segment keeps, its
    normalised copy and outputs."""
    parked: int
    """Exact mode with the state on the device: what the other tiles hold while one tile works at
    this level (their activations, waiting at the level's GroupNorms)."""
    workspace: int
    """The backend's convolution scratch (:data:`lib_vram.core.predict.WORKSPACE_TERMS`) at the
    level's largest convolution: transient, next to the working set."""


@dataclass(frozen=True)
class Components:
    """The terms of an analytic estimate, in bytes (see :func:`estimate_components`)."""

    global_peak: int
    """The global stage (decoder: input, ``conv_in`` and mid block on the whole latent; encoder:
    the assembled features, mid block and output), its own peak, with its convolution scratch."""
    held: int
    """What the tiled stage holds throughout: mid-block output or input image, the output, fast
    mode's statistics scratch."""
    steps: tuple[Step, ...]
    """The tiled path, level by level."""
    stats_steps: tuple[Step, ...] = ()
    """Fast mode: the statistics pass (lock-step tiles of the subsampled image or sample crops)."""
    kind: str = "decoder"
    tiled: bool = True
    fast: bool = False
    """Fast mode: the tiles of the main pass run one after another (nothing parked)."""


def estimate_components(
    spec: VAESpec,
    input_shape: tuple[int, ...],
    dtype: torch.dtype,
    *,
    tile: int | None,
    mode: str = "exact",
    state_on_device: bool = True,
    out_dtype: torch.dtype | None = None,
    backend: str = "cpu",
    fast_sample: int | None = None,
) -> Components:
    """The terms of the analytic estimate of one pass (see :class:`Components`)."""
    if len(input_shape) != 4:
        raise ValueError(f"`input_shape` must be (B, C, H, W), got {input_shape}")
    if mode not in ("untiled", "exact", "fast"):
        raise ValueError(f"`mode` must be 'untiled', 'exact' or 'fast', got {mode!r}")
    b, _, h, w = (int(v) for v in input_shape)
    # fast mode's statistics subsampling: the engine's automatic one unless given
    fast_sample = fast_sample_for(fast_sample, spec.kind, h, w)
    s = itemsize(dtype)
    so = itemsize(out_dtype or dtype)
    f = spec.factor
    ws_term = WORKSPACE_TERMS.get(backend)

    def ws(cin: int, cout: int, k: int, px_in: int, px_out: int, contiguous: bool = True) -> int:
        if ws_term is None:
            return 0
        return ws_term((b, cin, px_in, 1), (cout, cin, k, k), (b, cout, px_out, 1), s, contiguous)

    if spec.kind == "decoder":
        lat_h, lat_w = h, w
        out_c = spec.levels[-1].blocks[-1].out_channels if spec.give_pre_end else spec.out_channels
        out_bytes = b * out_c * h * f * w * f * so
    else:
        lat_h, lat_w = (h + f - 1) // f, (w + f - 1) // f
        out_bytes = b * spec.out_channels * lat_h * lat_w * so
    in_bytes = b * spec.in_channels * h * w * s
    lat_px = lat_h * lat_w
    mid_c = spec.mid_channels
    # one query chunk's scores and their softmax (the math kernel holds both), at most
    # DEFAULT_SCORE_BYTES each (the engine's attention chunks the queries); none where the CPU's
    # blocked flash kernel runs the attention in one call
    flash = backend == "cpu" and cpu_flash_kernel(dtype)
    scores = 0 if flash else 2 * min(DEFAULT_SCORE_BYTES, b * lat_px * lat_px * 4)
    unit = b * lat_px * s
    # the mid block on the whole latent: a ResNet's second convolution (its input, the residual,
    # the normalised copy, the output), the attention's projections (the input and the
    # normalised copy, q, k, v) and the attention itself (input, q, k, v, output; the math
    # kernel's scores)
    global_peak = max(
        unit * 4 * mid_c + ws(mid_c, mid_c, 3, lat_px, lat_px),
        unit * 5 * mid_c + ws(mid_c, mid_c, 1, lat_px, lat_px),
        unit * 5 * mid_c + scores,
        unit * (2 * mid_c + spec.in_channels) + ws(spec.in_channels, mid_c, 3, lat_px, lat_px),
    )
    held_mid = b * mid_c * lat_px * s  # decoder: mid output; encoder: assembled features

    core = None if (tile is None or mode == "untiled") else int(tile) * (f if spec.kind == "encoder" else 1)
    lock_step = mode == "exact" and state_on_device and core is not None
    # fast decode tiles only what follows the first level's ResNets (they run on the whole latent
    # with the mid block): a shorter path and a smaller halo
    tspec = split_first_level(spec)[1] if mode == "fast" and core is not None else spec

    def walk(
        th: int,
        tw: int,
        parks: bool,
        boxes: list[tuple[int, int, int, int]] | None = None,
    ) -> tuple[Step, ...]:
        """The steps of the tiled path on a ``th`` x ``tw`` input (``parks``: lock-step tiles;
        ``boxes``: the tiles' cores on the input, instead of the engine's grid of ``core``)."""
        sizes = _levels(tspec, th, tw)
        lneeds = _level_needs(tspec)
        start, after = needs(tspec)
        op = 1 if spec.kind == "encoder" else 0  # index of the next op of the tiled path

        def need_before(k: int) -> int:
            return start if k == 0 else after[k - 1]

        # the engine's grid on the input: balanced cores (the largest, and how many per axis)
        if boxes is not None:
            cy = max(y1 - y0 for y0, y1, _, _ in boxes)
            cx = max(x1 - x0 for _, _, x0, x1 in boxes)
            ny = nx = 3
        elif core is not None:
            align = f if spec.kind == "encoder" else 1
            ys, xs = split_axis(th, core, 0, align=align), split_axis(tw, core, 0, align=align)
            cy, cx = (max(sp.core_end - sp.core_start for sp in a) for a in (ys, xs))
            ny, nx = len(ys), len(xs)
        # convolution outputs of a tile with an inner edge are cropped views (not contiguous)
        cropped = core is not None and max(ny, nx) > 1
        steps = []
        c_prev = mid_c if spec.kind == "decoder" else spec.in_channels
        for i, lv in enumerate(tspec.levels):
            lh, lw = sizes[i]

            def window(need: int, lh: int = lh, lw: int = lw) -> tuple[int, float]:
                """(window pixels of the largest tile, tile-grid overhead) at this level when the
                halo still needed is ``need``: the windows shrink op by op as convolutions use it."""
                if core is None:
                    return lh * lw, 1.0
                if boxes is not None:
                    # separate crops: each grown by the halo on both sides, clipped to the image
                    ry, rx = lh / th, lw / tw
                    wins = [
                        (min(lh, math.ceil(y1 * ry) + need) - max(0, int(y0 * ry) - need))
                        * (min(lw, math.ceil(x1 * rx) + need) - max(0, int(x0 * rx) - need))
                        for y0, y1, x0, x1 in boxes
                    ]
                    return max(wins), sum(wins) / float(lh * lw)
                c = max(1, int(round(core * lh / th)))
                ov = _overhead(lh, lw, c, need)
                return _window(lh, cy * lh / th, ny, need) * _window(lw, cx * lw / tw, nx, need), ov

            px, _ = window(lneeds[i])
            parked = 0
            # the moments of one tile's program at this level: (working set, convolution scratch);
            # the level's step is the moment where their sum is largest
            moments: list[tuple[int, int]] = []
            if i == 0 and spec.kind == "encoder":
                moments.append((0, ws(spec.in_channels, spec.conv_in.out_channels, 3, px, px, not cropped)))
            for blk in lv.blocks:
                bpx, ov = window(need_before(op))
                op += 2
                cin, cout = blk.in_channels, blk.out_channels
                wu, pu = _resnet_units(blk)
                unit = b * bpx * s
                # norm1 + conv1 (the normalised copy is contiguous), norm2 + conv2 (+ residual)
                moments.append((unit * (2 * cin + cout), ws(cin, cout, 3, bpx, bpx)))
                moments.append((unit * wu, ws(cout, cout, 3, bpx, bpx)))
                sc = blk.shortcut
                if sc is not None:
                    # the shortcut convolves the kept block input: a view of a cropped convolution
                    # output, copied inside the operator
                    k = sc.kernel_size[0]
                    live = cin + 2 * cout if (k == 1 and cout < cin) else cin + 3 * cout
                    moments.append((unit * live, ws(cin, cout, k, bpx, bpx, not cropped)))
                if parks:
                    # the other tiles' states (the working tile's own is in its working set)
                    parked = max(parked, int(b * s * pu * max(0.0, lh * lw * ov - bpx)))
                c_prev = blk.out_channels
            c_last = lv.blocks[-1].out_channels if lv.blocks else c_prev
            if lv.resample_kind == "up":
                rpx, _ = window(need_before(op))
                # the 2x nearest copy of the window is cropped to the next level's window (its
                # halo: what the next ops need), then convolved (or made contiguous)
                nh, nw = sizes[i + 1]
                upx, _ = window(after[op], nh, nw)
                op += 1 + (1 if lv.resample is not None else 0)
                # input, its 2x copy, the convolution's output on the crop (+ the crop's copy)
                whole = upx >= 4 * rpx  # nothing cropped: the convolution's input is contiguous
                up_ws = 0 if lv.resample is None else ws(c_last, c_last, 3, upx, upx, whole or not cropped)
                moments.append((int(b * s * c_last * (5 * rpx + upx)), up_ws))
            elif lv.resample_kind == "down":
                rpx, _ = window(need_before(op))
                op += 1
                moments.append((int(b * rpx * s * c_last * 2.25), ws(c_last, c_last, 3, rpx, rpx // 4)))
            work, wsp = max(moments, key=sum, default=(0, 0))
            steps.append(Step(work, parked, wsp))
        if spec.kind == "decoder" and not spec.give_pre_end:
            lh, lw = sizes[-1]
            c = spec.norm_out.num_channels
            if core is None:
                px = lh * lw
            else:
                px = _window(lh, cy * lh / th, ny, lneeds[-1]) * _window(lw, cx * lw / tw, nx, lneeds[-1])
            steps.append(
                Step(b * px * s * (2 * c + spec.out_channels), 0, ws(c, spec.out_channels, 3, px, px))
            )
        return tuple(steps)

    steps = walk(h, w, lock_step)
    stats: tuple[Step, ...] = ()
    held = held_mid + out_bytes if spec.kind == "decoder" else in_bytes + held_mid
    align = f if spec.kind == "encoder" else 1
    one_tile = core is not None and len(split_axis(h, core, 0, align=align)) == 1
    one_tile = one_tile and len(split_axis(w, core, 0, align=align)) == 1
    if mode == "fast" and core is not None and not one_tile:
        # (a single tile runs in lock-step with itself: no statistics pass)
        k = max(1, fast_sample)
        if spec.kind == "decoder":
            # the first-level output subsampled k x per axis, decoded in lock-step into a scratch
            # output of that size
            stats = walk(-(-h // k), -(-w // k), True)
            held += out_bytes // (k * k)
        else:
            # sample crops in lock-step among themselves
            stats = walk(h, w, True, boxes=sample_boxes(h, w, k, f))
    return Components(
        global_peak=(in_bytes if spec.kind == "decoder" else held_mid + out_bytes) + global_peak,
        held=held,
        steps=steps,
        stats_steps=stats,
        kind=spec.kind,
        tiled=core is not None,
        fast=mode == "fast" and core is not None,
    )


def combine(c: Components) -> int:
    """Peak bytes from the terms: the larger of the global stage and the tiled one, whose peak is
    at the moment of a tile's program where its working set and scratch plus what the other tiles
    park is largest (each term counted as the engine holds it: no fitted factors)."""

    def peak(steps: tuple[Step, ...]) -> int:
        return max((st.work + st.parked + st.workspace for st in steps), default=0)

    tiled = c.held + max(peak(c.steps), peak(c.stats_steps))
    return int(max(c.global_peak, tiled))


def estimate_spec_bytes(spec: VAESpec, input_shape: tuple[int, ...], dtype: torch.dtype, **kw: Any) -> int:
    """Peak bytes of one pass of ``spec`` on ``input_shape`` (see :func:`estimate_peak_bytes`;
    ``kw``: :func:`estimate_components`')."""
    return combine(estimate_components(spec, input_shape, dtype, **kw))


def estimate_peak_bytes(
    module: nn.Module,
    input_shape: tuple[int, ...],
    dtype: torch.dtype,
    *,
    tile: int | None,
    mode: str,
    backend: str = "cpu",
) -> int:
    """Analytic peak bytes on the compute device of one decode/encode pass (milliseconds).

    Tensor bytes counted along the engine's own structure (what a tile keeps at each moment of its
    program, what the waiting tiles park, what the tiled stage holds), plus the backend's
    convolution scratch (:data:`lib_vram.core.predict.WORKSPACE_TERMS`, the predictor's own term)
    at the same moment; checked against the engine's fake-tensor run (``bench vae-estimate``,
    ``tests/test_plan_path.py``).

    Args:
        module: a supported VAE decoder or encoder (see :func:`lib_vram.vae.is_supported_decoder`).
        input_shape: ``(B, C, H, W)`` of the latent (decoder) or image (encoder).
        dtype: compute dtype.
        tile: tile core in latent pixels; ``None`` = untiled.
        mode: ``"untiled"``, ``"exact"`` (activations of waiting tiles counted on the device) or
            ``"fast"``.
        backend: ``"cpu"``, ``"cuda"``, ... (:class:`lib_vram.core.device.Backend` values): which
            convolution scratch term applies.
    """
    spec = _spec_of(module)
    return estimate_spec_bytes(spec, tuple(input_shape), dtype, tile=tile, mode=mode, backend=backend)


def _spec_of(module: nn.Module) -> VAESpec:
    if hasattr(module, "up") or hasattr(module, "up_blocks"):
        return decoder_spec(module)
    return encoder_spec(module)


def candidates(latent_max: int) -> list[int]:
    """Tile sizes to try for a latent whose longer side is ``latent_max``, largest first."""
    return [latent_max] + [t for t in TILE_CANDIDATES if t < latent_max]


def smaller(tile: int) -> int | None:
    """The next candidate below ``tile`` (at most 3/4 of it), or None at the bottom."""
    return next((t for t in TILE_CANDIDATES if t <= (tile * 3) // 4), None)


# -- the one planning path: what the engine runs, and its predicted peak ------------------------

FAST_SAMPLE_SIDE = 32
"""Auto ``fast_sample`` for the decoder: subsample the latent until its short side is about this
many pixels (at least 2x). The estimate pass then costs ~``(32 / side)²`` of a decode (25 % at a
64-px latent, 6 % at 128 px, 1.6 % at 256 px) and sees as much of the picture as at 512² with 2x,
where it measured 47 dB (docs/benchmarks.md)."""


def fast_sample_for(fast_sample: int | None, kind: str, h: int, w: int) -> int:
    """The subsampling factor fast mode uses (``fast_sample`` if set; auto: see
    :data:`FAST_SAMPLE_SIDE` for the decoder, 2 for the encoder's crops)."""
    if fast_sample is not None:
        return fast_sample
    if kind != "decoder":
        return 2
    return max(2, min(h, w) // FAST_SAMPLE_SIDE)


def select(cands: list[planner.Candidate], budget: int) -> tuple[planner.Choice, int]:
    """The planner's choice within ``budget`` and its index; when nothing fits, the smallest tile
    learning allows instead of the smallest estimate (a tiny tile's estimate is dominated by its
    halo, yet the smallest tile is the engine's best chance)."""
    choice = planner.choose(cands, budget, 0)
    index = cands.index(choice.candidate)
    if not choice.fits:
        allowed = [i for i, c in enumerate(cands) if c.tile is not None and c.peak_bytes < planner.EXCLUDED]
        if allowed:
            index = min(allowed, key=lambda i: cands[i].tile or 0)
    return choice, index


class PassPlanner:
    """The numbers behind one decode/encode pass: estimates, candidates, the learning key and the
    choice. The engine (:func:`lib_vram.vae.tiled_decode`/``tiled_encode``) and :func:`plan_vae`
    (``python -m lib_vram plan``, the WebUI's Auto) both decide through it, so they cannot differ.

    ``host_apart``: host memory is distinct from the device's (an accelerator, or an emulated
    card): then exact mode's waiting tiles may park off the device (``state_offload="auto"``).
    """

    def __init__(
        self,
        spec: VAESpec,
        input_shape: tuple[int, ...],
        dtype: torch.dtype,
        budget_bytes: int,
        *,
        out_dtype: torch.dtype | None = None,
        backend: str = "cpu",
        host_apart: bool = False,
        state_offload: str = "auto",
        fast_sample: int | None = None,
        memory: planner.PlanMemory | None = None,
    ) -> None:
        if len(input_shape) != 4:
            raise ValueError(f"`input_shape` must be (B, C, H, W), got {input_shape}")
        self.spec = spec
        self.shape = tuple(int(v) for v in input_shape)
        self.dtype = dtype
        self.out_dtype = out_dtype or dtype
        self.backend = backend
        self.host_apart = host_apart
        self.state_offload = state_offload
        self.budget = int(budget_bytes)
        self.memory = planner.MEMORY if memory is None else memory
        self.fast_sample = fast_sample_for(fast_sample, spec.kind, self.shape[-2], self.shape[-1])
        self.notes: list[str] = []
        self._estimates: dict[tuple, int] = {}

    def estimate(self, tile: int | None, mode: str, on_device: bool = True) -> int:
        """The analytic peak of one plan (memoised: a pass asks for a plan's estimate repeatedly)."""
        k = (tile, mode, on_device)
        if k not in self._estimates:
            self._estimates[k] = estimate_spec_bytes(
                self.spec, self.shape, self.dtype, tile=tile, mode=mode, state_on_device=on_device,
                out_dtype=self.out_dtype, backend=self.backend, fast_sample=self.fast_sample,
            )  # fmt: skip
        return self._estimates[k]

    def key(self, mode: str) -> tuple:
        """The planner-memory key in a tiled ``mode`` (auto's untiled try shares the ``"exact"``
        key: both are candidates of one choice)."""
        stage = "vae_decode" if self.spec.kind == "decoder" else "vae_encode"
        return planner.plan_key(stage, signature(self.spec), self.shape, self.dtype, mode)

    def candidate(self, tile: int | None, mode: str) -> planner.Candidate:
        """``tile`` (None: untiled) as a planner candidate, its peak the raw estimate."""
        if tile is None:
            return planner.Candidate("untiled", self.estimate(None, "untiled"))
        on_dev = self.state_offload == "device" or not self.host_apart
        return planner.Candidate(f"{mode} t{tile}", self.estimate(tile, mode, on_dev), tile)

    def tile_candidates(self, mode: str) -> list[planner.Candidate]:
        b, c, h, w = self.shape
        f = self.spec.factor if self.spec.kind == "encoder" else 1
        return [self.candidate(t, mode) for t in candidates(math.ceil(max(h, w) / f))]

    def choose(self, cands: list[planner.Candidate], mode: str) -> tuple[planner.Candidate, bool]:
        """The planner's choice among ``cands`` within the budget, after what the memory learned
        for this key (a plan that ran out of memory, a measured peak above the estimate); and
        whether it fits. Why learning changed the choice goes into :attr:`notes`."""
        key = self.key(mode)
        learned, index = select(self.memory.adjust(key, cands), self.budget)
        _, naive_index = select(cands, self.budget)
        pick = cands[index]
        if index != naive_index:
            ratio = self.memory.ratio(key)
            why = f"x{ratio:.2f} measured/estimated" if ratio > 1 else "an earlier out-of-memory error"
            self.notes.append(f"{pick.plan} instead of {cands[naive_index].plan}: learned from {why}")
        if not learned.fits:
            self.notes.append(
                f"no plan fits the budget ({self.budget} B); "
                f"using {pick.plan} ({pick.peak_bytes} B estimated)"
            )
        return pick, learned.fits

    def pick_tile(self, mode: str) -> int:
        tile = self.choose(self.tile_candidates(mode), mode)[0].tile
        assert tile is not None
        return tile

    def offload(self, tile: int, mode: str) -> str:
        """Where exact mode's waiting tiles park at ``tile``: ``"device"`` or ``"cpu"``."""
        choice = self.state_offload
        if not self.host_apart or mode != "exact":
            choice = "device" if choice == "auto" else choice
        if choice == "auto":
            choice = "device" if self.estimate(tile, "exact") <= self.budget else "cpu"
        return choice

    def auto(self, mode: str, tile: int | None) -> tuple[str, int | None]:
        """What a pass in ``mode`` (``"auto"``, ``"exact"``, ``"fast"``) with the configured
        ``tile`` (None: automatic) runs: ``("untiled", None)`` or ``(mode, tile)``. Auto runs
        untiled only when that fits (when nothing does, tiles: at least the output and the upper
        levels' activations shrink with them), else exact tiles."""
        if mode == "auto":
            if tile is None:
                cands = [self.candidate(None, "exact"), *self.tile_candidates("exact")]
                pick, fits = self.choose(cands, "exact")
                if fits and pick.tile is None:
                    return "untiled", None
            mode = "exact"
        return mode, (self.pick_tile(mode) if tile is None else tile)


@dataclass(frozen=True)
class VAEPlan:
    """One decode/encode pass as the engine runs it (see :func:`plan_vae`)."""

    kind: str
    """``"decoder"`` or ``"encoder"``."""
    mode: str
    """``"untiled"``, ``"exact"`` or ``"fast"``."""
    tile: int | None
    """Tile core in latent px (None: untiled)."""
    state_offload: str
    """Exact mode: where waiting tiles park (``"device"``/``"cpu"``); ``""`` otherwise."""
    peak_bytes: int
    """Predicted peak on the compute device: the input, the activations and the output (weights
    not included: they are resident before the pass), with learned corrections applied."""
    raw_peak_bytes: int
    """The same before learned corrections (what the planner memory scales)."""
    fits: bool
    """Whether ``peak_bytes`` is within the budget."""
    budget_bytes: int
    key: tuple
    """The planner-memory key (:func:`lib_vram.planner.plan_key`) the engine learns under."""
    candidates: tuple[planner.Candidate, ...] = ()
    """Untiled and the tile candidates with their raw estimates, in preference order."""
    notes: tuple[str, ...] = ()

    @property
    def plan(self) -> str:
        return "untiled" if self.tile is None else f"{self.mode} t{self.tile}"


def plan_vae(
    module: nn.Module | VAESpec,
    input_shape: tuple[int, ...],
    dtype: torch.dtype,
    budget_bytes: int,
    *,
    mode: str = "auto",
    tile: int | None = None,
    state_offload: str = "auto",
    out_dtype: torch.dtype | None = None,
    backend: str = "cpu",
    host_apart: bool | None = None,
    fast_sample: int | None = None,
    memory: planner.PlanMemory | None = None,
) -> VAEPlan:
    """The plan the VAE engine runs for one pass, and its predicted peak, in milliseconds.

    Exactly the engine's own decision (:func:`lib_vram.vae.tiled_decode` with a
    :class:`~lib_vram.vae.TiledVAEConfig` of the same ``mode``, ``tile``, ``budget_bytes``,
    ``dtype`` and ``state_offload``, on a device of ``backend``), made without running anything.

    Args:
        module: a supported VAE decoder or encoder (the WebUI's, ldm/sgm, diffusers, or a
            :mod:`lib_vram.reference` one built on the meta device), or its :class:`VAESpec`.
        input_shape: ``(B, C, H, W)`` of the latent (decoder) or image (encoder).
        budget_bytes: memory the pass may use on the device besides the weights.
        host_apart: host memory distinct from the device's (default: ``backend != "cpu"``).
        memory: the planner memory consulted (default :data:`lib_vram.planner.MEMORY`).
    """
    spec = module if isinstance(module, VAESpec) else _spec_of(module)
    if mode not in ("auto", "exact", "fast"):
        raise ValueError(f"`mode` must be 'auto', 'exact' or 'fast', got {mode!r}")
    if budget_bytes < 0:
        raise ValueError(f"`budget_bytes` must be >= 0, got {budget_bytes}")
    apart = backend != "cpu" if host_apart is None else host_apart
    p = PassPlanner(
        spec, tuple(input_shape), dtype, budget_bytes, out_dtype=out_dtype, backend=backend, host_apart=apart,
        state_offload=state_offload, fast_sample=fast_sample, memory=memory,
    )  # fmt: skip
    ran, t = p.auto(mode, tile)
    offload = "" if t is None or ran != "exact" else p.offload(t, ran)
    raw = p.estimate(None, "untiled") if t is None else p.estimate(t, ran, offload != "cpu")
    kind_mode = "exact" if ran == "untiled" else ran
    key = p.key(kind_mode)
    peak = int(raw * p.memory.ratio(key))
    cands = [p.candidate(None, "exact"), *p.tile_candidates(kind_mode)]
    return VAEPlan(
        kind=spec.kind, mode=ran, tile=t, state_offload=offload, peak_bytes=peak, raw_peak_bytes=raw,
        fits=peak <= budget_bytes, budget_bytes=int(budget_bytes), key=key,
        candidates=tuple(planner.order(cands)), notes=tuple(p.notes),
    )  # fmt: skip
