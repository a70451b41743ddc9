"""A ``float8[]`` query parameter packed in C, for arrays of thousands of floats (embeddings).

psycopg dumps a Python list element by element, in Python, and JSON costs a ``repr`` per float: for a
page's embeddings (a few thousand floats) either was the larger part of storing them (py-spy,
bench/pipeline.py). ``PackedFloats`` goes in Postgres's binary array format instead, built with
``array`` and strided copies, so the cost no longer grows with a Python step per float; the values are
exact (the same doubles, no text round trip).
"""

from __future__ import annotations

import struct
import sys
from array import array
from collections.abc import Iterable

import psycopg
from psycopg.adapt import Dumper
from psycopg.pq import Format

FLOAT8_OID = 701
FLOAT8_ARRAY_OID = 1022
_HEADER = struct.Struct(">iiiii")  # dimensions, has-nulls flag, element type, length, lower bound
_ELEMENT = 12  # each element: its length (int4, always 8) then the float8, big-endian


class PackedFloats:
    """A one-dimensional ``float8[]`` parameter: pass it where a list of floats would go."""

    __slots__ = ("values",)

    def __init__(self, values: Iterable[float]) -> None:
        self.values = array("d", values)


class PackedFloatsDumper(Dumper):
    format = Format.BINARY
    oid = FLOAT8_ARRAY_OID

    def dump(self, obj: PackedFloats) -> bytes:
        values = array("d", obj.values)  # a copy: the byte swap must leave the parameter as given
        if sys.byteorder == "little":
            values.byteswap()
        raw = values.tobytes()
        count = len(values)
        out = bytearray(_HEADER.size + _ELEMENT * count)
        _HEADER.pack_into(out, 0, 1, 0, FLOAT8_OID, count, 1)
        start = _HEADER.size
        out[start + 3 :: _ELEMENT] = b"\x08" * count  # the length's low byte; the other three stay 0
        for byte in range(8):  # the doubles' bytes, each to every element's slot at once
            out[start + 4 + byte :: _ELEMENT] = raw[byte::8]
        return bytes(out)


psycopg.adapters.register_dumper(PackedFloats, PackedFloatsDumper)


def unpack_floats(raw: bytes) -> array[float]:
    """A ``float8[]`` read in the same binary format (``array_send(column)``), into an array of doubles:
    the reverse of ``PackedFloatsDumper``. psycopg parses a ``float8[]`` from its text form a float at
    a time, about 1 µs each: reading a large entity's embeddings took seconds (bench/entity_read.py).
    Raises ValueError for what a facts embedding never is (several dimensions, a NULL element)."""
    dimensions, has_nulls, element_type = struct.unpack_from(">iii", raw)
    if dimensions == 0:
        return array("d")
    if dimensions != 1 or has_nulls or element_type != FLOAT8_OID:
        raise ValueError("not a one-dimensional float8[] without NULLs")
    count = struct.unpack_from(">i", raw, 12)[0]
    start = _HEADER.size
    doubles = bytearray(8 * count)
    for byte in range(8):  # every element's bytes at once, skipping the lengths
        doubles[byte::8] = raw[start + 4 + byte :: _ELEMENT]
    values = array("d", bytes(doubles))
    if sys.byteorder == "little":
        values.byteswap()
    return values
