"""Residency: the one owner of the card (which model is where, and every move) and the placed plan
of a checkpoint that does not fit it.

Public API:

* :class:`Owner`, :class:`Model`, :class:`Mover`, :class:`Room`, :class:`Move` (``_owner.py``):
  every model of the session with its bytes, home and place; each stage's room; the moves.
* :func:`plan_checkpoint` -> :class:`CheckpointPlan` (``_place.py``): the UNet's resident and
  streamed parts, the parked parts, the host memory it takes.
* :mod:`.controlnet`: sd-webui-controlnet's control models in the owner (duck-typed), and its
  moves on the emulated card.

Host-free: the package imports torch, the core and the sampling engine, never the WebUI.
"""

from __future__ import annotations

from ._owner import CARD, HOST, STREAMED, Model, Move, Mover, Owner, Room
from ._place import CheckpointPlan, host_shortfall, plan_checkpoint

__all__ = [
    "CARD",
    "HOST",
    "STREAMED",
    "CheckpointPlan",
    "Model",
    "Move",
    "Mover",
    "Owner",
    "Room",
    "host_shortfall",
    "plan_checkpoint",
]
