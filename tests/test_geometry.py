from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from lib_vram.core.geometry import grid, overhead, split_axis


@given(
    length=st.integers(1, 5000),
    tile_units=st.integers(1, 64),
    align=st.sampled_from([1, 2, 8]),
    halo=st.integers(0, 40),
)
def test_cores_partition_and_respect_bounds(length, tile_units, align, halo):
    tile = tile_units * align
    spans = split_axis(length, tile, halo, align=align)
    assert spans[0].core_start == 0 and spans[-1].core_end == length
    for a, b in zip(spans, spans[1:]):
        assert a.core_end == b.core_start
    sizes = [s.core_end - s.core_start for s in spans]
    assert all(0 < s <= max(tile, align) for s in sizes)
    assert max(sizes) - min(sizes) <= 2 * align
    for s in spans:
        assert s.core_start % align == 0
        assert s.start == max(0, s.core_start - halo) and s.end == min(length, s.core_end + halo)
    # Minimal number of tiles.
    units = math.ceil(length / align)
    assert len(spans) == math.ceil(units / tile_units)


def test_grid_and_overhead():
    tiles = grid(100, 60, 50, halo=5)
    assert len(tiles) == 2 * 2
    assert sum((t.y.core_end - t.y.core_start) * (t.x.core_end - t.x.core_start) for t in tiles) == 100 * 60
    assert overhead(tiles, 100, 60) > 1.0
    assert overhead(grid(64, 64, 64), 64, 64) == 1.0


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(length=0, tile=8), "length"),
        (dict(length=8, tile=0), "tile"),
        (dict(length=8, tile=8, halo=-1), "halo"),
        (dict(length=8, tile=12, align=8), "align"),
    ],
)
def test_bad_arguments_name_the_argument(kwargs, name):
    with pytest.raises(ValueError, match=name):
        split_axis(**kwargs)
