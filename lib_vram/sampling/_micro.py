"""Run a UNet forward in micro-batches, halving them on an out-of-memory error."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Hashable
from typing import Any

import torch

from lib_vram.core.device import is_oom_error, release
from lib_vram.planning import planner

from ._plan import candidate_for

logger = logging.getLogger(__name__)


def _split(obj: Any, batch: int, start: int, stop: int) -> Any:
    """``obj`` with every tensor whose dim 0 is ``batch`` cut to ``[start:stop]`` (also inside
    lists, tuples and dicts); anything else passes unchanged."""
    if isinstance(obj, torch.Tensor):
        return obj[start:stop] if obj.dim() > 0 and obj.shape[0] == batch else obj
    if isinstance(obj, (list, tuple)):
        parts = [_split(o, batch, start, stop) for o in obj]
        return type(obj)(parts) if not hasattr(obj, "_fields") else type(obj)(*parts)
    if isinstance(obj, dict):
        return {k: _split(v, batch, start, stop) for k, v in obj.items()}
    return obj


def _cat(outs: list[Any]) -> Any:
    first = outs[0]
    if isinstance(first, torch.Tensor):
        return first if len(outs) == 1 else torch.cat(outs, dim=0)
    if isinstance(first, (list, tuple)):
        parts = [_cat([o[i] for o in outs]) for i in range(len(first))]
        return type(first)(parts) if not hasattr(first, "_fields") else type(first)(*parts)
    raise TypeError(f"micro_batched: cannot concatenate outputs of type {type(first).__name__}")


def _batch_of(args: tuple, kwargs: dict) -> int | None:
    for a in list(args) + list(kwargs.values()):
        if isinstance(a, torch.Tensor) and a.dim() > 0:
            return int(a.shape[0])
    return None


class MicroBatched:
    """``forward`` with its batch split into micro-batches (see :func:`micro_batched`)."""

    def __init__(
        self,
        forward: Callable[..., Any],
        micro_batch: int,
        *,
        key: Hashable | None = None,
        memory: planner.PlanMemory | None = None,
    ) -> None:
        if not callable(forward):
            raise ValueError("`forward` must be callable")
        if not isinstance(micro_batch, int) or isinstance(micro_batch, bool) or micro_batch < 1:
            raise ValueError(f"`micro_batch` must be an integer >= 1, got {micro_batch!r}")
        self.forward = forward
        self.micro_batch = micro_batch
        self.key = key
        self.memory = planner.MEMORY if memory is None else memory
        self.ooms = 0
        """Out-of-memory errors absorbed so far."""
        self._reported_ok = False
        functools.update_wrapper(self, forward)

    def _report(self, m: int, oom: bool) -> None:
        if self.key is None:
            return
        cand = candidate_for(self.key, m)
        if cand is None:
            # no plan was made for this key: learn the size only (a prediction of "huge" leaves the
            # memory's prediction cap out of it; the size rule rules out m and larger)
            cand = planner.Candidate(f"micro-batch {m}", planner.EXCLUDED, None, m)
        self.memory.record(self.key, planner.Outcome.of(cand, oom=oom))

    def _out_of_memory(self, m: int) -> None:
        release()
        self.ooms += 1
        self._report(m, oom=True)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        batch = _batch_of(args, kwargs)
        if batch is None:
            return self.forward(*args, **kwargs)
        outs: list[Any] = []
        start = 0
        while start < batch:
            m = min(self.micro_batch, batch)
            stop = min(batch, start + m)
            failed = False
            try:
                if start == 0 and stop == batch:
                    out = self.forward(*args, **kwargs)
                else:
                    a = _split(args, batch, start, stop)
                    k = _split(kwargs, batch, start, stop)
                    out = self.forward(*a, **k)
            except Exception as exc:  # an out-of-memory error of any backend; others propagate
                if not is_oom_error(exc) or m <= 1:
                    raise
                failed = True
            if failed:
                # outside the except block: the traceback's frames (and their tensors) are gone
                self._out_of_memory(m)
                self.micro_batch = max(1, m // 2)
                self._reported_ok = False
                logger.info(
                    "UNet forward ran out of memory at micro-batch %d: retrying at %d", m, self.micro_batch
                )
                continue
            outs.append(out)
            del out
            start = stop
        result = self._join(outs, min(self.micro_batch, batch))
        if not self._reported_ok:
            self._report(min(self.micro_batch, batch), oom=False)
            self._reported_ok = True
        return result

    def _join(self, outs: list[Any], m: int) -> Any:
        """The chunks' outputs concatenated; an out-of-memory error there (the step's last
        allocation) is reported for ``m``, memory released and the concatenation tried once more
        (the chunks are done: a smaller micro-batch would not make it smaller)."""
        try:
            return _cat(outs)
        except Exception as exc:  # an out-of-memory error of any backend; others propagate
            if not is_oom_error(exc):
                raise
        self._out_of_memory(m)  # out of the except block: the traceback's tensors are gone
        logger.info("UNet outputs' concatenation ran out of memory: released, trying once more")
        return _cat(outs)


def micro_batched(
    forward: Callable[..., Any],
    micro_batch: int,
    *,
    key: Hashable | None = None,
    memory: planner.PlanMemory | None = None,
) -> MicroBatched:
    """``forward`` (a UNet's or the WebUI's inner model's) with its batch split into micro-batches.

    Every tensor argument (positional or keyword, also inside lists, tuples and dicts: ControlNet's
    ``control`` list, sgm's conditioning dict) whose dim 0 equals the batch (the first tensor
    argument's dim 0) is cut into chunks of ``micro_batch``; tensors whose dim 0 differs pass
    unchanged. The chunks run in order and their outputs are concatenated along dim 0.

    On an out-of-memory error (:func:`lib_vram.core.device.is_oom_error`) the wrapper leaves the
    ``except`` block, releases cached memory, halves the micro-batch and redoes the step from the
    chunk that failed (chunks done are kept); at micro-batch 1 it re-raises. Each error and the
    micro-batch that then worked are reported to ``memory`` (default
    :data:`lib_vram.planning.planner.MEMORY`) under ``key`` (:attr:`SamplingPlan.key`), so the next
    :func:`plan_sampling` for that key does not choose the failed micro-batch again. The reduced
    micro-batch also stays for the wrapper's later calls (the sampler's next steps).

    Each sample's result: every layer of an SD UNet computes each sample from that sample alone
    (GroupNorm, LayerNorm and attention normalise within a sample; there is no batch statistic), so
    a chunk's rows are the same mathematical function of the same inputs. On the same kernels they
    are bit-identical; a kernel may choose another blocking for another batch size (oneDNN
    convolutions and GEMMs on the CPU, cuBLAS/cuDNN heuristics on CUDA), which reorders the sums of
    a dot product: then each output differs by float rounding of those sums, bounded per layer by
    ``k * eps * sum(|w_i x_i|)`` for a reduction of length ``k`` (``eps`` of the dtype), not by a
    systematic error. The tests check bit-identity where the micro-batch only changes the outer
    batch loop and this bound otherwise.
    """
    return MicroBatched(forward, micro_batch, key=key, memory=memory)
