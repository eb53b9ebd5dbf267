"""Release policy: which stage boundaries free memory.

:class:`ReleasePolicy` runs :func:`lib_vram.core.device.release` at the boundaries a preset names
(:data:`RELEASE_POINTS`). :meth:`ReleasePolicy.stage` wraps a stage so that the
release also happens when the stage raises or the job is interrupted: before releasing, it clears
the local variables of the failed stage's frames (the traceback keeps them - and every tensor they
hold - alive while the exception propagates, which is why a plain ``torch.cuda.empty_cache()`` in an
``except`` block frees nothing).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import traceback
from collections.abc import Callable, Iterable, Iterator

from .device import ReleaseResult, release

logger = logging.getLogger(__name__)

RELEASE_POINTS: tuple[str, ...] = (
    "process",
    "before_hr",
    "post_sample",
    "postprocess_batch",
    "job_end",
    "failure",
)
"""Stage boundaries where :func:`release_at` may run ``gc.collect()`` + cache release:

* ``process`` - job start, before the text encoder and UNet run (drops leftovers of the last job);
* ``before_hr`` - between the first pass and hires fix (the first-pass decode/upscale leftovers);
* ``post_sample`` - after sampling, before the VAE decode (the sampler's activations);
* ``postprocess_batch`` - after each batch's images are decoded;
* ``job_end`` - after the job;
* ``failure`` - when a stage raises or the job is interrupted (always recommended: the traceback's
  frames keep tensors alive until collected).
"""


class ReleasePolicy:
    """Release memory at the stage boundaries in ``points``.

    Args:
        points: boundary names (subset of :data:`RELEASE_POINTS`), e.g. a
            preset's ``release_at``.
        device: the device whose cache is released (default: the best available).
        releaser: the release function (default :func:`lib_vram.core.device.release`).
    """

    def __init__(
        self,
        points: Iterable[str],
        device: object | None = None,
        releaser: Callable[..., ReleaseResult] | None = None,
    ) -> None:
        pts = frozenset(points)
        unknown = pts - set(RELEASE_POINTS)
        if unknown:
            raise ValueError(f"`points` has unknown boundaries {sorted(unknown)}; known: {RELEASE_POINTS}")
        self.points = pts
        self.device = device
        self._release = releaser or release
        self._lock = threading.Lock()
        self.log: list[tuple[str, ReleaseResult]] = []
        """Every release done: (boundary, result), oldest first (last 64 kept)."""

    def at(self, point: str) -> ReleaseResult | None:
        """Release if ``point`` is one of the policy's boundaries; return what was freed."""
        if point not in RELEASE_POINTS:
            raise ValueError(f"`point` must be one of {RELEASE_POINTS}, got {point!r}")
        if point not in self.points:
            return None
        result = self._release(self.device)
        with self._lock:
            self.log.append((point, result))
            del self.log[:-64]
        logger.debug("release at %s: %d objects collected", point, result.collected_objects)
        return result

    @contextlib.contextmanager
    def stage(self, after: str | None = None) -> Iterator[None]:
        """Run a stage; release at ``after`` when it succeeds, at ``"failure"`` when it raises
        (any exception, ``KeyboardInterrupt`` included - the WebUI's interrupt)."""
        if after is not None and after not in RELEASE_POINTS:
            raise ValueError(f"`after` must be one of {RELEASE_POINTS} or None, got {after!r}")
        try:
            yield
        except BaseException as exc:
            if "failure" in self.points:
                # Frames below this one have finished: drop their locals (tensors) now.
                tb = exc.__traceback__
                if tb is not None and tb.tb_next is not None:
                    traceback.clear_frames(tb.tb_next)
                del tb
                self.at("failure")
            raise
        if after is not None:
            self.at(after)
