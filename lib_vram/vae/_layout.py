"""Reading a VAE encoder/decoder module into a plain description the tile engine walks.

Layouts are recognised by attribute names only (no ``ldm``/``sgm``/``diffusers`` import):

* **ldm / sgm** (SD1/SD2, SDXL): ``conv_in``, ``mid.block_1``/``attn_1``/``block_2``,
  ``up[i].block``/``attn``/``upsample`` (decoder; processed from the last index to 0) or
  ``down[i].block``/``attn``/``downsample`` (encoder), ``norm_out``, ``conv_out``; decoder flags
  ``give_pre_end`` and ``tanh_out``.
* **diffusers** (``AutoencoderKL.decoder``/``encoder``; Forge): ``conv_in``,
  ``mid_block.resnets``/``attentions``, ``up_blocks[i].resnets``/``upsamplers`` or
  ``down_blocks[i].resnets``/``downsamplers``, ``conv_norm_out``, ``conv_act``, ``conv_out``.

ResNet blocks may mix the naming of both (``nin_shortcut``/``conv_shortcut``), attention blocks
are ldm-style (``norm``, 1x1 convs ``q``/``k``/``v``/``proj_out``) or diffusers-style
(``group_norm``, linear ``to_q``/``to_k``/``to_v``/``to_out[0]``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn


class UnsupportedLayout(ValueError):
    """The module does not have a layout the tile engine knows; the reason says what is missing."""


@dataclass(frozen=True)
class Resnet:
    norm1: nn.GroupNorm
    conv1: nn.Conv2d
    norm2: nn.GroupNorm
    conv2: nn.Conv2d
    shortcut: nn.Conv2d | None
    act: nn.Module | None
    """Activation module (diffusers ``nonlinearity``); ``None`` means SiLU."""
    out_scale: float = 1.0
    in_channels: int = 0
    out_channels: int = 0


@dataclass(frozen=True)
class Attention:
    norm: nn.GroupNorm
    q: nn.Module
    k: nn.Module
    v: nn.Module
    out: nn.Module
    linear: bool
    """True for diffusers' ``nn.Linear`` projections on (B, N, C); False for ldm 1x1 convs."""
    heads: int = 1
    scale: float | None = None
    residual: bool = True
    rescale: float = 1.0
    channels: int = 0


@dataclass(frozen=True)
class Level:
    """One resolution level of the tiled path: ResNets then an optional resampling conv."""

    blocks: tuple[Resnet, ...]
    resample: nn.Conv2d | None
    """Decoder: conv after nearest x2; encoder: stride-2 conv after a (0,1,0,1) zero pad."""
    resample_kind: str | None
    """``"up"`` (nearest x2, then ``resample`` if any), ``"down"`` or ``None``."""


@dataclass(frozen=True)
class VAESpec:
    kind: str
    """``"decoder"`` or ``"encoder"``."""
    layout: str
    """``"ldm"`` (also sgm) or ``"diffusers"``."""
    conv_in: nn.Conv2d
    mid: tuple[Resnet | Attention, ...]
    levels: tuple[Level, ...]
    """In processing order."""
    norm_out: nn.GroupNorm
    act_out: nn.Module | None
    conv_out: nn.Conv2d
    tanh_out: bool = False
    give_pre_end: bool = False
    in_channels: int = 0
    out_channels: int = 0
    mid_channels: int = 0
    notes: list[str] = field(default_factory=list)

    @property
    def factor(self) -> int:
        """Spatial factor between image and latent (8 for SD)."""
        return 2 ** sum(1 for lv in self.levels if lv.resample_kind is not None)


_RESNET_PARTS = frozenset(
    ("norm1", "conv1", "norm2", "conv2", "dropout", "nin_shortcut", "conv_shortcut", "temb_proj")
    + ("time_emb_proj", "nonlinearity", "swish")
)
"""Submodules a ResNet block may have (ldm/sgm, diffusers, Forge's ``backend.nn.vae``, whose block
holds its SiLU as a ``swish`` child). The engine computes the block from these parts; a block with
more (e.g. later sgm's ``VideoResBlock`` and its ``time_stack``) does more than the engine would,
so it is refused instead of run wrongly."""
_LDM_ATTN_PARTS = frozenset(("norm", "q", "k", "v", "proj_out"))


def _no_extra_parts(mod: nn.Module, known: frozenset[str], what: str) -> None:
    extra = sorted(n for n, _ in mod.named_children() if n not in known)
    if extra:
        raise UnsupportedLayout(
            f"{what}: {type(mod).__name__} has parts the engine does not compute: {', '.join(extra)}"
        )


def _need(obj: object, name: str, what: str) -> object:
    if not hasattr(obj, name) or getattr(obj, name) is None:
        raise UnsupportedLayout(f"{what}: no `{name}`")
    return getattr(obj, name)


def _gn(mod: object, what: str) -> nn.GroupNorm:
    if not isinstance(mod, nn.GroupNorm):
        raise UnsupportedLayout(f"{what}: expected GroupNorm, got {type(mod).__name__}")
    return mod


def _conv(mod: object, what: str, *, kernel: tuple[int, ...] = (1, 3), stride: int = 1) -> nn.Conv2d:
    if not isinstance(mod, nn.Conv2d):
        raise UnsupportedLayout(f"{what}: expected Conv2d, got {type(mod).__name__}")
    k = mod.kernel_size
    if k[0] != k[1] or k[0] not in kernel or mod.stride != (stride, stride) or mod.dilation != (1, 1):
        raise UnsupportedLayout(f"{what}: unsupported conv geometry k={k} s={mod.stride}")
    if mod.groups != 1:
        raise UnsupportedLayout(f"{what}: grouped conv")
    _no_extra_parts(mod, frozenset(), what)  # e.g. later sgm's AE3DConv: a Conv2d with a Conv3d inside
    if stride == 1 and mod.padding != (k[0] // 2, k[0] // 2):
        raise UnsupportedLayout(f"{what}: conv padding {mod.padding} is not 'same'")
    if stride == 2 and mod.padding != (0, 0):
        raise UnsupportedLayout(f"{what}: stride-2 conv with padding {mod.padding}")
    return mod


def _resnet(blk: nn.Module, what: str) -> Resnet:
    if getattr(blk, "upsample", None) is not None or getattr(blk, "downsample", None) is not None:
        raise UnsupportedLayout(f"{what}: resampling inside a ResNet block")
    _no_extra_parts(blk, _RESNET_PARTS, what)
    ten = getattr(blk, "time_embedding_norm", "default")
    if ten not in ("default", "group", None):
        raise UnsupportedLayout(f"{what}: time_embedding_norm={ten!r}")
    norm1 = _gn(_need(blk, "norm1", what), what + ".norm1")
    conv1 = _conv(_need(blk, "conv1", what), what + ".conv1", kernel=(3,))
    norm2 = _gn(_need(blk, "norm2", what), what + ".norm2")
    conv2 = _conv(_need(blk, "conv2", what), what + ".conv2", kernel=(3,))
    shortcut = None
    for name in ("nin_shortcut", "conv_shortcut"):
        mod = getattr(blk, name, None)
        if isinstance(mod, nn.Conv2d):
            shortcut = _conv(mod, f"{what}.{name}")
            break
    cin, cout = conv1.in_channels, conv2.out_channels
    if shortcut is None and cin != cout:
        raise UnsupportedLayout(f"{what}: channels change without a shortcut conv")
    act = getattr(blk, "nonlinearity", None)
    if act is not None and not isinstance(act, nn.Module):
        act = None  # ldm has a plain function named `nonlinearity` at module level, not on the block
    swish = getattr(blk, "swish", None)
    # Forge: ``nn.SiLU(inplace=True)`` applied where ldm applies its ``nonlinearity``; the engine
    # computes SiLU itself (never in place on a tensor it still needs).
    if swish is not None and (type(swish) is not nn.SiLU or act is not None):
        raise UnsupportedLayout(f"{what}: activation `swish` is {type(swish).__name__}, not SiLU")
    scale = float(getattr(blk, "output_scale_factor", 1.0) or 1.0)
    return Resnet(norm1, conv1, norm2, conv2, shortcut, act, scale, cin, cout)


def _attention(mod: nn.Module | None, what: str) -> Attention | None:
    if mod is None or isinstance(mod, nn.Identity):
        return None
    if all(hasattr(mod, n) for n in ("q", "k", "v", "proj_out", "norm")):
        _no_extra_parts(mod, _LDM_ATTN_PARTS, what)
        norm = _gn(mod.norm, what + ".norm")
        q = _conv(mod.q, what + ".q", kernel=(1,))
        k, v, out = (_conv(getattr(mod, n), f"{what}.{n}", kernel=(1,)) for n in ("k", "v", "proj_out"))
        return Attention(norm=norm, q=q, k=k, v=v, out=out, linear=False, channels=q.in_channels)
    if all(hasattr(mod, n) for n in ("to_q", "to_k", "to_v", "to_out", "group_norm")):
        if getattr(mod, "spatial_norm", None) is not None:
            raise UnsupportedLayout(f"{what}: spatial norm")
        if getattr(mod, "norm_q", None) is not None or getattr(mod, "norm_k", None) is not None:
            raise UnsupportedLayout(f"{what}: q/k norm")
        norm = _gn(mod.group_norm, what + ".group_norm")
        out = mod.to_out[0] if isinstance(mod.to_out, (nn.ModuleList, nn.Sequential)) else mod.to_out
        for name, m in (("to_q", mod.to_q), ("to_k", mod.to_k), ("to_v", mod.to_v), ("to_out", out)):
            if not isinstance(m, nn.Linear):
                raise UnsupportedLayout(f"{what}.{name}: expected Linear, got {type(m).__name__}")
        return Attention(
            norm=norm,
            q=mod.to_q,
            k=mod.to_k,
            v=mod.to_v,
            out=out,
            linear=True,
            heads=int(getattr(mod, "heads", 1)),
            scale=float(mod.scale) if getattr(mod, "scale", None) is not None else None,
            residual=bool(getattr(mod, "residual_connection", True)),
            rescale=float(getattr(mod, "rescale_output_factor", 1.0)),
            channels=mod.to_q.in_features,
        )
    raise UnsupportedLayout(f"{what}: unknown attention block {type(mod).__name__}")


def _no_attn(attns: object, what: str) -> None:
    if attns is None:
        return
    for a in attns:  # type: ignore[attr-defined]
        if a is not None and not isinstance(a, nn.Identity):
            raise UnsupportedLayout(f"{what}: attention outside the mid block cannot be tiled")


def _up_conv(up: nn.Module | None, what: str) -> tuple[nn.Conv2d | None, str | None]:
    if up is None:
        return None, None
    if getattr(up, "use_conv_transpose", False):
        raise UnsupportedLayout(f"{what}: transposed-conv upsampling")
    if getattr(up, "norm", None) is not None:
        raise UnsupportedLayout(f"{what}: normalised upsampling")
    if getattr(up, "interpolate", True) is False:
        raise UnsupportedLayout(f"{what}: upsampler without interpolation")
    conv = getattr(up, "conv", None) if getattr(up, "with_conv", getattr(up, "use_conv", True)) else None
    if conv is None and hasattr(up, "Conv2d_0") and getattr(up, "use_conv", False):
        conv = up.Conv2d_0
    if conv is not None:
        conv = _conv(conv, what + ".conv", kernel=(3,))
    return conv, "up"


def _down_conv(down: nn.Module | None, what: str) -> tuple[nn.Conv2d | None, str | None]:
    if down is None:
        return None, None
    use_conv = getattr(down, "with_conv", getattr(down, "use_conv", False))
    if not use_conv:
        raise UnsupportedLayout(f"{what}: average-pool downsampling")
    pad = getattr(down, "padding", 0)
    if pad not in (0, None):
        raise UnsupportedLayout(f"{what}: downsampler with padding={pad}")
    if getattr(down, "norm", None) is not None:
        raise UnsupportedLayout(f"{what}: normalised downsampling")
    return _conv(_need(down, "conv", what), what + ".conv", kernel=(3,), stride=2), "down"


def _layout_name(module: nn.Module) -> str:
    if hasattr(module, "mid") and hasattr(module, "norm_out"):
        return "ldm"
    if hasattr(module, "mid_block") and hasattr(module, "conv_norm_out"):
        return "diffusers"
    raise UnsupportedLayout(f"{type(module).__name__}: neither ldm/sgm nor diffusers VAE layout")


def _mid(module: nn.Module, layout: str, what: str) -> tuple[Resnet | Attention, ...]:
    items: list[Resnet | Attention] = []
    if layout == "ldm":
        mid = module.mid
        items.append(_resnet(_need(mid, "block_1", what), "mid.block_1"))
        attn = _attention(getattr(mid, "attn_1", None), "mid.attn_1")
        if attn is not None:
            items.append(attn)
        items.append(_resnet(_need(mid, "block_2", what), "mid.block_2"))
        return tuple(items)
    mb = module.mid_block
    resnets = list(_need(mb, "resnets", "mid_block"))  # type: ignore[call-overload]
    attns = list(getattr(mb, "attentions", None) or [])
    if not resnets:
        raise UnsupportedLayout("mid_block: no resnets")
    items.append(_resnet(resnets[0], "mid_block.resnets.0"))
    for i, r in enumerate(resnets[1:]):
        a = _attention(attns[i] if i < len(attns) else None, f"mid_block.attentions.{i}")
        if a is not None:
            items.append(a)
        items.append(_resnet(r, f"mid_block.resnets.{i + 1}"))
    return tuple(items)


def _levels(module: nn.Module, layout: str, what: str, *, up: bool) -> tuple[Level, ...]:
    """The decoder's levels (``up``; in processing order, which ldm registers reversed) or the
    encoder's."""
    ldm = layout == "ldm"
    name = ("up" if up else "down") if ldm else ("up_blocks" if up else "down_blocks")
    seq = _need(module, name, what)
    pairs = [(i, seq[i]) for i in reversed(range(len(seq)))] if ldm and up else enumerate(seq)  # type: ignore
    resample = _up_conv if up else _down_conv
    levels = []
    for i, lv in pairs:
        at = f"{name}.{i}"
        if ldm:
            _no_attn(getattr(lv, "attn", None), at)
            blocks = tuple(_resnet(b, f"{at}.block.{j}") for j, b in enumerate(lv.block))
            sampler = "upsample" if up else "downsample"
            conv, kind = resample(getattr(lv, sampler, None), f"{at}.{sampler}")
        else:
            _no_attn(getattr(lv, "attentions", None), at)
            blocks = tuple(_resnet(b, f"{at}.resnets.{j}") for j, b in enumerate(lv.resnets))
            samplers = "upsamplers" if up else "downsamplers"
            some = getattr(lv, samplers, None)
            if some is not None and len(some) > 1:
                raise UnsupportedLayout(f"{at}: several {samplers}")
            conv, kind = resample(some[0] if some else None, f"{at}.{samplers}.0")
        levels.append(Level(blocks, conv, kind))
    return tuple(levels)


def _out(module: nn.Module, layout: str) -> tuple[nn.GroupNorm, nn.Module | None]:
    """``norm_out`` and the activation after it (None: SiLU)."""
    if layout == "ldm":
        return _gn(module.norm_out, "norm_out"), None
    return _gn(module.conv_norm_out, "conv_norm_out"), getattr(module, "conv_act", None)


def _describe(module: nn.Module, kind: str) -> VAESpec:
    layout = _layout_name(module)
    what = type(module).__name__
    dec = kind == "decoder"
    conv_in = _conv(_need(module, "conv_in", what), "conv_in", kernel=(1, 3))
    mid = _mid(module, layout, what) if dec else ()  # (checked in the order the forward runs)
    levels = _levels(module, layout, what, up=dec)
    norm_out, act_out = _out(module, layout)
    mid = mid if dec else _mid(module, layout, what)
    conv_out = _conv(_need(module, "conv_out", what), "conv_out", kernel=(1, 3))
    ldm_dec = dec and layout == "ldm"
    return VAESpec(
        kind=kind, layout=layout, conv_in=conv_in, mid=mid, levels=levels, norm_out=norm_out, act_out=act_out,
        conv_out=conv_out, tanh_out=ldm_dec and bool(getattr(module, "tanh_out", False)),
        give_pre_end=ldm_dec and bool(getattr(module, "give_pre_end", False)),
        in_channels=conv_in.in_channels, out_channels=conv_out.out_channels,
        mid_channels=conv_in.out_channels if dec else norm_out.num_channels,
    )  # fmt: skip


def decoder_spec(module: nn.Module) -> VAESpec:
    """Describe a VAE decoder; raises :class:`UnsupportedLayout` with the reason."""
    return _describe(module, "decoder")


def encoder_spec(module: nn.Module) -> VAESpec:
    """Describe a VAE encoder; raises :class:`UnsupportedLayout` with the reason."""
    return _describe(module, "encoder")


def signature(spec: VAESpec) -> tuple:
    """What the memory of a pass depends on, besides the input: layout, kind, channels per block
    and resampling per level, mid-block composition. Two VAEs of one architecture (SD 1.x and
    SDXL's, or two finetunes) share it; that is what :mod:`lib_vram.planning.planner` learns under."""
    levels = tuple(
        (tuple((b.in_channels, b.out_channels) for b in lv.blocks), lv.resample_kind) for lv in spec.levels
    )
    mid = tuple(type(m).__name__ for m in spec.mid)
    return (spec.kind, spec.layout, spec.in_channels, spec.out_channels, spec.mid_channels, levels, mid)
