"""Source rows of a backfill: validated and converted to what ``push`` takes, a batch at a time.

The rules are push's (qstore/_queue.py): a payload is bytes (a string column
is stored as UTF-8) of at most ``max_payload_bytes``; an ``int`` queue's
priority is a signed 64-bit integer (integral floats, decimals and numeric
strings are accepted, as a CSV or JSON source may produce them), a ``str``
queue's at most 1024 UTF-8 bytes; a delay is finite seconds >= 0 and a TTL
finite seconds > 0, each at most ``MAX_SECONDS`` (100 years); nulls mean
push's defaults (a null TTL: the queue's default TTL), except a null payload.
A row that breaks a rule is not an error: it gets a reason (the first
problem found) and goes to the rejects table. Work is done on whole Arrow
columns where it can be, because a backfill converts millions of rows.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from decimal import Decimal
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from .._numbers import plain_number
from .._queue import MAX_SECONDS
from ..meta import keys


@dataclass(frozen=True)
class LoadSpec:
    """What every task of one backfill job needs to know (the same for all partitions)."""

    qid: int
    order: str
    priority_type: str
    dedup: bool
    now: float
    max_payload_bytes: int
    segment_max_bytes: int
    payload_col: str
    priority_col: str | None = None
    delay_col: str | None = None
    dedup_col: str | None = None
    ttl_col: str | None = None
    default_ttl: float | None = None  # the queue's TTL: rows without one of their own get it
    malformed_col: str | None = None  # a CSV or JSON source: each malformed line's text
    malformed_format: str = "CSV"  # the source's format, as a malformed line's reason names it

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> LoadSpec:
        return cls(**json.loads(text))

    def columns(self) -> list[str]:
        """The source columns a task reads, each once, in a fixed order."""
        cols = [self.payload_col, self.priority_col, self.delay_col, self.dedup_col,
                self.ttl_col, self.malformed_col]
        return list(dict.fromkeys(c for c in cols if c is not None))


@dataclass
class Rows:
    """One Arrow batch, converted. Row ``i`` is loadable when ``reasons[i]`` is None."""

    n: int
    data: memoryview  # the payload column's data buffer
    offsets: np.ndarray  # int64, n + 1: payload i is data[offsets[i]:offsets[i + 1]]
    reasons: list[str | None]
    priorities: Any  # int queue: int64 ndarray; str queue: list of str
    delays: np.ndarray  # float64 seconds
    digests: list[bytes | None] | None  # dedup queues only
    ttls: np.ndarray | None = None  # float64 seconds, NaN: none; None: no row has one

    def body(self, i: int) -> memoryview:
        return self.data[int(self.offsets[i]): int(self.offsets[i + 1])]


def _reject(reasons: list[str | None], i: int, reason: str) -> None:
    if reasons[i] is None:  # the first problem found is the one reported
        reasons[i] = reason


def _is_null_array(arr: pa.Array | None) -> bool:
    return arr is None or pa.types.is_null(arr.type)


def _null_rows(arr: pa.Array) -> np.ndarray:
    return np.flatnonzero(arr.is_null().to_numpy(zero_copy_only=False)) if arr.null_count \
        else np.empty(0, np.int64)


def _payloads(arr: pa.Array, max_bytes: int, reasons: list[str | None]
              ) -> tuple[memoryview, np.ndarray]:
    if pa.types.is_dictionary(arr.type):  # a categorical column, as pandas writes them
        arr = arr.dictionary_decode()
    if pa.types.is_string(arr.type):
        arr = arr.cast(pa.binary())  # same layout: a view, not a copy
    elif pa.types.is_large_string(arr.type):
        arr = arr.cast(pa.large_binary())
    elif not (pa.types.is_binary(arr.type) or pa.types.is_large_binary(arr.type)):
        # fixed-size binary (UUIDs), binary or string views: an offsets layout
        arr = arr.cast(pa.large_binary())
    width = np.int64 if pa.types.is_large_binary(arr.type) else np.int32
    _, offsets_buf, data_buf = arr.buffers()
    n = len(arr)
    offsets = np.frombuffer(offsets_buf, width)[arr.offset: arr.offset + n + 1].astype(np.int64)
    data = memoryview(data_buf) if data_buf is not None else memoryview(b"")
    for i in _null_rows(arr).tolist():
        _reject(reasons, i, "payload: null")
    lengths = np.diff(offsets)
    for i in np.flatnonzero(lengths > max_bytes).tolist():
        _reject(reasons, i, f"payload: {int(lengths[i])} bytes, over max_payload_bytes "
                            f"{max_bytes}")
    return data, offsets


def _int_priority(v: Any) -> int | str:
    """An int priority from one cell, or the reason it is not one (a str)."""
    if isinstance(v, int):
        n = v
    elif isinstance(v, str):
        try:
            text = plain_number(v)
        except ValueError:
            return f"priority: {v!r:.40} is not an integer"
        try:
            n = int(text)
        except ValueError:
            # An integral numeral in another form ("7.0", as a float column is
            # written, or "1e3"), read exactly: never through a float.
            try:
                d = Decimal(text)
            except ArithmeticError:  # decimal.InvalidOperation
                return f"priority: {v!r:.40} is not an integer"
            if not d.is_finite() or d != d.to_integral_value():
                return f"priority: {v!r:.40} is not an integer"
            if d.adjusted() > 19:  # past 1e20 (before int(): "1e999999999" has 10**9 digits)
                return f"priority: {v!r:.40} is outside signed 64-bit range"
            n = int(d)
    elif isinstance(v, (float, Decimal)):
        if not (math.isfinite(v) if isinstance(v, float) else v.is_finite()) or v != int(v):
            return f"priority: {v} is not an integer"
        n = int(v)
    else:
        return f"priority: {type(v).__name__} is not an integer"
    if not keys.INT_MIN <= n <= keys.INT_MAX:
        return f"priority: {n} is outside signed 64-bit range"
    return n


def _int_priorities(arr: pa.Array | None, n: int, reasons: list[str | None]) -> np.ndarray:
    if _is_null_array(arr):
        return np.zeros(n, np.int64)
    assert arr is not None
    if pa.types.is_signed_integer(arr.type):
        filled = pc.fill_null(arr, 0) if arr.null_count else arr
        return np.asarray(filled.cast(pa.int64()).to_numpy(), np.int64)
    out = np.zeros(n, np.int64)
    cells = _texts(arr, reasons) if _is_text(arr) else arr.to_pylist()
    for i, v in enumerate(cells):
        if v is not None and reasons[i] is None:
            p = _int_priority(v)
            if isinstance(p, str):
                _reject(reasons, i, p)
            else:
                out[i] = p
    return out


def _str_priorities(arr: pa.Array | None, n: int, reasons: list[str | None]) -> list[str]:
    if _is_null_array(arr):
        return [""] * n
    assert arr is not None
    values: list[Any] = _texts(arr, reasons)
    for i, v in enumerate(values):
        if v is None:
            values[i] = ""
        elif len(v.encode("utf-8")) > keys.MAX_STR_PRIORITY_BYTES:
            _reject(reasons, i, f"priority: over {keys.MAX_STR_PRIORITY_BYTES} UTF-8 bytes")
    return values


def _is_text(arr: pa.Array) -> bool:
    return bool(pa.types.is_string(arr.type) or pa.types.is_large_string(arr.type))


def _texts(arr: pa.Array, reasons: list[str | None]) -> list[str | None]:
    """The cells of a string (or binary) column as str; a cell that is not UTF-8
    (Spark strings and Parquet files can hold any bytes) is a reject and ''."""
    if _is_text(arr):
        try:
            texts: list[str | None] = arr.to_pylist()
            return texts
        except UnicodeDecodeError:
            arr = arr.cast(pa.binary() if pa.types.is_string(arr.type) else pa.large_binary())
    out: list[str | None] = []
    for i, v in enumerate(arr.to_pylist()):
        if isinstance(v, bytes):
            try:
                v = v.decode("utf-8")
            except UnicodeDecodeError:
                _reject(reasons, i, f"priority: {v[:40]!r} is not UTF-8 text")
                v = ""
        out.append(v)
    return out


def _seconds_column(arr: pa.Array | None, n: int, reasons: list[str | None], what: str,
                    positive: bool) -> tuple[np.ndarray, np.ndarray]:
    """Seconds per row (push's ``_seconds`` rules) and where the cell was null.

    A bad cell is a reject and reads as 0; ``positive`` refuses 0 (a TTL).
    """
    if _is_null_array(arr):
        return np.zeros(n, np.float64), np.ones(n, bool)
    assert arr is not None
    null = arr.is_null().to_numpy(zero_copy_only=False) if arr.null_count else np.zeros(n, bool)
    if pa.types.is_integer(arr.type) or pa.types.is_floating(arr.type):
        filled = pc.fill_null(arr, 0) if arr.null_count else arr
        out = np.array(filled.cast(pa.float64()).to_numpy(), np.float64)
    else:  # strings, decimals: one at a time
        out = np.zeros(n, np.float64)
        for i, v in enumerate(arr.to_pylist()):
            if v is None:
                continue
            try:
                out[i] = float(plain_number(v) if isinstance(v, str) else v)
            except (TypeError, ValueError):
                _reject(reasons, i, f"{what}: {v!r:.40} is not a number of seconds")
    bad = ~np.isfinite(out)
    for i in np.flatnonzero(bad).tolist():
        _reject(reasons, i, f"{what}: {float(out[i])!r} is not finite")
    out[bad] = 0.0
    low = (out <= 0) & ~null if positive else out < 0
    for i in np.flatnonzero(low).tolist():
        _reject(reasons, i, f"{what}: {float(out[i])!r} is "
                            + ("not > 0" if positive else "negative"))
    for i in np.flatnonzero(out > MAX_SECONDS).tolist():
        _reject(reasons, i, f"{what}: {float(out[i])!r} is over {MAX_SECONDS} seconds")
    out[low | (out > MAX_SECONDS)] = 0.0
    return out, null


def _delays(arr: pa.Array | None, n: int, reasons: list[str | None]) -> np.ndarray:
    return _seconds_column(arr, n, reasons, "delay", False)[0]


def _ttls(arr: pa.Array | None, n: int, reasons: list[str | None],
          default: float | None) -> np.ndarray | None:
    """Each row's TTL in seconds, NaN for none: a null cell takes the queue's
    ``default`` (push's rule for ttl=None). None when no row has a TTL."""
    if _is_null_array(arr) and default is None:
        return None
    out, null = _seconds_column(arr, n, reasons, "ttl", True)
    out[null] = np.nan if default is None else default
    return out


def digest(body: bytes, dedup_key: bytes | None, dedup: bool) -> bytes | None:
    """The dedup digest push() records (must match ``Queue._digest`` byte for byte)."""
    if dedup_key is None:
        return keys.payload_digest(body) if dedup else None
    return keys.explicit_digest(dedup_key)


def _digests(rows: Rows, arr: pa.Array | None) -> list[bytes | None]:
    if arr is not None and _is_text(arr):
        # The UTF-8 bytes are the key; read them as bytes so that a cell that is not
        # valid UTF-8 (Spark strings can hold any bytes) is a key like any other.
        arr = arr.cast(pa.binary() if pa.types.is_string(arr.type) else pa.large_binary())
    dkeys: list[Any] = [None] * rows.n if arr is None else arr.to_pylist()
    out: list[bytes | None] = []
    for i, k in enumerate(dkeys):
        if rows.reasons[i] is not None:
            out.append(None)
            continue
        if isinstance(k, str):
            k = k.encode("utf-8")
        elif isinstance(k, int):
            k = str(k).encode("ascii")
        out.append(digest(bytes(rows.body(i)), k, True))
    return out


def parse(batch: pa.RecordBatch, spec: LoadSpec) -> Rows:
    """Validate and convert every row of ``batch``; a bad row gets a reason, never an error."""
    n = batch.num_rows
    reasons: list[str | None] = [None] * n

    def col(name: str | None) -> pa.Array | None:
        return None if name is None else batch.column(name)

    malformed = col(spec.malformed_col)
    if malformed is not None and malformed.null_count < n:  # first: the reason reported
        why = (f"malformed {spec.malformed_format} line (its text is in column "
               f"{spec.malformed_col!r})")
        for i in np.flatnonzero(malformed.is_valid().to_numpy(zero_copy_only=False)).tolist():
            _reject(reasons, i, why)
    data, offsets = _payloads(batch.column(spec.payload_col), spec.max_payload_bytes, reasons)
    prios: Any = (_int_priorities(col(spec.priority_col), n, reasons)
                  if spec.priority_type == "int"
                  else _str_priorities(col(spec.priority_col), n, reasons))
    delays = _delays(col(spec.delay_col), n, reasons)
    ttls = _ttls(col(spec.ttl_col), n, reasons, spec.default_ttl)
    rows = Rows(n, data, offsets, reasons, prios, delays, None, ttls)
    if spec.dedup:
        rows.digests = _digests(rows, col(spec.dedup_col))
    return rows
