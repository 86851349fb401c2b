"""The on-disk format of one stored block: a 128-byte header, then the payload.

Header (little endian): magic ``DIKVBLK\\0`` (8 bytes), format version (u16), header length (u16),
flags (u32, 0), key (32 bytes), namespace digest (32), payload length (u64), creation time (f64, Unix
seconds), traffic class of the first writer (16 bytes, NUL-padded UTF-8), xxh3-64 of the payload (u64),
xxh3-64 of the 120 header bytes before it (u64). ``decode`` checks all of it against the key and
namespace the reader expects; any mismatch raises ``RecordError`` with a reason the store counts, so
a flipped bit, a truncated or empty file, or a file of another model or layout is a miss, never KV.
"""

from __future__ import annotations

import struct

import xxhash

MAGIC = b"DIKVBLK\0"
FORMAT_VERSION = 1
_FIXED = struct.Struct("<8sHHI32s32sQd16sQ")
HEADER_SIZE = _FIXED.size + 8  # 128
CLASS_BYTES = 16


class RecordError(ValueError):
    """A stored record that must not be served. ``reason``: empty, truncated, magic, version,
    header_checksum, key, namespace, length, checksum."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


def encode_header(
    key: bytes, namespace: bytes, payload: bytes | memoryview, created: float, cls: str
) -> bytes:
    name = cls.encode()[:CLASS_BYTES]
    fixed = _FIXED.pack(
        MAGIC,
        FORMAT_VERSION,
        HEADER_SIZE,
        0,
        key,
        namespace,
        len(payload),
        created,
        name,
        xxhash.xxh3_64_intdigest(payload),
    )
    return fixed + struct.pack("<Q", xxhash.xxh3_64_intdigest(fixed))


def decode_header(raw: bytes) -> tuple[bytes, bytes, int, float, str, int]:
    """(key, namespace, payload length, created, class, payload checksum) of a header; checks magic,
    version and the header checksum, nothing about the payload."""
    if len(raw) == 0:
        raise RecordError("empty", "zero-length file")
    if len(raw) < HEADER_SIZE:
        raise RecordError("truncated", f"{len(raw)} bytes, shorter than the {HEADER_SIZE}-byte header")
    fields = _FIXED.unpack_from(raw)
    magic, version, header_len, _flags, key, namespace, length, created, cls, checksum = fields
    if magic != MAGIC:
        raise RecordError("magic", f"magic {magic!r} is not a deepinfer KV block")
    if version != FORMAT_VERSION or header_len != HEADER_SIZE:
        raise RecordError(
            "version", f"format version {version} (header {header_len} B), expected {FORMAT_VERSION}"
        )
    (header_sum,) = struct.unpack_from("<Q", raw, _FIXED.size)
    if header_sum != xxhash.xxh3_64_intdigest(raw[: _FIXED.size]):
        raise RecordError("header_checksum", "header checksum mismatch")
    return key, namespace, length, created, cls.rstrip(b"\0").decode(errors="replace"), checksum


def decode(raw: bytes, key: bytes, namespace: bytes) -> memoryview:
    """The payload of ``raw`` (a whole file), after checking it is the record of ``key`` under
    ``namespace``, complete and intact."""
    got_key, got_ns, length, _, _, checksum = decode_header(raw)
    if got_ns != namespace:
        raise RecordError("namespace", "written under another model, tokenizer or KV layout")
    if got_key != key:
        raise RecordError("key", "the header names another key than the file name")
    if len(raw) != HEADER_SIZE + length:
        raise RecordError("length", f"{len(raw) - HEADER_SIZE} payload bytes, header says {length}")
    payload = memoryview(raw)[HEADER_SIZE:]
    if xxhash.xxh3_64_intdigest(payload) != checksum:
        raise RecordError("checksum", "payload checksum mismatch")
    return payload
