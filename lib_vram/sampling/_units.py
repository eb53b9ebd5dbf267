"""The UNet's units, in the order its forward runs them, and their bytes: what
:func:`~._stream_plan.plan_stream` keeps resident or streams."""

from __future__ import annotations

import torch

UNIT_PARTS = 64
"""A unit larger than 1/64 of the UNet is split into its children (in the order the forward calls
them) where the layout allows: SDXL's 10-deep transformer stacks stream one transformer block at
a time instead of 760 MiB at once, which keeps the streaming buffers small."""


def unet_units(unet: torch.nn.Module, parts: int = UNIT_PARTS) -> list[tuple[str, torch.nn.Module]]:
    """The units of an ldm/sgm ``UNetModel`` in the order its forward runs them: the top-level
    ones (``time_embed``, ``label_emb``, ``input_blocks.i``, ``middle_block``, ``output_blocks.i``,
    ``out``), each larger than ``1/parts`` of the UNet split into its weighted children in their
    registration order (ldm's and sgm's blocks call their children in that order), recursively;
    a container that is never called (``ModuleList``) is always split; a module with weights of
    its own stays whole. ``parts=1``: the top level only. A cldm ``ControlNet`` (``input_hint_block``,
    ``zero_convs``, ``middle_block_out``; issue 42) has the same kind of units, in its forward's
    order: the hint block, each input block with its zero convolution, the middle and its zero
    convolution. Duck-typed by attribute names (nothing of ldm, sgm or cldm is imported); one clear
    error when ``unet`` does not have the layout."""
    if not isinstance(unet, torch.nn.Module):
        raise ValueError(f"`unet` must be a torch.nn.Module, got {type(unet).__name__}")
    if not isinstance(parts, int) or not 1 <= parts <= 4096:
        raise ValueError(f"`parts` must be an integer in 1..4096, got {parts!r}")
    control = all(hasattr(unet, n) for n in ("input_hint_block", "zero_convs", "middle_block_out"))
    names = ("time_embed", "input_blocks", "middle_block") + (() if control else ("output_blocks", "out"))
    missing = [n for n in names if not hasattr(unet, n)]
    if missing:
        raise ValueError(
            f"`unet` must be an ldm/sgm UNetModel (time_embed, input_blocks, middle_block, "
            f"output_blocks, out); {type(unet).__name__} lacks {', '.join(missing)}"
        )
    top: list[tuple[str, torch.nn.Module]] = [("time_embed", unet.time_embed)]
    if isinstance(getattr(unet, "label_emb", None), torch.nn.Module):
        top.append(("label_emb", unet.label_emb))
    if control:
        top.append(("input_hint_block", unet.input_hint_block))
        for i, (m, z) in enumerate(zip(unet.input_blocks, unet.zero_convs)):
            top += [(f"input_blocks.{i}", m), (f"zero_convs.{i}", z)]
        top += [("middle_block", unet.middle_block), ("middle_block_out", unet.middle_block_out)]
    else:
        top += [(f"input_blocks.{i}", m) for i, m in enumerate(unet.input_blocks)]
        top.append(("middle_block", unet.middle_block))
        top += [(f"output_blocks.{i}", m) for i, m in enumerate(unet.output_blocks)]
        top.append(("out", unet.out))
    if parts == 1:
        return top
    limit = sum(module_bytes(m) for _, m in top) // parts
    out: list[tuple[str, torch.nn.Module]] = []

    def visit(name: str, m: torch.nn.Module) -> None:
        own = any(t is not None for t in (*m._parameters.values(), *m._buffers.values()))
        kids = [(f"{name}.{n}", c) for n, c in m.named_children() if module_bytes(c) > 0]
        never_called = isinstance(m, (torch.nn.ModuleList, torch.nn.ModuleDict))
        if kids and not own and (never_called or module_bytes(m) > limit):
            for n, c in kids:
                visit(n, c)
        else:
            out.append((name, m))

    for name, m in top:
        visit(name, m)
    return out


def module_bytes(m: torch.nn.Module) -> int:
    return sum(nbytes(getattr(o, n)) for o, n, _ in tensors(m))


def tensors(module: torch.nn.Module) -> list[tuple[torch.nn.Module, str, bool]]:
    """(owner, name, is_parameter) of every parameter and buffer under ``module``."""
    out = []
    for owner in module.modules():
        for name, p in owner._parameters.items():
            if p is not None:
                out.append((owner, name, True))
        for name, b in owner._buffers.items():
            if b is not None:
                out.append((owner, name, False))
    return out


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def unit_bytes(unet: torch.nn.Module, parts: int = UNIT_PARTS) -> list[tuple[str, int]]:
    """(name, bytes of its parameters and buffers) of each unit of ``unet`` (:func:`unet_units`),
    in forward order."""
    return [(name, module_bytes(m)) for name, m in unet_units(unet, parts)]
