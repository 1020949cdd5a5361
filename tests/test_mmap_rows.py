"""Reading scattered rows of a memory-mapped array (``train.mmap_rows``)."""

import numpy as np

from specdraft.train.mmap_rows import PAGE, open_random, read_rows, row_ranges


def test_row_ranges_cover_each_run_of_rows_from_its_page():
    rows = np.array([0, 1, 2, 7, 9, 10])
    ranges = row_ranges(rows, row_bytes=1000, data_start=128)
    assert len(ranges) == 3  # runs 0-2, 7, 9-10
    for (start, length), (first, last) in zip(ranges, [(0, 2), (7, 7), (9, 10)]):
        assert start % PAGE == 0
        assert start <= 128 + first * 1000 and start + length == 128 + (last + 1) * 1000
    assert row_ranges(np.array([], dtype=np.int64), 1000, 0) == []


def test_read_rows_equals_plain_indexing(tmp_path):
    """Rows across page and allocation boundaries, through a map advised for random access."""
    data = np.arange(3000 * 37, dtype=np.int16).reshape(3000, 37)
    np.save(tmp_path / "a.npy", data)
    array = open_random(tmp_path / "a.npy")
    rows = np.sort(np.random.default_rng(0).choice(3000, 400, replace=False))
    rows = np.concatenate([rows, [2999]])
    assert np.array_equal(read_rows(array, np.unique(rows)), data[np.unique(rows)])
