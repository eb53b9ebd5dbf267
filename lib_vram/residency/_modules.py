"""Moving a ``torch.nn.Module``'s weights for the owner: a real card, or the emulated one.

:class:`ModuleMover` is the :class:`~lib_vram.residency.Mover` of any module (the WebUI's UNet,
text encoders, VAE; a control model an extension adds). On a GPU it is ``module.to(device)`` and
``module.to("cpu")`` (a copy to the card that runs out of memory puts what moved back in host
memory). On the emulated card (``--vram-guard-emulate-vram``, CPU) the weights stay in host memory
and the card's resident bytes are what a GPU would hold: a move to the card admits each tensor as
a copy allocates it (each may raise the card's out-of-memory error), a move off gives its bytes back.

While a module is off the card, a forward pre-hook on each of its submodules calls ``on_use``
(the owner's :meth:`~lib_vram.residency.Owner.use`), so a path nobody planned finds it on the card.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

from lib_vram.core import emulate
from lib_vram.core.livebytes import tensors_of  # (re-exported: the adapters import it from here)


def nbytes_of(tensors: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def admit(card: emulate.EmulatedCard, tensors: list[torch.Tensor]) -> None:
    """The emulated card admits ``tensors`` one at a time, as a copy to a GPU allocates them (each
    may raise its out-of-memory error, and :attr:`EmulatedCard.inject_oom_at` counts them); after it
    (or the error) they are resident weights again, known to the card but not live (the caller sets
    the resident bytes)."""
    seen: list[Any] = []
    try:
        for t in tensors:
            st = t.untyped_storage()
            seen.append(st)
            card.ledger.remove(st)  # an adopted (resident) storage would not be admitted again
            card.ledger.add(st)
    finally:
        for st in seen:
            card.ledger.adopt(st)


class ModuleMover:
    """Moves one module between the card and host memory (see the module docstring)."""

    def __init__(
        self, module: torch.nn.Module, device: torch.device, card: emulate.EmulatedCard | None = None
    ) -> None:
        self.module = module
        self.device = device
        self.card = card
        self.on_use: Callable[[], None] | None = None
        """Called at the first forward while off the card (the owner sets it)."""
        self._hooks: list[Any] = []
        self._lock = threading.RLock()

    @property
    def nbytes(self) -> int:
        return nbytes_of(tensors_of([self.module]))

    def to_card(self) -> None:
        with self._lock:
            if self.card is not None:
                admit(self.card, tensors_of([self.module]))
                self.card.set_resident(self.card.resident_bytes + self.nbytes)
            else:
                try:
                    self._to(self.device)
                except BaseException:
                    self._to("cpu")
                    raise
            self.unhook()

    def return_home(self) -> None:
        """Back to the card it left for a stage. On the emulated card its bytes count again as
        resident (they were before the stage; the count is restored as a GPU's free memory would
        be); on a GPU this is :meth:`to_card`."""
        with self._lock:
            if self.card is None:
                self.to_card()
                return
            self.card.set_resident(self.card.resident_bytes + self.nbytes)
            self.unhook()

    def to_host(self) -> None:
        with self._lock:
            if self.card is not None:
                self.card.set_resident(max(0, self.card.resident_bytes - self.nbytes))
            else:
                self._to("cpu")
            self.hook()

    def _to(self, device: Any) -> None:
        """``module.to(device)``; past a ``to`` that holds an extension's own moves (its
        ``moves`` attribute: the real move, see :mod:`lib_vram.residency.controlnet`)."""
        to = self.module.to
        getattr(to, "moves", to)(device)

    def hook(self) -> None:
        """``on_use`` at the first forward of any submodule while off the card."""
        if self.on_use is None or self._hooks:
            return
        on_use = self.on_use

        def wake(module: torch.nn.Module, args: Any) -> None:
            on_use()

        for m in self.module.modules():
            self._hooks.append(m.register_forward_pre_hook(wake))

    def unhook(self) -> None:
        hooks, self._hooks = self._hooks, []
        for h in hooks:
            h.remove()
