"""``--vram-guard-emulate-vram SIZE``: every job of this WebUI on an emulated card.

An :class:`~lib_vram.core.emulate.EmulatedCard` of ``SIZE`` stands for the WebUI's device (what
counts and what the user sees: docs/webui.md, "A small GPU in software"). How:

* **Which threads run on it.** Dispatch modes are per thread. The card is entered in the job's own
  thread at ``shared.state.begin`` and left at each of the ends of
  :func:`~lib_vram.webui.host.job_entry_points` (one of them runs even when the job raised); a job
  that still left it entered (a host path we do not know) is left at that thread's next ``begin``.
* **Live previews** (``state.do_set_current_image``, the progress request's thread) run on it too.
* **Resident bytes** are the loaded checkpoint's weights, updated at every model load; a checkpoint
  placed by VRAM Guard (:mod:`.placement`) counts what a GPU would hold (it recounts after this).
* **LoRA** loads and weight backups, and **ControlNet's models** until ControlNet moves them
  (:func:`lib_vram.residency.controlnet.emulate_moves`), are host memory, as on a GPU.
* The card is :func:`~lib_vram.core.emulate.install`\\ ed, so every memory probe sees it.

Everything is undone when the script unloads (:meth:`WebUICard.close`).
"""

from __future__ import annotations

import logging
import sys
import threading
from contextlib import ExitStack
from typing import Any

import torch

from lib_vram.core import emulate
from lib_vram.residency._modules import tensors_of

from .patching import patch_attr

logger = logging.getLogger(__name__)

FLAG = "--vram-guard-emulate-vram"


def _weight_modules(model: Any, depth: int = 3) -> list[torch.nn.Module]:
    """The modules holding a checkpoint's weights: the model itself when it is a module (A1111's
    ``LatentDiffusion``), else the modules found in its plain attributes (a few levels deep)."""
    if isinstance(model, torch.nn.Module):
        return [model]
    if model is None or depth == 0 or isinstance(model, (str, bytes, int, float, bool)):
        return []
    try:
        values = list(vars(model).values())
    except TypeError:
        return []
    return [m for value in values for m in _weight_modules(value, depth - 1)]


class WebUICard:
    """The emulated card of this WebUI process (see the module docstring)."""

    def __init__(
        self,
        capacity: int | str | emulate.EmulatedCard,
        *,
        host: Any,
        device: torch.device | str = "cpu",
    ) -> None:
        if isinstance(capacity, emulate.EmulatedCard):
            self.card = capacity
        else:
            dev = torch.device(device)
            if dev.type not in ("cpu", "cuda"):
                raise ValueError(
                    f"`{FLAG}` emulates a card for the CPU or a CUDA device; this WebUI runs on {dev.type!r}"
                )
            self.card = emulate.EmulatedCard(capacity, device=dev)
        self.host = host
        self.stack = ExitStack()
        self._local = threading.local()
        self._previous: emulate.EmulatedCard | None = None
        self.installed = False

    # -- lifecycle -----------------------------------------------------------------------------
    def install(self) -> None:
        """Wrap the host's job entry points, install the card process-wide, count the loaded model."""
        if self.installed:
            return
        points = self.host.job_entry_points()
        wrappers = {
            "begin": self._begin,
            "end": self._leave_after,
            "finish_task": self._leave_after,
            "run_postprocessing": self._leave_after,
            "preview": self._on_card,
        }
        for role in ("begin", "end"):
            if role not in points:
                raise RuntimeError(f"`{FLAG}`: this WebUI has no shared.state.{role}; cannot emulate a card")
        for role, (obj, name) in points.items():
            patch_attr(obj, name, wrappers[role], self.stack)
        self._previous = emulate.install(self.card)
        self.stack.callback(self._uninstall)
        self.installed = True
        self.model_changed(self.host.loaded_sd_model())
        resident = self.card.resident_bytes
        logger.warning(
            "VRAM Guard: %s: every generation and Extras run of this WebUI runs on an %s "
            "(emulated device memory counted in software, not a real GPU; %s). An allocation beyond "
            "it raises the out-of-memory error a GPU raises.",
            FLAG,
            self.card.label,
            f"{_mib(resident)} of it resident: the loaded checkpoint"
            if resident
            else "the checkpoint counts as resident once it is loaded",
        )

    def close(self) -> None:
        """Leave the card in this thread and undo every patch (``on_script_unloaded``)."""
        self.leave()
        self.stack.close()
        self.installed = False

    def _uninstall(self) -> None:
        if emulate.installed() is self.card:
            emulate.install(self._previous)

    # -- entering / leaving in a job's thread ---------------------------------------------------
    def enter(self) -> None:
        """Put this thread on the card (once; a no-op when it already runs on it)."""
        if getattr(self._local, "entered", False) or self.card.active_here:
            return
        self.card.__enter__()
        self._local.entered = True
        self.card.reset_peak()

    def leave(self) -> None:
        """Take this thread off the card if :meth:`enter` put it there (idempotent)."""
        if getattr(self._local, "entered", False):
            self._local.entered = False
            self.card.__exit__(None, None, None)

    def _begin(self, original: Any, *args: Any, **kwargs: Any) -> Any:
        self.leave()  # a job of this thread that ended without state.end() (it raised)
        result = original(*args, **kwargs)
        runners = getattr(self.host, "script_runners", None)
        if callable(runners):  # ControlNet's models as a GPU would see them (once installed)
            from lib_vram.residency.controlnet import emulate_moves

            emulate_moves(self.card, self.stack, runners().values())
        self._host_side_lora()
        self.enter()
        return result

    def _host_side_lora(self) -> None:
        """The built-in Lora extension loads a LoRA and keeps its backup of each weight it changes
        in host memory (``networks.load_network``; ``store_weights_backup``: ``weight.to(cpu)``):
        on the emulated card (the CPU) they run as host work, as on a GPU (once patched)."""
        networks = sys.modules.get("networks")
        for name in ("load_network", "store_weights_backup"):
            fn = getattr(networks, name, None)
            if callable(fn) and getattr(fn, "fn", None) is not _as_host_work:
                patch_attr(networks, name, _as_host_work, self.stack)

    def _leave_after(self, original: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return original(*args, **kwargs)
        finally:
            self.leave()

    def _on_card(self, original: Any, *args: Any, **kwargs: Any) -> Any:
        with emulate.running_on(self.card):
            return original(*args, **kwargs)

    # -- the model ------------------------------------------------------------------------------
    def model_changed(self, sd_model: Any, *, resident: bool = True) -> None:
        """``on_model_loaded``: the new checkpoint's weights are what is resident on the card
        (``resident`` False: a checkpoint VRAM Guard placed already counts what it put there)."""
        modules = _weight_modules(sd_model)
        if not modules:
            return
        if self.card.device.type == "cpu":
            for t in tensors_of(modules):
                # resident: counted in resident_bytes, not as live tensors (loaded inside a job, they
                # were until now), and their views (a Linear's weight.t()) are no new allocations
                try:
                    self.card.ledger.adopt(t.untyped_storage())
                except (RuntimeError, NotImplementedError):
                    continue
        if resident:
            self.card.set_resident(modules)
            now = _mib(self.card.resident_bytes)
            logger.info("VRAM Guard: %s: %s resident (the loaded checkpoint)", self.card.label, now)


def _as_host_work(original: Any, *args: Any, **kwargs: Any) -> Any:
    with emulate.host_work():
        return original(*args, **kwargs)


def _mib(n: int) -> str:
    return f"{n / 2**20:.0f} MiB"


def start(size: Any, *, host: Any) -> WebUICard | None:
    """The card for ``--vram-guard-emulate-vram`` (``size``: bytes or text), installed; None when
    emulation cannot run here (logged)."""
    try:
        card = WebUICard(emulate.parse_size(size, FLAG), host=host, device=host.device())
        card.install()
    except (ValueError, RuntimeError) as exc:
        logger.error("VRAM Guard: %s", exc)
        return None
    return card
