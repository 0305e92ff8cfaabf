"""Framing many records at once (the backfill executors' bulk form of encode_frame).

The bytes are exactly :func:`qstore.payload._format.encode_frame` followed by
the body, for each body; a test compares them. Bodies come as one buffer and
an array of offsets (an Arrow binary column), so a batch is framed with one
CRC call per body and a few numpy copies, never one Python object per body.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._fs import Buffer
from . import _format as fmt

if TYPE_CHECKING:
    import numpy as np
else:
    from .._lazy import np  # imported on first use (_lazy.py)


def record_crcs(data: Buffer, starts: np.ndarray, lens: np.ndarray) -> list[int]:
    """The record CRC (length bytes, then body) of each body ``data[start:start+len]``."""
    view = memoryview(data)
    crc32 = fmt.crc32
    if len(lens) and lens.min() == lens.max():  # one length for all: one seed
        size = int(lens[0])
        seed = fmt.length_seed(size)
        return [crc32(view[o: o + size], seed) for o in starts.tolist()]
    return [crc32(view[o: o + n], fmt.length_seed(n))
            for o, n in zip(starts.tolist(), lens.tolist(), strict=True)]


def frame_header(length: int, crc: int) -> bytes:
    return fmt.FRAME.pack(length, crc)


def frame_contiguous(data: Buffer, offsets: np.ndarray, crcs: list[int]) -> np.ndarray:
    """Framed records of bodies lying back to back: ``data[offsets[i]:offsets[i+1]]``.

    Returns the records as one uint8 array; record ``i`` starts at
    ``offsets[i] - offsets[0] + FRAME_SIZE * i`` in it.
    """
    k = len(offsets) - 1
    lens = offsets[1:] - offsets[:-1]
    head = np.empty((k, 2), "<u4")
    head[:, 0] = lens
    head[:, 1] = crcs
    body = np.frombuffer(data, np.uint8)[offsets[0]: offsets[-1]]
    if k and lens.min() == lens.max():  # equal lengths: a (k, 8 + size) array, by columns
        size = int(lens[0])
        table = np.empty((k, fmt.FRAME_SIZE + size), np.uint8)
        table[:, : fmt.FRAME_SIZE] = head.view(np.uint8).reshape(k, fmt.FRAME_SIZE)
        table[:, fmt.FRAME_SIZE:] = body.reshape(k, size)
        return table.reshape(-1)
    rel = offsets[:-1] - offsets[0]
    return np.insert(body, np.repeat(rel, fmt.FRAME_SIZE), head.view(np.uint8).ravel())
