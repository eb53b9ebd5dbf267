"""The shape facts of a diffusion UNet that its sampling memory depends on.

:class:`UNetSpec` is read from a live ldm/sgm ``UNetModel`` by attribute names
(:func:`unet_spec`: nothing of ldm or sgm is imported) or built for a reference architecture
(:func:`reference_spec`: SD1.x, SD2.x, SDXL) without weights, so ``plan`` works without a
checkpoint. The parameter count of a reference spec is the closed form of the layers it lists
(:func:`param_count`), checked against the real ldm ``UNetModel`` in the tests.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from torch import nn


@dataclass(frozen=True)
class UNetSpec:
    """The shape facts of an ldm/sgm ``UNetModel`` (openaimodel layout) that memory depends on."""

    name: str
    """A label (``"sd15"``, ``"sdxl"``, ``"UNetModel"`` for a live module)."""
    in_channels: int
    out_channels: int
    model_channels: int
    channel_mult: tuple[int, ...]
    num_res_blocks: tuple[int, ...]
    """ResBlocks per level on the down path (the up path has one more per level)."""
    depth: tuple[int, ...]
    """Transformer blocks of each level's SpatialTransformer (0: no attention at that level)."""
    depth_middle: int
    heads: tuple[int, ...]
    """Attention heads per level (and ``heads_middle`` for the middle block)."""
    heads_middle: int
    context_dim: int
    use_linear: bool
    """SpatialTransformer projections are Linear layers (SD2, SDXL) instead of 1x1 convolutions."""
    adm_in_channels: int = 0
    """SDXL's vector conditioning ``y`` (0: none)."""
    params: int = 0
    """Parameter count (weights and buffers), for the weights' bytes."""
    hint_channels: int = 0
    """A ControlNet (cldm ``ControlNet``: the UNet's down path and middle block, a zero convolution
    after each, and a hint block reading the control image): its hint's channels. 0: a UNet."""

    @property
    def is_control(self) -> bool:
        return self.hint_channels > 0

    def __post_init__(self) -> None:
        n = len(self.channel_mult)
        if n < 1:
            raise ValueError("`channel_mult` must not be empty")
        for field in ("num_res_blocks", "depth", "heads"):
            if len(getattr(self, field)) != n:
                raise ValueError(f"`{field}` must have one entry per level ({n}), got {getattr(self, field)}")
        if self.model_channels <= 0 or self.context_dim <= 0:
            raise ValueError("`model_channels` and `context_dim` must be > 0")

    def channels(self, level: int) -> int:
        return self.model_channels * self.channel_mult[level]

    @property
    def levels(self) -> int:
        return len(self.channel_mult)

    @property
    def factor(self) -> int:
        """How much the latent shrinks down to the middle block."""
        return 2 ** (self.levels - 1)

    @property
    def cross_width(self) -> int:
        """The widths of the UNet's cross-attentions summed (one per transformer block: each
        level's on the down path, one more ResBlock's on the up path, the middle's)."""
        levels = range(self.levels)
        width = sum(self.depth[lv] * (2 * self.num_res_blocks[lv] + 1) * self.channels(lv) for lv in levels)
        return width + self.depth_middle * self.channels(self.levels - 1)

    def signature(self) -> tuple:
        """A hashable key of the architecture (the planner memory's ``model`` part)."""
        return (
            "unet",
            self.model_channels,
            self.channel_mult,
            self.num_res_blocks,
            self.depth,
            self.depth_middle,
            self.heads,
            self.context_dim,
            self.use_linear,
            self.adm_in_channels,
            self.hint_channels,
        )


def _transformer_of(block: nn.Module) -> nn.Module | None:
    for child in block.children():
        if hasattr(child, "transformer_blocks"):
            return child
    return None


def unet_spec(module: nn.Module) -> UNetSpec:
    """The :class:`UNetSpec` of a live ldm/sgm ``UNetModel`` or a cldm ``ControlNet`` (duck-typed:
    ``input_blocks``, ``middle_block``, ``model_channels``, ``channel_mult``, SpatialTransformers
    with ``transformer_blocks``; a UNet's ``output_blocks``, a ControlNet's ``input_hint_block``,
    ``zero_convs``, ``middle_block_out``). Raises ``ValueError`` naming what is missing."""
    control = hasattr(module, "input_hint_block")
    needs = ("zero_convs", "middle_block_out") if control else ("output_blocks",)
    for attr in ("input_blocks", "middle_block", "model_channels", "channel_mult", *needs):
        if not hasattr(module, attr):
            kind = "a cldm ControlNet" if control else "an ldm/sgm UNetModel"
            raise ValueError(f"not {kind}: it has no `{attr}`")
    hint = 0
    if control:
        first = next((m for m in module.input_hint_block.modules() if isinstance(m, nn.Conv2d)), None)
        hint = int(first.in_channels) if first is not None else 3
    mult = tuple(int(m) for m in module.channel_mult)
    nres = module.num_res_blocks
    nres = tuple(int(n) for n in (nres if isinstance(nres, (list, tuple)) else [nres] * len(mult)))
    blocks = list(module.input_blocks)
    depth, heads = [], []
    context_dim, use_linear = 0, False
    i = 1  # input_blocks[0] is the input convolution
    for level in range(len(mult)):
        tr = _transformer_of(blocks[i]) if i < len(blocks) else None
        if tr is None:
            depth.append(0)
            heads.append(1)
        else:
            depth.append(len(tr.transformer_blocks))
            heads.append(int(tr.transformer_blocks[0].attn1.heads))
            context_dim = int(tr.transformer_blocks[0].attn2.to_k.in_features)
            use_linear = bool(getattr(tr, "use_linear", False))
        i += nres[level] + (1 if level != len(mult) - 1 else 0)
    mid = _transformer_of(module.middle_block)
    dmid = len(mid.transformer_blocks) if mid is not None else 0
    hmid = int(mid.transformer_blocks[0].attn1.heads) if mid is not None else 1
    if mid is not None:
        context_dim = int(mid.transformer_blocks[0].attn2.to_k.in_features)
        use_linear = bool(getattr(mid, "use_linear", False))
    adm = 0
    label = getattr(module, "label_emb", None)
    if label is not None:
        first = next((m for m in label.modules() if isinstance(m, nn.Linear)), None)
        adm = int(first.in_features) if first is not None else 0
    unique = {id(t): t for t in (*module.parameters(), *module.buffers())}  # (tied tensors once)
    params = sum(t.numel() for t in unique.values())
    return UNetSpec(
        name=type(module).__name__,
        in_channels=int(module.in_channels),
        out_channels=0 if control else int(module.out_channels),
        model_channels=int(module.model_channels),
        channel_mult=mult,
        num_res_blocks=nres,
        depth=tuple(depth),
        depth_middle=dmid,
        heads=tuple(heads),
        heads_middle=hmid,
        context_dim=context_dim or 1,
        use_linear=use_linear,
        adm_in_channels=adm,
        params=params,
        hint_channels=hint,
    )


# -- closed-form parameter count (reference specs have no module to count) --------------------


def _conv(cin: int, cout: int, k: int) -> int:
    return cin * cout * k * k + cout


def _lin(cin: int, cout: int, bias: bool = True) -> int:
    return cin * cout + (cout if bias else 0)


def _resblock(cin: int, cout: int, emb: int) -> int:
    n = 2 * cin + _conv(cin, cout, 3) + _lin(emb, cout) + 2 * cout + _conv(cout, cout, 3)
    return n + (_conv(cin, cout, 1) if cin != cout else 0)


def _transformer(c: int, depth: int, ctx: int, linear: bool) -> int:
    if depth == 0:
        return 0
    inner = c
    block = (
        _lin(inner, inner, False) * 3
        + _lin(inner, inner)  # attn1
        + _lin(inner, inner, False)
        + 2 * _lin(ctx, inner, False)
        + _lin(inner, inner)  # attn2
        + _lin(inner, inner * 8)
        + _lin(inner * 4, inner)  # GEGLU feed-forward
        + 3 * 2 * inner  # three LayerNorms
    )
    proj = 2 * (_lin(c, inner) if linear else _conv(c, inner, 1))
    return 2 * c + proj + depth * block


HINT_BLOCK = ((16, 1), (16, 1), (32, 2), (32, 1), (96, 2), (96, 1), (256, 2))
"""cldm's hint block: (channels, stride) of its 3x3 convolutions (SiLU after each), then a zero
convolution to ``model_channels``; it takes the control image down 8x to the latent's size."""


def param_count(spec: UNetSpec) -> int:
    """Parameters of the openaimodel ``UNetModel`` (or cldm ``ControlNet``) that ``spec``
    describes (conv resampling, no scale-shift norm), in closed form."""
    mc = spec.model_channels
    emb = 4 * mc
    n = _lin(mc, emb) + _lin(emb, emb)
    if spec.adm_in_channels:
        n += _lin(spec.adm_in_channels, emb) + _lin(emb, emb)
    n += _conv(spec.in_channels, mc, 3)
    chans = [mc]
    ch = mc
    for lv in range(spec.levels):
        for _ in range(spec.num_res_blocks[lv]):
            n += _resblock(ch, spec.channels(lv), emb)
            ch = spec.channels(lv)
            n += _transformer(ch, spec.depth[lv], spec.context_dim, spec.use_linear)
            chans.append(ch)
        if lv != spec.levels - 1:
            n += _conv(ch, ch, 3)
            chans.append(ch)
    n += 2 * _resblock(ch, ch, emb) + _transformer(ch, spec.depth_middle, spec.context_dim, spec.use_linear)
    if spec.is_control:  # a zero convolution after each input block and the middle, the hint block
        n += sum(_conv(c, c, 1) for c in chans) + _conv(ch, ch, 1)
        hint = [spec.hint_channels, *(c for c, _ in HINT_BLOCK)]
        return n + sum(_conv(a, b, 3) for a, b in zip(hint, hint[1:])) + _conv(256, mc, 3)
    for lv in reversed(range(spec.levels)):
        for i in range(spec.num_res_blocks[lv] + 1):
            n += _resblock(ch + chans.pop(), spec.channels(lv), emb)
            ch = spec.channels(lv)
            n += _transformer(ch, spec.depth[lv], spec.context_dim, spec.use_linear)
            if lv and i == spec.num_res_blocks[lv]:
                n += _conv(ch, ch, 3)
    n += 2 * mc + _conv(mc, spec.out_channels, 3)
    return n


REFERENCES = ("sd15", "sd2", "sdxl")
CONTROLS = ("sd15", "sdxl", "sdxl-mid", "sdxl-small")
_SDXL_SMALLER = {"sdxl-mid": ((0, 0, 1), 1), "sdxl-small": ((0, 0, 0), 0)}  # (depth, depth_middle)


def reference_spec(arch: str) -> UNetSpec:
    """The UNet of a reference architecture (no weights, no ldm): ``"sd15"`` (SD1.x: context 768,
    8 heads), ``"sd2"`` (SD2.x: head dim 64, linear projections, context 1024) or ``"sdxl"``
    (channel_mult 1,2,4, transformer depth 0/2/10, context 2048, the 2816-wide vector ``y``)."""
    if arch in ("sd15", "sd1", "sd1.5"):
        spec = UNetSpec(
            "sd15", 4, 4, 320, (1, 2, 4, 4), (2, 2, 2, 2), (1, 1, 1, 0), 1, (8, 8, 8, 8), 8, 768, False
        )
    elif arch in ("sd2", "sd21", "sd2.1"):
        spec = UNetSpec(
            "sd2", 4, 4, 320, (1, 2, 4, 4), (2, 2, 2, 2), (1, 1, 1, 0), 1, (5, 10, 20, 20), 20, 1024, True
        )
    elif arch == "sdxl":
        spec = UNetSpec(
            "sdxl", 4, 4, 320, (1, 2, 4), (2, 2, 2), (0, 2, 10), 10, (5, 10, 20), 20, 2048, True, 2816
        )
    else:
        raise ValueError(f"`arch` must be one of {REFERENCES}, got {arch!r}")
    return _with_params(spec)


def reference_control(arch: str) -> UNetSpec:
    """The ControlNet of a reference architecture (cldm layout, a 3-channel control image):
    ``"sd15"`` (the UNet's down path and middle, ~361 M parameters: 1.45 GB in FP32), ``"sdxl"``
    (1251 M) or sd-webui-controlnet's smaller SDXL layouts ``"sdxl-mid"`` (one transformer block at
    the deepest level and in the middle, 271 M) and ``"sdxl-small"`` (none, 157 M)."""
    if arch in ("sd1", "sd1.5"):
        arch = "sd15"
    if arch not in CONTROLS:
        raise ValueError(f"a ControlNet's `arch` must be one of {CONTROLS}, got {arch!r}")
    depth, mid = _SDXL_SMALLER.get(arch, (None, None))
    spec = reference_spec(arch.split("-")[0])
    spec = replace(spec, name=f"controlnet-{arch}", out_channels=0, hint_channels=3)
    return _with_params(spec if depth is None else replace(spec, depth=depth, depth_middle=mid))


def _with_params(spec: UNetSpec) -> UNetSpec:
    return replace(spec, params=param_count(spec))
