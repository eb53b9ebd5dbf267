"""'Profile the next job': the next generation's VRAM Guard stages under the PyTorch profiler.

The accordion's button arms the session (:meth:`ProfileSwitch.toggle`); the next job that opens
takes the switch (it turns itself off: one job only) and gets a :class:`JobProfiler`. Every
VRAM Guard stage of that job that runs on the job's thread (VAE decode/encode, upscale) then runs
inside a :class:`~lib_vram.core.profiling.StageProfiler`; when the stage ends, also by an error or
an interrupt, the profiler is stopped and its Chrome trace, summary (JSON) and, on CUDA, memory
snapshot are written into ``vram-guard-profiles/`` of the WebUI's outputs folder (each file
atomically, never over an existing one). The readout and the status route (key ``profile``) then
name the top operators of each stage and link the files through the WebUI's ``file=`` route, which
serves them under the page's own access control.

Nothing here is saved in presets or the infotext: it is a one-shot switch of this WebUI session.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

FOLDER = "vram-guard-profiles"
"""Subfolder of the WebUI's outputs folder the profiles go to."""
BUTTON_TOOLTIP = (
    "Run the next generation's VRAM Guard stages (VAE, upscale) under the PyTorch profiler and write "
    "its trace, summary and (on CUDA) memory snapshot to outputs/vram-guard-profiles; the readout "
    "names the operators that took the memory and links the files. One job only; click again to cancel."
)
TOP_IN_STATUS = 10


class JobProfiler:
    """Profiles the VRAM Guard stages of one job (see the module docstring)."""

    def __init__(self, folder: Path, *, kind: str, device: Any, thread: int, host: Any = None) -> None:
        self.folder = Path(folder)
        self.kind = kind
        self.device = device
        self.thread = thread
        self.host = host
        self.stamp = time.strftime("%Y%m%d-%H%M%S")
        self.stages: list[dict] = []
        self.notes: list[str] = []

    def note(self, text: str) -> None:
        if text not in self.notes:
            self.notes.append(text)
            logger.warning("%s", text)

    @contextlib.contextmanager
    def stage(self, name: str) -> Iterator[None]:
        """Run the block under the profiler (on the job's thread; elsewhere, e.g. a live preview's
        decode, it runs as it is). The profiler is stopped however the block ends."""
        from lib_vram.core.profiling import StageProfiler, profiler_running

        prof = None
        if threading.get_ident() == self.thread and profiler_running():
            self.note(f"VRAM Guard profile: {name} not profiled, another PyTorch profiler is running")
        elif threading.get_ident() == self.thread:
            prof = StageProfiler(name, self.device)
            try:
                prof.__enter__()
            except RuntimeError as exc:
                prof = None
                self.note(f"VRAM Guard profile: {name} not profiled ({exc})")
        if prof is None:
            yield
            return
        try:
            yield
        except BaseException as exc:
            self._finish(prof, name, exc)
            raise
        self._finish(prof, name, None)

    def _finish(self, prof: Any, name: str, exc: BaseException | None) -> None:
        """Stop the profiler and keep its files; a failure of the profiler itself is a note (it must
        never fail the job, nor replace the stage's own error)."""
        try:
            prof.__exit__(type(exc) if exc is not None else None, exc, getattr(exc, "__traceback__", None))
        except Exception as err:
            self.note(f"VRAM Guard profile: {name}: the profiler failed ({type(err).__name__}: {err})")
            return
        self._keep(prof, name)

    def _keep(self, prof: Any, name: str) -> None:
        """Write the files of one profiled stage; a failure to write is a note, never an error."""
        summary = prof.summary
        files: dict[str, str] = {}
        base = f"{self.stamp}-{self.kind}-{name}"
        try:
            for n in range(1, 100):
                stem = base if n == 1 else f"{base}-{n}"
                if any(p.exists() for p in prof.outputs(self.folder, stem).values()):
                    continue
                try:
                    written = prof.save(self.folder, stem)
                except FileExistsError:
                    continue
                files = {k: str(v) for k, v in written.items()}
                break
        except OSError as exc:
            self.note(f"VRAM Guard profile: could not write the {name} profile into {self.folder} ({exc})")
        register = getattr(self.host, "register_file", None)
        for path in files.values():
            if register is not None:
                try:
                    register(path)
                except (AttributeError, ImportError, RuntimeError) as exc:
                    logger.debug("could not register %s with the page: %s", path, exc)
        entry = {
            "stage": name,
            "ok": summary.ok if summary else False,
            "error": summary.error if summary else None,
            "seconds": round(summary.seconds, 3) if summary else None,
            "peak_bytes": summary.peak_bytes if summary else None,
            "alloc_bytes": summary.alloc_bytes if summary else None,
            "top": [
                {"name": op.name, "calls": op.calls, "alloc_bytes": op.alloc_bytes, "net_bytes": op.net_bytes}
                for op in (summary.top(TOP_IN_STATUS) if summary else [])
            ],
            "files": files,
        }
        self.stages.append(entry)

    def result(self) -> dict:
        return {
            "kind": self.kind,
            "folder": str(self.folder),
            "stages": list(self.stages),
            "notes": list(self.notes),
        }


class ProfileSwitch:
    """The session's one-shot switch and the last profiled job's result."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.armed = False
        self.last: dict | None = None

    def toggle(self) -> bool:
        with self._lock:
            self.armed = not self.armed
            return self.armed

    def attach(self, job: Any, host: Any) -> JobProfiler | None:
        """Give ``job`` a :class:`JobProfiler` when the switch is armed (and turn it off: one job)."""
        with self._lock:
            armed, self.armed = self.armed, False
        if not armed:
            return None
        try:
            folder = Path(host.profiles_dir())
        except (AttributeError, ImportError, OSError) as exc:
            logger.warning("VRAM Guard profile: no outputs folder (%s); the job is not profiled", exc)
            return None
        job.profiler = JobProfiler(folder, kind=job.kind, device=job.device, thread=job.thread, host=host)
        job.note(f"VRAM Guard: profiling this job's stages into {folder}")
        return job.profiler

    def finished(self, job: Any) -> None:
        profiler = getattr(job, "profiler", None)
        if profiler is not None:
            self.last = profiler.result()

    def payload(self) -> dict:
        return {"armed": self.armed, "last": self.last}
