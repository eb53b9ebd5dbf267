"""HyperTile and token merging as a pass runs them in the WebUI, read from the UNet itself.

The WebUI configures both before each pass's ``process_before_every_sampling`` (HyperTile in its
script's ``process`` and ``before_hr``; token merging through ``sd_models.apply_token_merging`` with
the pass's ratio, the hires one before the hires pass), so the UNet carries what the pass runs
with: each layer HyperTile wrapped keeps its parameters (``__webui_hypertile_params``: ``enabled``,
``depth``, ``tile_size``, ``swap_size``, ``layer_name``), and tomesd's patched blocks
(``ToMeBlock``) share the UNet's ``_tome_info["args"]``. :func:`read` turns that into the
estimate's :class:`lib_vram.sampling.SelfAttention`, marks the pass's findings of HyperTile and
token merging modelled only where it could (any other state: the pass is measured, as for an
extension the estimate does not know), and says when the pass must not split its batch.

IP-Adapter (sd-webui-controlnet v1.1.455) likewise: each of its units (a ``control_model`` with an
``ipadapter``, its embedding as ``image_emb``) puts a function on the ``ipadapter_hacks`` of every
cross-attention of the UNet, whose ``forward`` it replaces; read where every hacked layer carries
one per unit (PuLID's attention is another: not read).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from lib_vram.sampling import ForwardCheck, HyperTile, SelfAttention, TokenMerging

_HT_PARAMS = "__webui_hypertile_params"
_LAYER = re.compile(r"(input_blocks|output_blocks)\.(\d+)\.\d+\.transformer_blocks\.(\d+)\.attn1$")
_MIDDLE = re.compile(r"middle_block\.\d+\.transformer_blocks\.(\d+)\.attn1$")
NAMES = {"hypertile": "HyperTile", "tomesd": "token merging"}
"""The :data:`lib_vram.sampling.KNOWN` names this module reads the state of."""


def read(
    model: Any, dm: Any, check: ForwardCheck, p: Any = None
) -> tuple[SelfAttention | None, ForwardCheck, str | None]:
    """The pass's :class:`SelfAttention` (None: none is on), ``check`` with HyperTile's, token
    merging's and IP-Adapter's (on job ``p``) findings modelled only where their state was read,
    and why the pass's batch must stay whole (HyperTile drawing its tiles at random: a
    micro-batch is another forward that draws others; IP-Adapter caching its image keys/values
    at the first forward's rows; None: it may split)."""
    names = {f.name for f in check.findings}
    ht = _hypertile(model, dm) if NAMES["hypertile"] in names else None
    tm = _merging(dm) if NAMES["tomesd"] in names else None
    tokens, itemsize, hacked = _ip_adapter(p, dm) if "ControlNet" in names else ((), 4, ())
    read_ok = {NAMES["hypertile"]: ht is not None, NAMES["tomesd"]: tm is not None}
    findings = tuple(
        dataclasses.replace(f, known=dataclasses.replace(f.known, modelled=read_ok[f.name]))
        if f.name in read_ok
        else dataclasses.replace(f, known=dataclasses.replace(f.known, modelled=True, per_sample=True))
        if f.name == "ControlNet" and f.what in hacked
        else f
        for f in check.findings
    )
    whole = None
    if ht is not None and ht.swap > 1:
        whole = f"HyperTile draws its tiles at random for each forward (swap size {ht.swap})"
    if tokens:
        whole = whole or "IP-Adapter keeps the image keys/values of the pass's first forward (its rows)"
    active = ht is not None or tm is not None or tokens
    return SelfAttention(ht, tm, tokens, itemsize) if active else None, ForwardCheck(findings), whole


def _ip_adapter(p: Any, dm: Any) -> tuple[tuple[int, ...], int, tuple[str, ...]]:
    """IP-Adapter's units on ``dm`` (see the module docstring): their image tokens, the itemsize
    of their cached keys/values and the findings of their replaced cross-attentions; nothing
    where its state is not as read there."""
    from lib_vram.residency.controlnet import hook_of

    params = getattr(hook_of(p, dm), "control_params", None) or ()
    ips = [m for q in params if hasattr(m := getattr(q, "control_model", None), "ipadapter")]
    hacked = [(n, m) for n, m in dm.named_modules() if getattr(m, "ipadapter_hacks", None)]
    try:
        if not ips or not hacked or any(len(m.ipadapter_hacks) != len(ips) for _, m in hacked):
            return (), 4, ()
        if any(getattr(m.ipadapter, "is_pulid", False) for m in ips):
            return (), 4, ()
        tokens = tuple(int(m.image_emb.cond_emb.shape[-2]) for m in ips)
        itemsize = next(m.ipadapter.ip_layers.parameters()).element_size()
    except (AttributeError, IndexError, StopIteration, TypeError):
        return (), 4, ()
    return tokens, itemsize, tuple(f"forward of {n} replaced" for n, _ in hacked)


def _hypertile(model: Any, dm: Any) -> HyperTile | None:
    """HyperTile's state on ``dm`` where every enabled layer is one its rule wraps at its depth
    and all share one tile size and swap size; else None."""
    on = [p for m in dm.modules() if (p := getattr(m, _HT_PARAMS, None)) is not None and p.enabled]
    if not on:
        return None
    try:
        tiles = {int(p.tile_size) for p in on}
        swaps = {int(p.swap_size) for p in on}
        depths = [int(p.depth) for p in on]
        if len(tiles) != 1 or len(swaps) != 1:
            return None
        ht = HyperTile(tiles.pop(), max(depths), swaps.pop(), bool(getattr(model, "is_sdxl", False)))
    except (TypeError, ValueError, AttributeError):
        return None
    for p, depth in zip(on, depths):
        name = str(getattr(p, "layer_name", ""))
        if (m := _LAYER.search(name)) is not None:
            site, block = ("input" if m[1] == "input_blocks" else "output", int(m[2])), int(m[3])
        elif (m := _MIDDLE.search(name)) is not None:
            site, block = ("middle", 0), int(m[1])
        else:
            return None
        if ht.depth_of(site, block) != depth:
            return None
    return ht


def _merging(dm: Any) -> TokenMerging | None:
    """tomesd's arguments on ``dm`` where its blocks are patched the WebUI's way (self-attention
    only, no random destinations); else None."""
    if not any(type(m).__name__ == "ToMeBlock" for m in dm.modules()):
        return None
    args = (getattr(dm, "_tome_info", None) or {}).get("args") or {}
    if not args.get("merge_attn", False) or args.get("merge_crossattn") or args.get("merge_mlp"):
        return None
    if args.get("use_rand", True):
        return None  # (random destinations: per forward, like HyperTile's draws; not the WebUI's)
    try:
        ratio, down = float(args["ratio"]), int(args["max_downsample"])
        return TokenMerging(ratio, down, int(args["sx"]), int(args["sy"]))
    except (KeyError, TypeError, ValueError):
        return None
