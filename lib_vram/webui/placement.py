"""A checkpoint that does not fit the card at load: VRAM Guard places it by budget for the session.

With 'Place a checkpoint that does not fit' (Settings) or ``--vram-guard-place-checkpoint`` a
checkpoint whose weights plus a working margin exceed the card is placed by
:func:`lib_vram.residency.plan_checkpoint` (the whole story: docs/streaming.md, "A checkpoint that
does not fit at load").

The host's ``sd_models.model_target_device``/``send_model_to_device``/``send_model_to_cpu``/
``send_model_to_trash`` are patched by name (:mod:`.patching`) only while the option is on; after
``send_model_to_cpu`` an instance patch on the model's ``to`` catches ``reload_model_weights``'s
``sd_model.to(devices.device)``. The option off, a switch, an unload and script unload put every
weight back where the WebUI would have it. On the emulated card the move at load admits each tensor
as a copy would (each may raise its out-of-memory error), and :meth:`Placement.model_loaded` runs
after the card's own count at model load.
"""

from __future__ import annotations

import logging
import threading
import weakref
from contextlib import ExitStack
from typing import Any

import torch

from lib_vram.core import emulate
from lib_vram.core.device import is_oom_error, memory_info, release
from lib_vram.residency._modules import admit as _admit
from lib_vram.residency._modules import nbytes_of as _nbytes
from lib_vram.residency._modules import tensors_of as _tensors_of

from .emulation import _weight_modules
from .host import ask
from .models import CardModels, checkpoint_parts, loaded_bytes
from .passplan import _attention, _dtype_of
from .patching import patch_attr
from .placed import Placed

logger = logging.getLogger(__name__)

MiB = 1 << 20
FLAG = "--vram-guard-place-checkpoint"
SETTING = "vram_guard_place_checkpoint"
SETTING_LABEL = "Place a checkpoint that does not fit the card (instead of --lowvram)"
SETTING_INFO = (
    "Text encoders/VAE on the CPU until used, part of the UNet streamed; from the next job. Flag: " + FLAG
)
CONTEXT_TOKENS = 77
DEFAULT_BATCH = 2
"""A default pass: one image, cond and uncond in one forward."""


class PlacementOutOfMemory(RuntimeError):
    """Placing the checkpoint ran out of memory, or the card cannot hold even the placed part:
    one line. Contains "out of memory" (:func:`lib_vram.core.device.is_oom_error`)."""


def native_latent_hw(sd_model: Any) -> tuple[int, int]:
    """The latent of the model's native size: SDXL 1024 px, SD2 768 px, else 512 px."""
    if getattr(sd_model, "is_sdxl", False) or hasattr(sd_model, "conditioner"):
        return (128, 128)
    if getattr(sd_model, "is_sd2", False):
        return (96, 96)
    return (64, 64)


def _parts(sd_model: Any) -> tuple[torch.nn.Module | None, list[tuple[str, torch.nn.Module]]]:
    """(the UNet's ``diffusion_model``, [(name, module)] of the text encoders and the VAE)."""
    dm = getattr(getattr(sd_model, "model", None), "diffusion_model", None)
    return (dm if isinstance(dm, torch.nn.Module) else None), checkpoint_parts(sd_model, unet=False)


def _all_tensors(sd_model: Any) -> list[torch.Tensor]:
    return _tensors_of(_weight_modules(sd_model))


class Placement:
    """The session's checkpoint placement (see the module docstring)."""

    def __init__(self, host: Any, *, emulated: Any = None, cards: Any = None) -> None:
        self.host = host
        self.cards = cards if cards is not None else CardModels(host, emulated)
        """The session's :class:`~lib_vram.webui.models.CardModels` (the owner of the card; its
        ``card()``: the session's emulated card)."""
        self.stack: ExitStack | None = None
        self.placed: dict[int, Placed] = {}
        self.traps: dict[int, ExitStack] = {}
        self.margin_bytes: int | None = None
        """The working margin's safety part (None: the Settings preset's)."""
        self.latent_hw: tuple[int, int] | None = None
        """The default pass's latent (None: the model's native size)."""
        self.last_error: str | None = None
        self._job_over = False
        """The WebUI's job has ended (``finish_task``) and no new one has begun."""
        self._lock = threading.RLock()

    # -- on / off ------------------------------------------------------------------------------
    def skip_reason(self) -> str | None:
        """Why the placement is not in force now (None: it is)."""
        h = self.host
        if h.cmd_opt("vram_guard_disable", False):
            return "--vram-guard-disable"
        if not option_on(h):
            return f"off (Settings or {FLAG})"
        for flag in ("lowvram", "medvram", "medvram_sdxl"):
            if h.cmd_opt(flag, False):
                return f"--{flag.replace('_', '-')} given"
        return None

    @property
    def installed(self) -> bool:
        return self.stack is not None

    def refresh(self) -> None:
        """Install or remove the patches for the option's current value; a placed checkpoint goes
        back where the WebUI would have it when the option was turned off (job start, model load)."""
        why = self.skip_reason()
        if why is None:
            self.install()
            self.place_if_needed(ask(self.host, "loaded_sd_model", None))
        elif self.installed:
            logger.info("VRAM Guard: checkpoint placement %s: undoing it", why)
            self.close()

    def install(self) -> None:
        if self.stack is not None:
            return
        try:
            points = self.host.placement_points()
        except (ImportError, AttributeError) as exc:
            logger.warning("VRAM Guard: %s: cannot reach the WebUI's sd_models (%s); not placing", FLAG, exc)
            return
        wrappers = {
            "model_target_device": self._target_device,
            "send_model_to_device": self._to_device,
            "send_model_to_cpu": self._to_cpu,
            "send_model_to_trash": self._to_trash,
        }
        missing = [n for n in wrappers if n not in points]
        if missing:
            logger.warning(
                "VRAM Guard: %s: this WebUI has no sd_models.%s; checkpoints are not placed", FLAG, missing[0]
            )
            return
        self.stack = ExitStack()
        self._patch(points, wrappers)
        self._patch_job_end()
        logger.info("VRAM Guard: checkpoint placement on: a checkpoint that does not fit the card is placed")

    def _patch_job_end(self) -> None:
        """A job's end sends the parked parts it woke outside any stage home (``state.end`` and
        ``progress.finish_task``, both: the API routes call ``finish_task`` by their own imported
        name, see :func:`~lib_vram.webui.host.job_entry_points`), and so does a live preview that
        decoded after that end: the WebUI decodes one whenever a progress poll arrives while the
        task is still current, also after the job's last decode, so its VAE wake was left on the
        card until the next job (seen in the real WebUI, issue 29 Run 7)."""
        points = ask(self.host, "job_entry_points", {})
        wrappers = {
            "begin": self._job_begins,
            "end": self._job_done,
            "finish_task": self._job_done,
            "preview": self._preview,
        }
        self._patch(points, wrappers)

    def _patch(self, points: dict[str, tuple[Any, str]], wrappers: dict[str, Any]) -> None:
        """Each role of ``wrappers`` that the host has, on the placement's stack."""
        for role, fn in wrappers.items():
            if role in points and self.stack is not None:
                obj, attr = points[role]
                patch_attr(obj, attr, fn, self.stack)

    def _job_begins(self, previous: Any, *args: Any, **kwargs: Any) -> Any:
        self._job_over = False
        return previous(*args, **kwargs)

    def _job_done(self, previous: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return previous(*args, **kwargs)
        finally:
            self._job_over = True
            self._send_woken_home()

    def _preview(self, previous: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return previous(*args, **kwargs)
        finally:
            if self._job_over:
                self._send_woken_home()

    def _send_woken_home(self) -> None:
        """The parked parts woken outside any stage go home, unless a stage is open (then they
        belong to it, and its end sends them home)."""
        owner = self.cards.owner
        if owner.open_stages():
            return
        try:
            owner.settle(why="the job is done")
        except Exception as exc:  # never fail the job (or its preview) for a move home
            logger.warning("VRAM Guard: after the job: %s", exc)

    def close(self) -> None:
        """Undo every placement (weights back where the WebUI would have them) and every patch."""
        with self._lock:
            for placed in list(self.placed.values()):
                self.unplace(placed.model, to="host-choice")
            for key in list(self.traps):
                self._disarm(key)
            stack, self.stack = self.stack, None
            if stack is not None:
                stack.close()

    # -- deciding ------------------------------------------------------------------------------
    def total_bytes(self) -> int | None:
        """The card's memory (None: the compute device is the CPU without an emulated card)."""
        card = self.cards.card()
        if card is not None:
            return card.capacity
        dev = self.host.device()
        if dev.type == "cpu":
            return None
        card = emulate.current(dev)  # an emulated card on a GPU (its capacity, the real moves)
        return card.capacity if card is not None else int(memory_info(dev).total)

    def _safety(self, total: int) -> int:
        if self.margin_bytes is not None:
            return self.margin_bytes
        from lib_vram.planning.presets import PRESET_NAMES, resolve_preset

        name = self.host.cmd_opt("vram_guard_preset", None) or ask(
            self.host, "opts_get", "Auto", "vram_guard_preset", "Auto"
        )
        match = [n for n in PRESET_NAMES if n.lower() == str(name).lower()]
        return resolve_preset(match[0] if match else "Auto", total).safety_margin(total)

    def _step(self, sd_model: Any, dm: torch.nn.Module) -> dict:
        backend = "cpu" if self.host.device().type == "cpu" else "cuda"
        hw = self.latent_hw or native_latent_hw(sd_model)
        return dict(
            batch=DEFAULT_BATCH,
            latent_hw=hw,
            context_tokens=CONTEXT_TOKENS,
            attention=_attention(self.host, backend),
            dtype=_dtype_of(self.host, dm),
            backend=backend,
        )

    def need(self, sd_model: Any, *, checkpoint_bytes: int | None = None) -> tuple[int, int, int] | None:
        """(checkpoint bytes, working margin, card bytes) of ``sd_model``; None when it cannot be
        placed (no UNet of the ldm/sgm layout, weights on the meta device, no card)."""
        from lib_vram import sampling
        from lib_vram.sampling._estimate import input_bytes

        total = self.total_bytes()
        dm, _ = _parts(sd_model)
        if total is None or dm is None or getattr(sd_model, "forge_objects", None) is not None:
            return None
        if checkpoint_bytes is None:
            tensors = _all_tensors(sd_model)
            if any(t.device.type == "meta" for t in tensors):
                return None
            checkpoint_bytes = _nbytes(tensors)
        try:
            spec = sampling.unet_spec(dm)
            step = self._step(sd_model, dm)
            est = sampling.estimate_sampling(spec, free_bytes=total, **step)
            ib = input_bytes(spec, step["batch"], step["latent_hw"], CONTEXT_TOKENS, step["dtype"])
        except (ValueError, TypeError, AttributeError) as exc:
            logger.info("VRAM Guard: the checkpoint cannot be placed: %s", exc)
            return None
        return checkpoint_bytes, self._safety(total) + est.activation_bytes + ib, total

    def fits(self, sd_model: Any, **kw: Any) -> bool | None:
        need = self.need(sd_model, **kw)
        return None if need is None else need[0] + need[1] <= need[2]

    # -- the host's functions (patched while the option is on) -------------------------------------
    def _target_device(self, previous: Any, m: Any) -> Any:
        if self.skip_reason() is None and self.host.device().type != "cpu":
            est = loaded_bytes(m, half=not self.host.cmd_opt("no_half", False))
            if est is not None and self.fits(m, checkpoint_bytes=est) is False:
                logger.info(
                    "VRAM Guard: the checkpoint (%.0f MiB) does not fit the card: it loads into host memory",
                    est / MiB,
                )
                _check_host_room(est, "the checkpoint loads into host memory to be placed")
                return torch.device("cpu")
        return previous(m)

    def _to_device(self, previous: Any, m: Any) -> Any:
        if self.skip_reason() is None and id(m) in self.placed:
            return None  # already placed (an already-loaded model switched back in)
        if self.skip_reason() is None and self.fits(m) is False:
            self._disarm(id(m))
            m.lowvram = False  # what lowvram.apply() sets when neither flag is given
            self.place(m)
            return None
        return previous(m)

    def _to_cpu(self, previous: Any, m: Any) -> Any:
        if m is not None and id(m) in self.placed:
            self.unplace(m, to="host")
            result = previous(m)
            self._arm(m)
            return result
        return previous(m)

    def _to_trash(self, previous: Any, m: Any) -> Any:
        if m is not None:
            self._disarm(id(m))
            if id(m) in self.placed:
                self.unplace(m, to="host")
        return previous(m)

    def _arm(self, m: Any) -> None:
        """After ``send_model_to_cpu`` of a placed model: catch the reload's ``m.to(device)``."""
        if not isinstance(m, torch.nn.Module) or id(m) in self.traps:
            return
        stack = ExitStack()
        ref = weakref.ref(m)

        def to(previous: Any, *args: Any, **kwargs: Any) -> Any:
            model = ref()
            target = _to_target(args, kwargs)
            dev = self.host.device()
            if (
                model is not None
                and target is not None
                and target.type == dev.type
                and self.skip_reason() is None
                and self.fits(model) is False
            ):
                self._disarm(id(model))
                self.place(model)
                return model
            return previous(*args, **kwargs)

        patch_attr(m, "to", to, stack)
        self.traps[id(m)] = stack

    def _disarm(self, key: int) -> None:
        stack = self.traps.pop(key, None)
        if stack is not None:
            stack.close()

    # -- placing -------------------------------------------------------------------------------
    def place_if_needed(self, sd_model: Any) -> Placed | None:
        """Place ``sd_model`` when the option is on and it does not fit (logged, never raises for
        a model that cannot be placed: the WebUI then runs as without VRAM Guard)."""
        if self.skip_reason() is not None or sd_model is None or id(sd_model) in self.placed:
            return self.placed_for(sd_model)
        if self.fits(sd_model) is not False:
            return None
        try:
            return self.place(sd_model)
        except PlacementOutOfMemory as exc:
            logger.error("%s", exc)
            return None

    def place(self, sd_model: Any) -> Placed:
        """Place ``sd_model`` (see the module docstring). :class:`PlacementOutOfMemory` (one line)
        when the card cannot hold even the placed part or the move runs out of memory; every weight
        is then where it was."""
        from lib_vram import sampling
        from lib_vram.residency import plan_checkpoint

        with self._lock:
            if id(sd_model) in self.placed:
                return self.placed[id(sd_model)]
            need = self.need(sd_model)
            if need is None:
                raise PlacementOutOfMemory(
                    "VRAM Guard could not place the checkpoint (out of memory): no ldm/sgm UNet or no card"
                )
            ckpt, _, total = need
            dm, parts = _parts(sd_model)
            assert dm is not None
            device = self.host.device()
            card = self.cards.card()
            skip = {id(t) for t in _tensors_of([dm, *(m for _, m in parts)])}
            leftover = [t for t in _all_tensors(sd_model) if id(t) not in skip]
            leftover_bytes = _nbytes(leftover)
            step = self._step(sd_model, dm)
            cp = plan_checkpoint(
                dm,
                sampling.unet_spec(dm),
                card_bytes=total,
                safety_bytes=self._safety(total),
                leftover_bytes=leftover_bytes,
                parked=[(n, _nbytes(_tensors_of([m]))) for n, m in parts],
                **step,
            )
            plan = cp.stream
            if not cp.fits:
                raise PlacementOutOfMemory(
                    f"VRAM Guard could not place the checkpoint ({ckpt / MiB:.0f} MiB) on the card "
                    f"({total / MiB:.0f} MiB): even with the text encoders and VAE on the CPU and the UNet "
                    f"streamed, a {step['latent_hw'][1] * 8}x{step['latent_hw'][0] * 8} px pass would run "
                    f"out of memory; use --lowvram"
                )
            _check_host_room(
                cp.host_bytes, "the placed checkpoint keeps its parked parts and streamed blocks there"
            )
            placed = Placed(
                sd_model,
                dm,
                plan,
                tuple(parts),
                device,
                card,
                leftover_bytes=leftover_bytes,
                owner=self.cards.owner,
            )
            resident_units = [dm.get_submodule(n) for n in plan.resident]
            to_card = leftover + _tensors_of(resident_units)
            if card is not None:
                before = card.resident_bytes
                card.set_resident(0)  # the checkpoint leaves; what goes to the card is admitted
                try:
                    _admit(card, to_card)
                except BaseException as exc:
                    card.set_resident(before)
                    raise self._oom(ckpt, total, exc) from exc
                # (the count stays 0 until recount() below: the whole UNet counted for a moment, as
                # the streamer's start would need, is a peak no GPU sees)
            else:
                moved = self._move_to_card(sd_model, dm, parts, resident_units, device, ckpt, total)
            try:
                if plan.streamed:
                    placed.streamer = sampling.StreamedUNet(
                        dm, plan, device, card=card, adopt_host=device.type == "cuda"
                    ).__enter__()
            except BaseException as exc:
                if card is not None:
                    card.set_resident(before)
                else:
                    for m in moved:
                        m.to("cpu")
                if is_oom_error(exc):
                    raise self._oom(ckpt, total, exc) from exc
                raise
            self.placed[id(sd_model)] = placed
            self.cards.report(sd_model, placed=placed)
            placed.recount()
            self.last_error = None
            logger.warning("VRAM Guard: %s (%s)", placed.label, self._plan_text(placed))
            return placed

    def _plan_text(self, placed: Placed) -> str:
        p = placed.plan
        if placed.streamer is None:
            return "the whole UNet fits"
        return (
            f"{len(p.streamed)} of {len(p.streamed) + len(p.resident)} UNet blocks stream, "
            f"{p.bytes_moved_per_step / MiB:.0f} MiB per step at {p.forwards_per_step} forward(s); "
            f"--lowvram would move {p.lowvram_bytes_per_step / MiB:.0f} MiB"
        )

    def _oom(self, ckpt: int, total: int, exc: BaseException) -> PlacementOutOfMemory:
        text = (
            f"VRAM Guard: placing the checkpoint ({ckpt / MiB:.0f} MiB) on the card ({total / MiB:.0f} MiB) "
            f"ran out of memory ({str(exc).splitlines()[0][:160]}); its weights stay in host memory"
        )
        self.last_error = text
        return PlacementOutOfMemory(text)

    def _move_to_card(
        self,
        sd_model: Any,
        dm: torch.nn.Module,
        parts: list[tuple[str, torch.nn.Module]],
        resident_units: list[torch.nn.Module],
        device: torch.device,
        ckpt: int,
        total: int,
    ) -> list[Any]:
        """A GPU: the checkpoint is in host memory; its buffers and the UNet's resident units go to
        the card (an out-of-memory error puts them back in host memory and raises one line)."""
        moved: list[Any] = []
        skip = {id(dm)} | {id(m) for _, m in parts}
        wrapper = getattr(sd_model, "model", None)
        for _, m in parts:
            m.to("cpu")  # (a checkpoint the WebUI had on the card: placed when the option came on)
        try:
            _move_buffers(sd_model, device)
            for child in sd_model.children():
                if id(child) in skip:
                    continue
                if child is wrapper:
                    for sub in child.children():
                        if id(sub) not in skip:
                            sub.to(device)
                            moved.append(sub)
                    continue
                child.to(device)
                moved.append(child)
            for unit in resident_units:
                unit.to(device)
                moved.append(unit)
        except BaseException as exc:
            for m in moved:
                m.to("cpu")
            _move_buffers(sd_model, "cpu")
            if is_oom_error(exc):
                release(device)
                raise self._oom(ckpt, total, exc) from exc
            raise
        return moved

    def unplace(self, sd_model: Any, *, to: str) -> None:
        """End the placement of ``sd_model``. ``to="host"``: the WebUI moves it to the CPU (a switch,
        an unload): the streamed units keep their host copies, nothing moves to the card.
        ``to="host-choice"`` (option off, script unload): every weight to the card when the
        checkpoint fits there, else all in host memory with a warning."""
        with self._lock:
            placed = self.placed.pop(id(sd_model), None)
            if placed is None:
                return
            if self.cards.group is sd_model:
                self.cards.forget()  # its parts' wake hooks go; the owner forgets its places
            s, card = placed.streamer, placed.card
            total = self.total_bytes() if to == "host-choice" else None
            if total is not None and _nbytes(_all_tensors(sd_model)) <= total:  # fits the card
                try:
                    if s is not None:
                        s.restore()
                    if card is None:
                        sd_model.to(placed.device)
                    else:
                        _admit(card, _tensors_of([m for _, m in placed.parked]))
                        card.set_resident(_nbytes(_all_tensors(sd_model)))
                    self.cards.report(sd_model)
                    logger.info("VRAM Guard: checkpoint placement undone: the checkpoint is on the card")
                    return
                except (RuntimeError, torch.OutOfMemoryError) as exc:
                    if not is_oom_error(exc) and not (s is not None and s.pending):
                        raise
                    logger.warning("VRAM Guard: moving the checkpoint back to the card failed: %s", exc)
            if s is not None:
                s.release_to_host()
            if card is None:
                sd_model.to("cpu")
            else:
                card.set_resident(0)
            if to == "host-choice":
                logger.warning(
                    "VRAM Guard: checkpoint placement undone; the checkpoint does not fit the card and stays "
                    "in host memory: reload it with --lowvram or turn '%s' back on",
                    SETTING_LABEL,
                )

    # -- the session -----------------------------------------------------------------------------
    def model_loaded(self, sd_model: Any) -> None:
        """``on_model_loaded`` (after the emulated card counted the checkpoint as resident): a placed
        model's count wins; an unplaced one that does not fit is placed now (a model loaded before
        the card or the option existed)."""
        placed = self.placed_for(sd_model)
        if placed is not None:
            placed.recount()
            return
        if self.skip_reason() is None:
            self.install()
            self.place_if_needed(sd_model)

    def placed_for(self, sd_model: Any) -> Placed | None:
        return self.placed.get(id(sd_model)) if sd_model is not None else None

    def status_line(self) -> str:
        """The status route's line."""
        placed = self.placed_for(ask(self.host, "loaded_sd_model", None))
        if placed is not None:
            return placed.label
        if self.last_error:
            return self.last_error
        why = self.skip_reason()
        if why is not None:
            return f"checkpoint placement {why}"
        return "checkpoint placement on: the checkpoint fits the card, nothing placed"


def _move_buffers(module: torch.nn.Module, device: Any) -> None:
    """The module's own buffers (not its children's) to ``device``."""
    for name, buf in list(module._buffers.items()):
        if buf is not None:
            module._buffers[name] = buf.to(device)


def _check_host_room(nbytes: int, what: str) -> None:
    """One line when host memory has no room for ``nbytes``, before anything moves (the placement
    goes on: the system may swap, and the WebUI without it cannot run the checkpoint either)."""
    from lib_vram.residency import host_shortfall

    available = host_shortfall(nbytes)
    if available is not None:
        logger.warning(
            "VRAM Guard: host memory: %s (%.0f MiB) and %.0f MiB are available: the system may swap",
            what,
            nbytes / MiB,
            available / MiB,
        )


def option_on(host: Any) -> bool:
    """The placement is asked for (its Settings option or the command-line flag)."""
    return bool(
        host.cmd_opt("vram_guard_place_checkpoint", False) or ask(host, "opts_get", False, SETTING, False)
    )


def _to_target(args: tuple, kwargs: dict) -> torch.device | None:
    """The device of a ``Module.to(...)`` call (None: a dtype-only call)."""
    cand = kwargs.get("device", args[0] if args else None)
    if isinstance(cand, (str, torch.device)):
        try:
            return torch.device(cand)
        except RuntimeError:
            return None
    if isinstance(cand, torch.Tensor):
        return cand.device
    return None
