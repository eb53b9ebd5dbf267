"""'FP16 UNet': run an FP32 UNet in FP16 for one WebUI job, then put back exactly what was there.

When the WebUI runs the UNet in FP32 (``--no-half``), the option casts the diffusion model
(``sd_model.model.diffusion_model``, an ldm/sgm ``UNetModel``) to FP16 for the job and puts the
WebUI into the state its own ``--upcast-sampling`` mode uses, so the sampler feeds it correctly
(host-api §3, §4.1):

* ``devices.dtype_unet = float16``: the hijacked ``apply_model`` casts the latent, the timestep and
  every conditioning tensor to it;
* ``devices.unet_needs_upcast = True``: ``apply_model`` returns FP32 outputs to the sampler, the
  timestep embedding is made in the UNet's dtype, hypernetworks and (CUDA) GEGLU/GroupNorm32 are
  computed in FP32;
* ``diffusion_model.dtype = float16`` where the model has that attribute (ldm's ``UNetModel.forward``
  casts its input to it; SDXL's copy is read by the WebUI's first-stage hijack).

What is cast: every FP32 parameter and buffer, **in place** (``param.data``), so the modules, the
parameter objects, and the ``--lowvram``/``--medvram`` hooks on them stay as they are; except the
``GroupNorm32`` layers (they normalise in FP32 anyway and would fail with FP16 weights). A weight
that FP16 holds exactly (all of them for the usual FP16-distributed checkpoints) needs nothing to
be restored; for any other, the FP32 original is kept in CPU memory (the tensor itself if it is
already there). The restore puts every original back bit for bit, keeps the parameter objects, and
keeps a weight that somebody else changed during the job (a LoRA merged into the weights): that one
is widened to FP32 instead; a backup the built-in Lora extension took of an FP16-cast weight during
the job is replaced by the FP32 original, so its next un-merge is exact too.

When it is restored: at the end of the job (the job's ``ExitStack``: postprocess, the ``p.close``
safety net after an exception, the next ``process()``, script unload), and just before the WebUI
loads other weights into the same model object (a hires checkpoint or the Refiner with one
checkpoint in memory: ``sd_models.load_model_weights`` calls ``model.before_load_weights``), so new
weights are never loaded into a half-cast model. A model that becomes current during the job
(hires checkpoint, Refiner, X/Y/Z) is cast too, at ``on_model_loaded``, before each sampling pass
and at each sampling step (``on_cfg_denoiser``, which also catches a cached model switched in
without ``on_model_loaded``); every model the job cast is restored at its end.

Skipped, with a note in the log, the readout and under the image, for each reason of
:data:`SKIP_NOTES`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch

from lib_vram.core.device import Backend, backend_of, capabilities, is_oom_error, release

from .host import UNetState, ask

logger = logging.getLogger(__name__)

FP16_STATE = UNetState(torch.float16, True)
"""The WebUI state an FP16 UNet needs (what ``--upcast-sampling`` sets)."""

KEEP_FP32 = frozenset({"GroupNorm32"})
"""Classes (by name, in the MRO) whose parameters stay FP32: ldm/sgm ``GroupNorm32`` normalises
``x.float()``, which needs FP32 weights on every backend."""

ALLOW_CPU = False
"""Cast even when the WebUI computes on the CPU (tests only: CPU FP16 is slow or unsupported)."""

PLAN_KEY = "unet"
"""Key of the UNet's entry in the job's plans (infotext ``VRAM Guard plan``)."""

SKIP_NOTES = {
    "forge": "Forge sets the UNet's precision itself (--unet-in-fp16, 'Diffusion in Low Bits')",
    "cpu": "the WebUI runs the UNet on the CPU, where FP16 convolutions are very slow or unsupported",
    "no fp16": "this device ({device}) has no FP16 support",
    "no unet": "the current model has no UNet VRAM Guard knows",
    "not a unet": "this model's diffusion model ({name}) is not an SD1/SD2/SDXL UNet",
    "not fp32": "the UNet's weights are {dtypes}, not FP32 (FP8 storage?)",
    "fp16 range": "the UNet has weights beyond the FP16 range",
    "out of memory": "casting the UNet ran out of memory",
    "placed": "the checkpoint is placed by VRAM Guard (its streamed UNet blocks keep their FP32 host "
    "copies for the session; turn the placement off to use the FP16 UNet)",
}

_MISSING = object()


class _Overflow(Exception):
    """A weight does not fit into FP16."""


class _Slot:
    """One cast tensor: a parameter (its ``.data`` is swapped) or a buffer (its entry is)."""

    __slots__ = ("backup", "module", "name", "param")

    def __init__(self, param: torch.nn.Parameter | None, module: torch.nn.Module | None, name: str) -> None:
        self.param = param
        self.module = module
        self.name = name
        self.backup: torch.Tensor | None = None

    def get(self) -> torch.Tensor:
        if self.param is not None:
            return self.param.data
        return self.module._buffers[self.name]

    def set(self, value: torch.Tensor) -> None:
        if self.param is not None:
            self.param.data = value
        else:
            self.module._buffers[self.name] = value


class UNetCast:
    """The FP16 cast of one diffusion model; :meth:`restore` puts back exactly what was there."""

    def __init__(
        self, owner: Any, diffusion_model: torch.nn.Module, device: torch.device | None = None
    ) -> None:
        self.owner = owner
        self.dm = diffusion_model
        self.device = device
        """The WebUI's compute device (where memory is released before a retry after an OOM)."""
        self.slots: list[_Slot] = []
        self.restored = False
        self.fp32_bytes = 0
        self.backup_bytes = 0
        self._dtype_attr: Any = _MISSING
        self._guard: Callable[..., Any] | None = None
        self._guard_prev: Any = _MISSING

    # -- cast --------------------------------------------------------------------------------
    def cast(self) -> None:
        """Cast every FP32 parameter/buffer to FP16 in place. On any failure (overflow, OOM) the
        tensors cast so far are restored before the exception leaves."""
        seen: set[int] = set()
        try:
            with torch.inference_mode(False), torch.no_grad():
                for module in self.dm.modules():
                    if any(c.__name__ in KEEP_FP32 for c in type(module).__mro__):
                        continue
                    params = [(n, p, p) for n, p in module._parameters.items()]  # (a buffer: no param)
                    for name, param, t in params + [(n, None, b) for n, b in module._buffers.items()]:
                        if t is None or id(t) in seen or t.dtype != torch.float32:
                            continue
                        seen.add(id(t))
                        self._cast_slot(_Slot(param, module, name))
        except BaseException:
            self.restore()
            raise
        dtype = self.dm.__dict__.get("dtype", _MISSING)
        if isinstance(dtype, torch.dtype):
            self._dtype_attr = dtype
            self.dm.dtype = torch.float16

    def _cast_slot(self, slot: _Slot) -> None:
        t = slot.get()
        half = t.to(torch.float16)
        if not torch.equal(half.to(torch.float32), t):
            if not bool(torch.isfinite(half).all()) and bool(torch.isfinite(t).all()):
                raise _Overflow(slot.name)
            slot.backup = t if t.device.type == "cpu" else t.to("cpu", copy=True)
            self.backup_bytes += t.numel() * t.element_size()
        self.fp32_bytes += t.numel() * t.element_size()
        self.slots.append(slot)  # before set(): a failure after this point is still restored
        slot.set(half)

    # -- restore -----------------------------------------------------------------------------
    def restore(self) -> int:
        """Put back every original tensor (idempotent). Returns how many weights somebody else
        changed during the job (kept, widened to FP32)."""
        if self.restored:
            return 0
        self.restored = True
        self.unguard()
        modified = 0
        with torch.inference_mode(False), torch.no_grad():
            for slot in self.slots:
                modified += _retry_after_oom(lambda s=slot: self._restore_slot(s), self.device)
                slot.backup = None
        self.slots = []
        if self._dtype_attr is not _MISSING and self.dm.__dict__.get("dtype") == torch.float16:
            self.dm.dtype = self._dtype_attr
        return modified

    @staticmethod
    def _restore_slot(slot: _Slot) -> int:
        cur = slot.get()
        if cur.device.type == "meta":  # the WebUI threw this model away ("send_model_to_trash")
            return 0
        if slot.backup is None:
            if cur.dtype != torch.float32:
                slot.set(cur.to(torch.float32))  # exact: FP16 held the original
            return 0
        _widen_lora_backup(slot)
        orig = slot.backup if slot.backup.device == cur.device else slot.backup.to(cur.device)
        if torch.equal(cur.to(torch.float16), orig.to(torch.float16)):
            slot.set(orig)
            return 0
        slot.set(cur.to(torch.float32))  # changed during the job (a LoRA merged in): keep it
        return 1

    # -- weights reloaded into the same model ------------------------------------------------
    def guard_reload(self) -> None:
        """Restore this cast when the WebUI is about to load other weights into the same model
        object (``load_model_weights`` calls ``model.before_load_weights(state_dict)`` if the
        attribute exists); the previous instance attribute or class method still runs after."""
        owner = self.owner
        d = getattr(owner, "__dict__", None)
        if d is None:
            return
        cast = self

        def before_load_weights(*args: Any, **kwargs: Any) -> Any:
            cast.restore()
            logger.info("VRAM Guard: FP16 UNet restored before the WebUI loads new weights into the model")
            following = getattr(owner, "before_load_weights", None)
            return following(*args, **kwargs) if callable(following) else None

        self._guard_prev = d.get("before_load_weights", _MISSING)
        self._guard = before_load_weights
        d["before_load_weights"] = before_load_weights

    def unguard(self) -> None:
        d = getattr(self.owner, "__dict__", None)
        if self._guard is None or d is None:
            return
        if d.get("before_load_weights") is self._guard:
            if self._guard_prev is _MISSING:
                del d["before_load_weights"]
            else:
                d["before_load_weights"] = self._guard_prev
        self._guard = None


LORA_BACKUPS = {"weight": "network_weights_backup", "bias": "network_bias_backup"}
"""Where the WebUI's built-in Lora extension keeps a layer's unmerged weight/bias (a CPU copy taken
the first time a LoRA touches the layer, in the layer's dtype at that moment)."""


def _widen_lora_backup(slot: _Slot) -> None:
    """A backup the Lora extension took *during* the job is a copy of our FP16 cast; it would put
    FP16-rounded weights into the FP32 model at its next un-merge. Replace it by the FP32 original
    when it is exactly that copy (anything else is left alone)."""
    attr = LORA_BACKUPS.get(slot.name)
    if attr is None or slot.param is None or slot.module is None or slot.backup is None:
        return
    taken = slot.module.__dict__.get(attr)
    if (
        not isinstance(taken, torch.Tensor)
        or taken.dtype != torch.float16
        or taken.shape != slot.backup.shape
    ):
        return
    if torch.equal(taken, slot.backup.to(taken.device, torch.float16)):
        slot.module.__dict__[attr] = slot.backup.to(taken.device, copy=True)


def _retry_after_oom(fn: Callable[[], int], device: torch.device | None) -> int:
    try:
        return fn()
    except Exception as exc:
        if not is_oom_error(exc):
            raise
    release(device)  # out of the except block: the failed call's tensors are gone with its traceback
    return fn()


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


class UNetFP16:
    """The 'FP16 UNet' option for one :class:`~lib_vram.webui.job.Job` (see the module docstring).

    :meth:`ensure` is called with the WebUI's current model at ``process()``, before every sampling
    pass, at ``on_model_loaded`` and at every sampling step; :meth:`close` (on the job's stack)
    restores everything.
    """

    def __init__(self, job: Any, host: Any, device: torch.device) -> None:
        self.job = job
        self.host = host
        self.device = torch.device(device)
        self.casts: list[UNetCast] = []
        self.saved: UNetState | None = None
        self.closed = False
        self._commented: set[str] = set()

    # -- public ------------------------------------------------------------------------------
    def ensure(self, model: Any) -> bool:
        """Make ``model``'s UNet run in FP16 for the rest of the job; returns whether it does."""
        if self.closed:
            return False
        handle = self.host.unet_of(model)
        dm = handle.diffusion_model if handle is not None else None
        if dm is not None and any(c.dm is dm and not c.restored for c in self.casts):
            self._set_fp16_state()
            return True
        skip = self._skip_reason(handle)
        if skip is not None:
            self._skip(*skip)
            return False
        assert handle is not None and dm is not None
        cast = UNetCast(handle.owner, dm, self.device)
        started = time.perf_counter()
        failed: str | None = None
        try:
            cast.cast()
        except _Overflow:
            failed = "fp16 range"
        except Exception as exc:
            if not is_oom_error(exc):
                raise
            failed = "out of memory"
        if failed is not None:
            if failed == "out of memory":
                release(self.device)
            self._skip(failed, SKIP_NOTES[failed])
            return False
        cast.guard_reload()
        self.casts.append(cast)
        self._set_fp16_state()
        self.job.plans[PLAN_KEY] = "fp16"
        self.job.note(
            f"VRAM Guard: FP16 UNet: {handle.name} weights {_gib(cast.fp32_bytes)} in FP32 -> "
            f"{_gib(cast.fp32_bytes // 2)} in FP16 for this job"
            + (f" (exact FP32 originals kept in RAM: {_gib(cast.backup_bytes)})" if cast.backup_bytes else "")
            + f", cast in {time.perf_counter() - started:.1f} s"
        )
        if getattr(handle.owner, "is_sd2", False) and not ask(self.host, "upcast_attn", False):
            self.job.warn_once(
                "unet-sd2",
                "VRAM Guard: FP16 UNet on an SD 2.x model: enable Settings -> Stable Diffusion -> "
                "'Upcast cross attention layer to float32', or FP16 attention may give NaNs/black images",
            )
        return True

    def close(self) -> None:
        """Restore every cast model and the WebUI's state (idempotent; never raises)."""
        if self.closed:
            return
        self.closed = True
        modified = 0
        try:
            for cast in reversed(self.casts):
                try:
                    modified += cast.restore()
                except Exception:
                    logger.exception("VRAM Guard: restoring the FP32 UNet failed")
                    self.job.note(
                        "VRAM Guard: restoring the FP32 UNet failed (see the log); restart the WebUI"
                    )
        finally:
            self._set_host_state()
            self.casts = []
        if modified:
            self.job.note(
                f"VRAM Guard: FP16 UNet: {modified} UNet weight(s) were changed during the job by "
                "something else (a LoRA?); kept, widened to FP32"
            )

    # -- internals ---------------------------------------------------------------------------
    def _skip_reason(self, handle: Any) -> tuple[str, str] | None:
        if handle is None:
            return "no unet", SKIP_NOTES["no unet"]
        if handle.kind == "forge":
            return "forge", SKIP_NOTES["forge"]
        if handle.kind != "ldm":
            return "not a unet", SKIP_NOTES["not a unet"].format(name=handle.name)
        placement = getattr(getattr(self.job, "session", None), "placement", None)
        if placement is not None and placement.placed_for(handle.owner) is not None:
            return "placed", SKIP_NOTES["placed"]  # (checkpoint placement, issue 22 item 2)
        if backend_of(self.device) is Backend.CPU and not ALLOW_CPU:
            return "cpu", SKIP_NOTES["cpu"]
        if not capabilities(self.device).fp16:
            return "no fp16", SKIP_NOTES["no fp16"].format(device=self.device)
        counts: dict[torch.dtype, int] = {}
        for param in handle.diffusion_model.parameters():
            if param.is_floating_point():
                counts[param.dtype] = counts.get(param.dtype, 0) + param.numel()
        if set(counts) == {torch.float32}:
            return None
        if (
            counts
            and set(counts) <= {torch.float16, torch.float32}
            and max(counts, key=counts.get) == torch.float16
        ):
            # FP16 (with --upcast-sampling the WebUI itself widens GroupNorm32/GEGLU to FP32)
            return "already fp16", ""
        names = ", ".join(sorted(str(d).replace("torch.", "") for d in counts)) or "none"
        return "not fp32", SKIP_NOTES["not fp32"].format(dtypes=names)

    def _skip(self, key: str, why: str) -> None:
        self._set_host_state()  # a UNet we did not cast must not get FP16 inputs
        self.job.plans.setdefault(PLAN_KEY, "already fp16" if key == "already fp16" else f"skipped ({key})")
        if key == "already fp16":
            self.job.note("VRAM Guard: FP16 UNet: the WebUI already runs the UNet in FP16; nothing to change")
            return
        text = f"VRAM Guard: 'FP16 UNet' not applied: {why}"
        p = self.job.p
        if key not in self._commented and p is not None:
            self._commented.add(key)
            self.host.add_comment(p, text)
        self.job.warn_once(f"unet-{key}", text)

    def _set_fp16_state(self) -> None:
        cur = self.host.unet_state()
        if cur != FP16_STATE:
            self.saved = cur  # the host's own value (it may have set a new one at a model load)
            self.host.set_unet_state(FP16_STATE)

    def _set_host_state(self) -> None:
        """Put the WebUI's own state back if ours is still set."""
        if self.saved is not None and self.host.unet_state() == FP16_STATE:
            self.host.set_unet_state(self.saved)
