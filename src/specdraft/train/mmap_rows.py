"""Scattered rows of memory-mapped arrays, read from disk without readahead amplification.

A fit's corpus (h_t and the fused layers' states per trained position, bfloat16) outgrows
the page cache: 14.3M tokens of ShareGPT take 46 GB, on a machine with 24 GB. Training reads
random blocks of 16 consecutive positions (74 KB per block) from anywhere in it. Through a
plain memory map each page fault on an uncached block reads the device's readahead window
around it (`read_ahead_kb`, 8 MB on this VM's virtio disk): a live fit read 420-450 MB/s from
disk for the ~10 MB/s it used, and its two cores idled at 13-14% iowait (130% CPU of 200%).

So the large arrays are mapped with MADV_RANDOM (a fault reads its own page only), and before
a batch's rows are copied out each run of consecutive rows is announced with MADV_WILLNEED
(the kernel reads exactly those pages, all runs at once, asynchronously): the copy then
waits for one round of parallel reads instead of one read per page. Where ``madvise`` is not
available (not Linux) the rows are read the plain way.
"""

from __future__ import annotations

import mmap
from pathlib import Path

import numpy as np

PAGE = mmap.PAGESIZE


def open_random(path: Path) -> np.ndarray:
    """``np.load(path, mmap_mode="r")``, its map advised for random access."""
    array = np.load(path, mmap_mode="r", allow_pickle=False)
    mapped = getattr(array, "_mmap", None)
    if mapped is not None and hasattr(mmap, "MADV_RANDOM"):
        mapped.madvise(mmap.MADV_RANDOM)
    return array


def row_ranges(rows: np.ndarray, row_bytes: int, data_start: int) -> list[tuple[int, int]]:
    """Page-aligned (start, length) byte ranges of the map covering ``rows`` (sorted, unique),
    one per run of consecutive rows; ``data_start``: where row 0 begins in the map."""
    if len(rows) == 0:
        return []
    breaks = np.nonzero(np.diff(rows) != 1)[0]
    firsts = np.concatenate([[rows[0]], rows[breaks + 1]])
    lasts = np.concatenate([rows[breaks], [rows[-1]]])
    out = []
    for first, last in zip(firsts.tolist(), lasts.tolist()):
        begin = data_start + first * row_bytes
        end = data_start + (last + 1) * row_bytes
        aligned = begin - begin % PAGE
        out.append((aligned, end - aligned))
    return out


def read_rows(array: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """``array[rows]`` for a 2-D memory-mapped ``array`` and sorted row indices (N,), with the
    rows' pages requested from disk together first (MADV_WILLNEED)."""
    mapped = getattr(array, "_mmap", None)
    if mapped is not None and hasattr(mmap, "MADV_WILLNEED") and len(rows):
        # np.memmap maps from the allocation-granularity boundary below the data's offset.
        data_start = array.offset % mmap.ALLOCATIONGRANULARITY
        for start, length in row_ranges(np.unique(rows), int(array.strides[0]), data_start):
            mapped.madvise(mmap.MADV_WILLNEED, start, min(length, len(mapped) - start))
    return array[rows]
