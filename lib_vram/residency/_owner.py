"""The one owner of the card: every model of the session, where it lives, and every move.

A :class:`Model` is anything with weights that a stage may need on the card: the UNet, the text
encoders, the VAE, an upscaler, a Refiner or a hires checkpoint, a control model an extension adds
(:meth:`Owner.join` is the whole entry point: a name, a role, its bytes and a :class:`Mover` that
knows how to put it on the card and take it off). Each model has a *home*, where it waits between
stages: the card, host memory (a parked part of a placed checkpoint), or streamed (part of it
resident, the rest brought in per forward by its streamer).

The owner decides; the host adapter only reports models and applies moves through their movers:

* :meth:`Owner.room` — before a stage: given the models it uses and the stage's own prediction
  (``fits(freed_bytes)``: does the stage fit when that many more bytes are free?), nothing moves
  when it fits; else the fewest bytes of models not in use leave (parts away from home first, then
  the smallest single model that is enough, else the largest and again); when nothing is enough the
  stage does not fit and nothing moves (no ``fits``: all of them leave, the stage's last chance).
* :meth:`Owner.use` — a model is needed now (a forward pre-hook of one of its modules, or a stage's
  use): it goes to the card, after :meth:`room` for its bytes.
* :meth:`Owner.end` — after the stage every model it moved goes home: nothing woken stays unless
  the next stage wants it (it wakes again then), and what left for the stage comes back.
* :meth:`Owner.settle` — at the start of a stage or the UNet's forward: models woken outside any
  stage (the conditioning) go home unless in use.

Every move is logged once, with its reason, and kept in :attr:`Owner.moves` for the readout.
:meth:`Owner.snapshot` says where each model is (card, host, streamed with its resident share).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from lib_vram.core.device import is_oom_error

logger = logging.getLogger(__name__)

MiB = 1 << 20
CARD, HOST, STREAMED = "card", "host", "streamed"
WHERE = (CARD, HOST, STREAMED)
MAX_MOVES = 64
"""Moves the readout keeps."""


class Mover(Protocol):
    """How one model's weights move (the host adapter's; an emulated card counts bytes instead)."""

    def to_card(self) -> None:
        """All its weights on the card. An error (out of memory) leaves it in host memory."""

    def to_host(self) -> None:
        """All its weights in host memory."""


WAKE_HEADROOM_BYTES = 256 << 20
"""A model woken for a forward needs room for the forward too: a quarter of its weights' bytes,
at most this (the hires conditioning's text encoders woke beside a pass's ControlNet with room for
their weights only, and their forward ran out of memory)."""


@dataclass(eq=False)
class Model:
    """One model the owner knows."""

    name: str
    role: str
    """``unet``, ``text_encoders``, ``vae``, ``upscaler``, ``control``, ``checkpoint`` or another."""
    nbytes: int
    mover: Mover
    dtype: str = ""
    home: str = CARD
    where: str = CARD
    resident_bytes: int = 0
    """Streamed: the bytes of it on the card between forwards."""
    movable: bool = True
    """False: the owner never moves it (a streamed UNet's resident part, a model the host moves)."""
    group: Any = None
    """What it belongs to (a checkpoint): :meth:`Owner.leave_group` removes the whole group."""

    def __post_init__(self) -> None:
        for attr in ("home", "where"):
            if getattr(self, attr) not in WHERE:
                raise ValueError(f"`{attr}` must be one of {WHERE}, got {getattr(self, attr)!r}")
        if not isinstance(self.nbytes, int) or self.nbytes < 0:
            raise ValueError(f"`nbytes` must be a non-negative integer, got {self.nbytes!r}")

    @property
    def card_bytes(self) -> int:
        if self.where == CARD:
            return self.nbytes
        return self.resident_bytes if self.where == STREAMED else 0

    @property
    def host_bytes(self) -> int:
        """Its weights held in host memory (a streamed model: the copies of its streamed part)."""
        return self.nbytes - self.card_bytes

    def describe(self) -> str:
        if self.where == STREAMED:
            return f"streamed, {self.resident_bytes / MiB:.0f} of {self.nbytes / MiB:.0f} MiB resident"
        return f"{'on the card' if self.where == CARD else 'on the CPU'} ({self.nbytes / MiB:.0f} MiB)"

    def row(self) -> dict:
        return {
            "name": self.name,
            "role": self.role,
            "where": self.where,
            "home": self.home,
            "mib": round(self.nbytes / MiB, 1),
            "card_mib": round(self.card_bytes / MiB, 1),
            "dtype": self.dtype,
        }


@dataclass(frozen=True)
class Move:
    """One move the owner made."""

    name: str
    to: str
    stage: str
    why: str
    nbytes: int
    seconds: float

    @property
    def text(self) -> str:
        if self.to == STREAMED:
            return f"{self.name} streamed ({self.nbytes / MiB:.0f} MiB of it off the card): {self.why}"
        dest = "to the card" if self.to == CARD else "to the CPU"
        return f"{self.name} ({self.nbytes / MiB:.0f} MiB) {dest}: {self.why}"


@dataclass
class Room:
    """What :meth:`Owner.room` decided for a stage."""

    stage: str
    fits: bool
    moved: list[Model] = field(default_factory=list)
    """The models that left the card for the stage."""

    @property
    def names(self) -> str:
        return ", ".join(m.name for m in self.moved)

    @property
    def nbytes(self) -> int:
        return sum(m.nbytes for m in self.moved)


class Owner:
    """The session's models and their moves (see the module docstring). Thread-safe: a live preview
    decodes on another thread while the job's own thread samples."""

    def __init__(self, free: Callable[[], int], *, release: Callable[[], None] | None = None) -> None:
        self.free = free
        """``() -> bytes`` a new allocation on the card can use now."""
        self.release = release
        """Called after an out-of-memory error on a move back, before the one retry."""
        self.models: list[Model] = []
        self.moves: deque[Move] = deque(maxlen=MAX_MOVES)
        self.busy: set[int] = set()
        """ids of models a running stage computes with: never moved off."""
        self._stages: dict[str, list[tuple[Model, str]]] = {}
        """Open stages: (model, where it was) for each move made for them."""
        self._loose: list[tuple[Model, str]] = []
        """Moves outside any stage (a wake during the conditioning)."""
        self._busy_of: dict[str, list[int]] = {}
        self._order: list[str] = []
        """Open stages, oldest first: a wake inside one is undone at its end."""
        self._lock = threading.RLock()

    # -- the models ------------------------------------------------------------------------------
    def join(self, model: Model) -> Model:
        """Count ``model`` from now on (an extension's models join the same way)."""
        with self._lock:
            if model not in self.models:
                self.models.append(model)
            return model

    def leave(self, model: Model) -> None:
        """Stop counting ``model`` (it is unloaded, or its host moves it itself)."""
        with self._lock:
            if model in self.models:
                self.models.remove(model)
            self.busy.discard(id(model))
            for moves in (*self._stages.values(), self._loose):
                moves[:] = [(m, w) for m, w in moves if m is not model]

    def leave_group(self, group: Any) -> list[Model]:
        with self._lock:
            gone = self.of(group)
            for m in gone:
                self.leave(m)
            return gone

    def of(self, group: Any) -> list[Model]:
        with self._lock:
            return [m for m in self.models if m.group is group]

    @property
    def card_bytes(self) -> int:
        with self._lock:
            return sum(m.card_bytes for m in self.models)

    @property
    def host_bytes(self) -> int:
        with self._lock:
            return sum(m.host_bytes for m in self.models)

    def snapshot(self) -> list[dict]:
        """Where each model is now (readout, status route)."""
        with self._lock:
            return [m.row() for m in self.models]

    def summary(self) -> str:
        """One line: ``"UNet streamed, 2168 of 3279 MiB resident; text encoders on the CPU …"``."""
        with self._lock:
            return "; ".join(f"{m.name} {m.describe()}" for m in self.models)

    # -- deciding and moving ---------------------------------------------------------------------
    def candidates(
        self, uses: Iterable[Model] = (), may_move: Callable[[Model], bool] | None = None
    ) -> list[Model]:
        """The models on the card that a stage using ``uses`` could send to host memory."""
        keep = {id(m) for m in uses} | self.busy
        with self._lock:
            return [
                m
                for m in self.models
                if m.where == CARD and m.movable and id(m) not in keep and (may_move is None or may_move(m))
            ]

    def choose(self, candidates: list[Model], fits: Callable[[int], bool]) -> list[Model] | None:
        """The fewest bytes among ``candidates`` whose leaving makes ``fits`` true (None: none do).
        Parts away from home go first (they should not hold the card); then the smallest single
        model that is enough, else the largest and again."""
        chosen: list[Model] = []
        freed = 0
        for m in [m for m in candidates if m.home != CARD]:
            chosen.append(m)
            freed += m.card_bytes
            if fits(freed):
                return chosen
        rest = sorted((m for m in candidates if m.home == CARD), key=lambda m: m.card_bytes)
        while rest:
            single = next((m for m in rest if fits(freed + m.card_bytes)), None)
            if single is not None:
                return [*chosen, single]
            big = rest.pop()
            chosen.append(big)
            freed += big.card_bytes
        return None

    def room(
        self,
        stage: str,
        uses: Iterable[Model] = (),
        fits: Callable[[int], bool] | None = None,
        *,
        why: str = "",
        may_move: Callable[[Model], bool] | None = None,
    ) -> Room:
        """Make the stage fit (see the module docstring); the moves are undone by :meth:`end`.
        ``fits=None``: move every candidate (the stage ran out of memory with them there)."""
        uses = list(uses)
        with self._lock:
            cands = self.candidates(uses, may_move)
            if fits is not None and fits(0):
                return Room(stage, True)
            chosen = self.choose(cands, fits) if fits is not None else list(cands)
            if chosen is None:
                return Room(stage, False)
            if stage:
                self._stages.setdefault(stage, [])  # (undone by end(stage), begun or not)
            for m in chosen:
                self._move(m, HOST, stage, why or f"{stage.replace('_', ' ')} needs the room")
            return Room(stage, True, list(chosen))

    def use(self, model: Model, stage: str = "", *, why: str = "") -> None:
        """``model`` is needed on the card now (room is made for it first). An out-of-memory error
        on the way leaves it in host memory and propagates: what needed it cannot run."""
        with self._lock:
            if model.where != HOST:
                return
            what = why or f"{stage.replace('_', ' ') or 'a module of it runs'}"
            stage = stage or (self._order[-1] if self._order else "")  # "": undone by settle()
            why_room = f"the {model.name} need{'' if model.name.endswith('s') else 's'} the room"
            work = model.nbytes + min(model.nbytes // 4, WAKE_HEADROOM_BYTES)  # (and its forward's)
            for need in (work, model.nbytes):  # (room for the weights alone where no more can be made)
                if self.room(
                    stage, [model], lambda freed, n=need: n <= self.free() + freed, why=why_room
                ).fits:
                    break
            self._move(model, CARD, stage, what)

    def streams(self, model: Model, resident_bytes: int, stage: str, why: str) -> Callable[[], None]:
        """``model`` streams for ``stage`` (its streamer moves the weights): ``resident_bytes`` of it
        stay on the card. Returns the undo (the stage's end: the whole model on the card again)."""
        with self._lock:
            was = (model.where, model.resident_bytes)
            model.where, model.resident_bytes = STREAMED, resident_bytes
            text = f"{model.name} streams for {stage.replace('_', ' ')}: {resident_bytes / MiB:.0f} of "
            self.moves.append(Move(model.name, STREAMED, stage, why, model.nbytes - resident_bytes, 0.0))
            logger.info("VRAM Guard: %s%.0f MiB resident: %s", text, model.nbytes / MiB, why)

        def undo() -> None:
            with self._lock:
                model.where, model.resident_bytes = was

        return undo

    def settle(
        self,
        keep: Iterable[Model] = (),
        roles: Iterable[str] | None = None,
        *,
        why: str = "used before this stage",
    ) -> int:
        """Models woken outside any stage go home unless in ``keep`` or busy (``roles``: only
        those of these roles); returns the bytes moved."""
        keep_ids = {id(m) for m in keep} | self.busy
        only = None if roles is None else set(roles)

        def stays(m: Model) -> bool:
            return id(m) in keep_ids or (only is not None and m.role not in only)

        with self._lock:
            todo = [(m, w) for m, w in self._loose if not stays(m)]
            self._loose = [(m, w) for m, w in self._loose if stays(m)]
            return self._home(todo, why)

    def begin(self, stage: str, busy: Iterable[Model] = ()) -> None:
        """A stage starts: its models are busy until :meth:`end`; loose wakes go home."""
        with self._lock:
            self._stages.setdefault(stage, [])
            if stage not in self._order:
                self._order.append(stage)
            busy = list(busy)
            self.busy.update(id(m) for m in busy)
            self._busy_of[stage] = [id(m) for m in busy]
        self.settle(busy)

    def end(self, stage: str) -> int:
        """The stage is over: every model moved for it goes home (see :meth:`_home`)."""
        with self._lock:
            moves = self._stages.pop(stage, [])
            if stage in self._order:
                self._order.remove(stage)
            used = self._busy_of.pop(stage, [])
            for i in used:
                self.busy.discard(i)
            # the stage's own models that wait elsewhere go home too, wherever their wake was
            # recorded (a forward pre-hook can wake one just before the stage began)
            mine = [(m, CARD) for m in self.models if id(m) in used and m.home == HOST and m.where == CARD]
            self._loose = [(m, w) for m, w in self._loose if id(m) not in used]
            return self._home(moves + mine, f"{stage.replace('_', ' ')} is done")

    @contextlib.contextmanager
    def computing(self, models: Iterable[Model]) -> Iterator[None]:
        """``models`` are busy (never moved) while the enclosed forward runs."""
        with self._lock:
            new = {id(m) for m in models} - self.busy
            self.busy |= new
        try:
            yield
        finally:
            with self._lock:
                self.busy -= new

    def send_home(self, models: Iterable[Model], why: str) -> int:
        """These models go home now, outside any stage (an extension's models at the job's end)."""
        with self._lock:
            return self._home([(m, m.where) for m in models], why)

    def open_stages(self) -> list[str]:
        with self._lock:
            return list(self._stages)

    def _record(self, model: Model, stage: str, was: str) -> None:
        if not stage and self._order:
            stage = self._order[-1]  # a wake inside an open stage is undone at its end
        if stage and stage in self._stages:
            self._stages[stage].append((model, was))
        else:
            self._loose.append((model, was))

    def _move(
        self, model: Model, to: str, stage: str, why: str, *, record: bool = True, home: bool = False
    ) -> None:
        was = model.where
        if was == to:
            return
        t0 = time.perf_counter()
        if to == CARD and home:
            getattr(model.mover, "return_home", model.mover.to_card)()
        elif to == CARD:
            model.mover.to_card()
        else:
            model.mover.to_host()
        model.where = to
        move = Move(model.name, to, stage, why, model.nbytes, time.perf_counter() - t0)
        self.moves.append(move)
        logger.info("VRAM Guard: %s", move.text)
        if record:
            self._record(model, stage, was)

    def _home(self, moves: list[tuple[Model, str]], why: str) -> int:
        """Each model of ``moves`` back to its home (once, latest first). A move back to the card
        that runs out of memory releases and tries once more; if that fails too the model stays in
        host memory until it is used (a warning says so)."""
        done: set[int] = set()
        n = 0
        for model, was in reversed(moves):
            if id(model) in done or model not in self.models:
                continue
            done.add(id(model))
            if id(model) in self.busy:  # (a decode on another stage still runs with it)
                self._loose.append((model, was))
                continue
            target = model.home if model.home != STREAMED else CARD
            if model.where == target or (model.home == STREAMED and model.where == STREAMED):
                continue
            for retry in (False, True):
                try:
                    self._move(model, target, "", why, record=False, home=True)
                    n += model.nbytes
                    break
                except Exception as exc:
                    if target != CARD or not is_oom_error(exc):
                        raise
                    if retry:
                        logger.warning(
                            "VRAM Guard: the %s stay on the CPU until used: moving them back ran out of "
                            "memory",
                            model.name,
                        )
                    elif self.release is not None:
                        self.release()
        return n
