from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lib_vram.planning.planner import (
    Candidate,
    Outcome,
    PlanMemory,
    choose,
    choose_learned,
    order,
)

MiB = 2**20

LADDER = [
    Candidate("untiled", 3000 * MiB),
    Candidate("tile 128", 1400 * MiB, 128),
    Candidate("tile 96", 900 * MiB, 96),
    Candidate("tile 64", 600 * MiB, 64),
    Candidate("tile 32", 450 * MiB, 32),
]


@pytest.mark.parametrize(
    ("free_mib", "margin_mib", "plan", "fits"),
    [
        (8000, 500, "untiled", True),
        (3500, 500, "untiled", True),  # exactly at the budget
        (3499, 500, "tile 128", True),
        (1200, 256, "tile 96", True),
        (1000, 256, "tile 64", True),
        (706, 256, "tile 32", True),
        (400, 256, "tile 32", False),  # nothing fits: smallest peak, warned
        (0, 0, "tile 32", False),
    ],
)
def test_choose_table(free_mib, margin_mib, plan, fits):
    c = choose(LADDER, free_mib * MiB, margin_mib * MiB)
    assert (c.plan, c.fits) == (plan, fits)
    assert c.budget_bytes == (free_mib - margin_mib) * MiB
    assert (c.warning is None) == fits
    if not fits:
        assert "tile 32" in c.warning and "out-of-memory" in c.warning


def test_order_prefers_untiled_then_big_tiles_then_big_batches():
    cands = [Candidate("a", 1, 64, 1), Candidate("b", 1, 64, 4), Candidate("c", 1), Candidate("d", 1, 128, 1)]
    assert [c.plan for c in order(cands)] == ["c", "d", "b", "a"]


def test_bad_arguments_name_themselves():
    with pytest.raises(ValueError, match="`candidates`"):
        choose([], 1, 0)
    with pytest.raises(ValueError, match="`free_bytes`"):
        choose(LADDER, -1, 0)
    with pytest.raises(ValueError, match="`safety_margin_bytes`"):
        choose(LADDER, 1, -1)
    with pytest.raises(ValueError, match="`batch`"):
        Candidate("x", 1, 64, 0)


# A candidate set whose peak grows with the tile (as real predictions do).
candidate_sets = st.lists(
    st.tuples(st.integers(8, 512), st.integers(1, 8)), min_size=1, max_size=12, unique=True
).map(
    lambda tbs: [Candidate(f"tile {t} x{b}", t * t * b * 1000 + 10**6, t, b) for t, b in tbs]
    + [Candidate("untiled", 600 * 600 * 9 * 1000)]
)


@settings(max_examples=200, deadline=None)
@given(candidate_sets, st.integers(0, 2**34), st.integers(0, 2**34), st.integers(0, 2**28))
def test_more_memory_never_gives_a_smaller_tile(cands, free_a, free_b, margin):
    lo, hi = sorted((free_a, free_b))
    small, big = choose(cands, lo, margin), choose(cands, hi, margin)
    # Preference never gets worse with more memory; in particular the tile never shrinks.
    assert big.candidate.preference <= small.candidate.preference or not small.fits
    if small.fits:
        assert big.fits
        if big.candidate.tile is not None:
            assert small.candidate.tile is not None and big.candidate.tile >= small.candidate.tile
    assert big.candidate.peak_bytes <= max(hi - margin, big.candidate.peak_bytes)


@settings(max_examples=100, deadline=None)
@given(candidate_sets, st.integers(0, 2**34), st.integers(0, 2**28))
def test_choice_fits_iff_some_candidate_fits(cands, free, margin):
    c = choose(cands, free, margin)
    assert c.fits == any(x.peak_bytes <= free - margin for x in cands)
    if c.fits:
        assert c.candidate.peak_bytes <= free - margin


def test_memory_avoids_a_plan_that_ran_out_of_memory():
    mem = PlanMemory()
    key = ("vae_decode", "sdxl", 2048, 2048)
    first = choose_learned(key, LADDER, 2000 * MiB, 0, mem)
    assert first.plan == "tile 128"
    mem.record(key, Outcome(first.plan, first.predicted_peak_bytes, oom=True))
    again = choose_learned(key, LADDER, 2000 * MiB, 0, mem)
    assert again.plan == "tile 96"
    # Another shape is unaffected.
    assert choose_learned(("other",), LADDER, 2000 * MiB, 0, mem).plan == "tile 128"
    assert mem.history(key)[0].oom


def test_memory_scales_predictions_by_measured_ratio():
    mem = PlanMemory()
    key = ("upscale", "rrdb")
    mem.record(key, Outcome("tile 96", 900 * MiB, measured_peak_bytes=1200 * MiB))
    # 900 MiB predicted became 1200 measured: tile 96 (now 1200) no longer fits 1000 MiB.
    assert choose_learned(key, LADDER, 1000 * MiB, 0, mem).plan == "tile 64"
    # A measurement below the prediction never lowers the correction.
    mem.record(key, Outcome("tile 64", 600 * MiB, measured_peak_bytes=300 * MiB))
    assert choose_learned(key, LADDER, 1000 * MiB, 0, mem).plan == "tile 64"
    mem.clear()
    assert choose_learned(key, LADDER, 1000 * MiB, 0, mem).plan == "tile 96"
