"""sd-webui-controlnet's control models: counted in the sampling plan, placed by the one owner.

What VRAM Guard does with them, and why: docs/sampling.md, "ControlNet". Host-free like the rest
of the package: ControlNet's objects are read by attribute names (nothing of the WebUI or of the
extension is imported); the WebUI adapter passes them in. Its ``UnetHook`` (the ControlNet
script's ``latest_network``) replaces the UNet's ``forward`` and keeps the enabled units as
``control_params``; each unit's ``control_model`` (a ``PlugableControlModel``, with the cldm
``ControlNet`` as ``.control_model``) runs at every UNet forward.

While VRAM Guard guards a sampling pass (:class:`Controls`, used by ``SamplingGuard``) the pass's
units (:func:`units`) are in its plan (:class:`lib_vram.sampling.Step`'s ``controls``; a unit that
cannot split its batch: :func:`whole_batch`), join the owner and wake on the card for the pass,
ControlNet's own moves held until its end. A unit whose model is not a cldm ControlNet (a T2I
adapter, a ControlLoRA) is placed by its bytes; its activations are not counted (a note says so
once). IP-Adapter is no unit here: sd-webui-controlnet keeps its weights in host memory; its
per-step cost is in the estimate (:mod:`lib_vram.webui.selfattn` reads it). On the emulated card
:func:`emulate_moves` makes ControlNet's moves count as a GPU would see them.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Iterable
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

import torch

from lib_vram.core import emulate
from lib_vram.residency import CARD, HOST, Model
from lib_vram.residency._modules import ModuleMover, admit, nbytes_of, tensors_of

logger = logging.getLogger(__name__)


@dataclass
class Unit:
    """One enabled ControlNet unit of the job."""

    index: int
    param: Any
    """ControlNet's ``ControlParams``."""
    module: torch.nn.Module
    """``param.control_model`` (what ControlNet moves)."""
    spec: Any
    """Its :class:`~lib_vram.sampling.UNetSpec` (None: not a cldm ControlNet)."""

    @property
    def name(self) -> str:
        return f"ControlNet unit {self.index}"

    def used_in(self, hires: bool) -> bool:
        """Whether ControlNet runs it in the first pass (``hires`` False) or the hires pass."""
        off = getattr(self.param, "disabled_by_hr_option", None)
        try:
            return not (callable(off) and off(hires))
        except (AssertionError, AttributeError, TypeError):
            return True


def hook_of(p: Any, unet: Any) -> Any:
    """ControlNet's ``UnetHook`` on ``unet`` for this job (the ControlNet script's
    ``latest_network`` whose ``model`` is the UNet and which has units), or None."""
    runner = getattr(p, "scripts", None)
    for script in getattr(runner, "alwayson_scripts", None) or ():
        net = getattr(script, "latest_network", None)
        if net is not None and getattr(net, "model", None) is unet and getattr(net, "control_params", None):
            return net
    return None


def units(p: Any, unet: Any) -> list[Unit]:
    """The job's enabled ControlNet units with a model VRAM Guard may place (see the module
    docstring); [] without ControlNet."""
    from lib_vram.sampling import unet_spec

    net = hook_of(p, unet)
    out: list[Unit] = []
    for i, param in enumerate(getattr(net, "control_params", None) or ()):
        module = getattr(param, "control_model", None)
        if not isinstance(module, torch.nn.Module):
            continue
        if getattr(module, "disable_memory_management", False) and not getattr(module, "_vram_guard", False):
            continue  # (IP-Adapter: ControlNet keeps it in host memory; so do we)
        inner = getattr(module, "control_model", module)
        try:
            spec = unet_spec(inner)
        except (ValueError, AttributeError, TypeError):
            spec = None
        out.append(Unit(i, param, module, spec if spec is not None and spec.is_control else None))
    return out


_LATENT_PREPROCESSORS = ("colorfix", "inpaint_only")
"""ControlNet encodes the control image to a latent at the first forward's batch and keeps it."""


def whole_batch(p: Any, unet: Any) -> str | None:
    """Why ControlNet's hook on ``unet`` cannot run a micro-batch (None: it can; also without
    ControlNet). ControlNet's hook adds each unit's control image to every row of the forward's
    batch, so a micro-batch's rows get the residuals they get in the whole batch, unless a unit
    has a control image per sample (a batch of control images, AnimateDiff: the hook does not
    split it with the rows) or caches a latent of the control image at the first forward's batch
    (reference, colorfix and inpaint_only preprocessors)."""
    net = hook_of(p, unet)
    for i, param in enumerate(getattr(net, "control_params", None) or ()):
        for name in ("hint_cond", "hr_hint_cond"):
            hint = getattr(param, name, None)
            if isinstance(hint, torch.Tensor) and hint.dim() == 4 and hint.shape[0] > 1:
                return f"ControlNet unit {i} has a control image per sample ({hint.shape[0]})"
        kind = getattr(getattr(param, "control_model_type", None), "name", "")
        pre = getattr(param, "preprocessor", None)
        pre = str(pre.get("name", "")) if isinstance(pre, dict) else ""
        if kind == "AttentionInjection" or any(k in pre for k in _LATENT_PREPROCESSORS):
            return f"ControlNet unit {i} ({pre or kind}) keeps a latent of the whole batch"
    return None


def distinct(found: Iterable[Unit]) -> list[Unit]:
    """One unit per model (units of one cached model share its weights; the plan counts them once
    and each forward's activations as one: they run one after the other)."""
    first: dict[int, Unit] = {}
    for unit in found:
        first.setdefault(_key(unit.module), unit)
    return list(first.values())


class Controls:
    """The control models of one job in the owner (see the module docstring)."""

    def __init__(self, cards: Any, job: Any) -> None:
        self.cards = cards
        self.job = job
        self.models: dict[int, Model] = {}
        """:func:`_key` of a unit's module -> its model in the owner."""
        self.units: list[Unit] = []
        """The job's units found at the last pass."""

    def join(self, found: Iterable[Unit]) -> list[Model]:
        """Each unit's model in the owner (once per job), in host memory until a pass wakes it."""
        found = list(found)
        for unit in found:
            key = _key(unit.module)  # (units of one cached model share its weights: one model)
            if key not in self.models:
                self.models[key] = self._join(unit)
        return self.of(found)

    def of(self, found: Iterable[Unit]) -> list[Model]:
        """The owner's models of these units (each once)."""
        models = (self.models.get(_key(unit.module)) for unit in found)
        return list(dict.fromkeys(m for m in models if m is not None))

    def _join(self, unit: Unit) -> Model:
        cards = self.cards
        device, card = cards.device(), cards.card()
        tensors = tensors_of([unit.module])
        first = tensors[0] if tensors else None
        on_card = first is not None and first.device.type == device.type and device.type != "cpu"
        if card is not None:
            for t in tensors:  # (loaded inside the job: host memory on a GPU, not the card's)
                card.to_host(t)
        mover = ModuleMover(unit.module, device, card)
        dtype = str(first.dtype).replace("torch.", "") if first is not None else ""
        if card is not None and _ON_CARD.pop(_key(unit.module), None) is not None:
            on_card = True  # (ControlNet's fullvram() put it there in an earlier job: the owner's now)
        model = Model(unit.name, "control", nbytes_of(tensors), mover, dtype=dtype, home=HOST)
        model.where = CARD if on_card else HOST
        mover.on_use = lambda: cards.owner.use(model, why=f"the {unit.name} is needed now")
        if model.where == HOST:
            mover.hook()
        cards.owner.join(model)
        if unit.spec is None:
            self.job.warn_once(
                f"controlnet-unknown-{unit.index}",
                f"VRAM Guard: {unit.name} is not a ControlNet VRAM Guard can size "
                f"({type(getattr(unit.module, 'control_model', unit.module)).__name__}): its weights are "
                "placed, its activations are not in the plan",
            )
        return model

    def plan_pass(self, p: Any, unet: Any, hires: bool) -> tuple[list[Unit], tuple, int, int]:
        """A pass's ControlNet: the units it runs, their specs for the plan (one per model), the
        bytes of units VRAM Guard cannot size (placed by their bytes) and the bytes of the job's
        control models on the card now (free for the pass). Joins the job's units first."""
        self.units = units(p, unet)
        used = [u for u in self.units if u.used_in(hires)]
        on_card = sum(m.card_bytes for m in self.join(self.units))
        specs = tuple(u.spec for u in distinct(used) if u.spec is not None)
        unsized = sum(nbytes_of(tensors_of([u.module])) for u in distinct(used) if u.spec is None)
        return used, specs, unsized, on_card

    def start_pass(
        self, used: Iterable[Unit], stage: str, stack: ExitStack, streamed: Iterable[Unit] = ()
    ) -> list[Model]:
        """The pass starts: the job's other control models go home, ControlNet's own moves are
        held (for every unit: its hook moves them all), the pass's models wake on the card (room
        made first) or, those of ``streamed``, stream block by block from host memory (:func:`stream`),
        and go home when ``stack`` closes. Returns the pass's models (busy while a forward runs:
        :func:`while_running`)."""
        owner, what = self.cards.owner, stage.replace("_", " ")
        mine, flow = self.of(used), self.of(streamed)
        away = [m for m in self.models.values() if m not in mine or m in flow]
        owner.send_home(away, f"{what} does not use it")
        self.hold(self.units, stack)
        # (first: a wake that runs out of memory leaves those woken before it going home)
        stack.callback(owner.send_home, list(mine), f"{what} is done")  # (also one found there)
        for unit in distinct(streamed):  # (a streamed model is not woken: Owner.use skips it)
            model = self.models[_key(unit.module)]
            stack.callback(owner.streams(model, 0, stage, f"{what} does not fit with it on the card"))
            stream(getattr(unit.module, "control_model", unit.module), self.cards, model.name, stack)
        for m in mine:
            owner.use(m, stage, why=f"{what} runs it")
        return mine

    def hold(self, found: Iterable[Unit], stack: ExitStack) -> None:
        """ControlNet's own moves of these models stop until ``stack`` closes (the pass's end)."""
        for unit in found:
            module = unit.module
            d = module.__dict__
            saved = {k: d[k] for k in _HELD if k in d}
            d.update(disable_memory_management=True, _vram_guard=True, to=_held(module))
            stack.callback(_restore, module, saved)

    def release(self) -> None:
        """The job is over: every control model home (host memory) and out of the owner."""
        owner = self.cards.owner
        models, self.models = list(self.models.values()), {}
        try:
            owner.send_home(models, "the job is over")
        finally:
            for model in models:
                model.mover.unhook()
                owner.leave(model)


def stream(net: torch.nn.Module, cards: Any, name: str, stack: ExitStack) -> None:
    """A cldm ``ControlNet`` in host memory streams through the card block by block for the pass
    (the UNet's streamer over its units, :func:`lib_vram.sampling.unet_units`: each comes to the
    card for its forward, the next one copied in meanwhile); when ``stack`` closes its weights are
    in host memory again (nothing moves back to the card)."""
    from lib_vram.sampling import StreamedUNet, unet_units

    s = StreamedUNet(net, [n for n, _ in unet_units(net)], cards.device(), card=cards.card(), adopt_host=True)
    s.__enter__()

    def done() -> None:
        st = s.stats
        logger.info(
            "VRAM Guard: %s streamed for %d forward(s): %.0f MiB copied to the card",
            name, st.forwards, st.bytes_in / (1 << 20),
        )  # fmt: skip
        s.release_to_host()

    stack.callback(done)


def while_running(owner: Any, models: list[Model], forward: Any) -> Any:
    """``forward`` with ``models`` busy in ``owner`` while it runs (between the pass's forwards a
    wake, such as the hires conditioning's, may send them home; they wake again when used)."""

    def run(*args: Any, **kwargs: Any) -> Any:
        with owner.computing(models):
            return forward(*args, **kwargs)

    return run


_HELD = ("disable_memory_management", "to", "_vram_guard")
"""The attributes :meth:`Controls.hold` sets on a control model (and puts back)."""


def _held(module: torch.nn.Module) -> Any:
    def to(*args: Any, **kwargs: Any) -> torch.nn.Module:
        """ControlNet's move of a model VRAM Guard places: a no-op for the pass (a dtype change
        still applies)."""
        dtype = kwargs.get("dtype") or next((a for a in args if isinstance(a, torch.dtype)), None)
        if dtype is not None:
            torch.nn.Module.to(module, dtype=dtype)
        return module

    to.moves = lambda device: torch.nn.Module.to(module, device)  # (the owner's moves)
    return to


def _restore(module: torch.nn.Module, saved: dict) -> None:
    d = module.__dict__
    for k in _HELD:
        d.pop(k, None)
    d.update(saved)


# -- the emulated card: ControlNet's own moves, counted as a GPU would see them ----------------------

_ON_CARD: dict[int, int] = {}
"""Control models ControlNet put on the emulated card (key: :func:`_key`): their bytes."""


def _key(module: torch.nn.Module) -> int:
    """Its first weight's id (ControlNet's per-job shallow copies of a cached model share it)."""
    first = next(iter(tensors_of([module])), None)
    return id(first) if first is not None else id(module)


def emulate_moves(card: emulate.EmulatedCard, stack: ExitStack, runners: Iterable[Any]) -> bool:
    """Under ``--vram-guard-emulate-vram`` (see the module docstring): ControlNet's
    ``build_control_model`` runs as host work, and the class of the models it builds counts their
    ``fullvram()`` and ``to("cpu")`` on ``card``; undone when ``stack`` closes. Idempotent; False
    when ControlNet is not installed."""
    for runner in runners:
        for script in getattr(runner, "alwayson_scripts", None) or ():
            cls = type(script)
            build = cls.__dict__.get("build_control_model")
            if not isinstance(build, staticmethod) or not hasattr(script, "latest_network"):
                continue
            if getattr(build.__func__, "_vram_guard", False):
                return True
            original = build.__func__

            def built(*args: Any, _original: Any = original, **kwargs: Any) -> Any:
                with emulate.host_work():
                    control = _original(*args, **kwargs)
                _count_moves(type(getattr(control, "model", None)), card, stack)
                return control

            built._vram_guard = True  # type: ignore[attr-defined]
            cls.build_control_model = staticmethod(built)
            stack.callback(setattr, cls, "build_control_model", build)
            stack.callback(_ON_CARD.clear)
            return True
    return False


def _count_moves(cls: type, card: emulate.EmulatedCard, stack: ExitStack) -> None:
    full, to = getattr(cls, "fullvram", None), getattr(cls, "to", torch.nn.Module.to)
    if not callable(full) or getattr(full, "_vram_guard", False):
        return

    def fullvram(self: torch.nn.Module) -> Any:
        out = full(self)
        key = _key(self)
        if key not in _ON_CARD:
            tensors = tensors_of([self])
            admit(card, tensors)  # (each may raise the card's out-of-memory error, as a copy would)
            n = nbytes_of(tensors)
            card.set_resident(card.resident_bytes + n)
            _ON_CARD[key] = n
            if tensors:  # a model ControlNet drops from its cache leaves the card
                weakref.finalize(tensors[0], _off, card, key)
        return out

    def moved(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        out = to(self, *args, **kwargs)
        if args and isinstance(args[0], str) and args[0] == "cpu":  # (its device is a torch.device)
            _off(card, _key(self))
        return out

    fullvram._vram_guard = True  # type: ignore[attr-defined]
    for name, fn in (("fullvram", fullvram), ("to", moved)):
        if name in cls.__dict__:
            stack.callback(setattr, cls, name, cls.__dict__[name])
        else:
            stack.callback(delattr, cls, name)
        setattr(cls, name, fn)


def _off(card: emulate.EmulatedCard, key: int) -> None:
    n = _ON_CARD.pop(key, 0)
    if n:
        card.set_resident(max(0, card.resident_bytes - n))
