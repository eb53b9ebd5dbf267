"""Residency: the one owner of the card (:class:`Owner`, ``_owner.py``: which model is where, and
every move), the placed plan of a checkpoint that does not fit it (:func:`plan_checkpoint`,
``_place.py``) and sd-webui-controlnet's control models in the owner (:mod:`.controlnet`).

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
