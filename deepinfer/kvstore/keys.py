"""Keys that never lie: a block's store key is SHA-256 over a versioned namespace and its hash chain.

The engine names a full block by a SHA-256 chain (``hash_block(parent, token ids)``, see
``deepinfer.engine.kv_cache_manager``), which depends only on the tokens. The same tokens give
different KV under another model, tokenizer, cache layout or pool, so the store key also covers a
``StoreNamespace``: the model weights fingerprint, the tokenizer fingerprint, the KV layout (backend
cache spec, block size, dtype, layout version) and the pool (full-attention or sliding-window
layers). Any change is a different key, hence a miss, never a wrong hit. Everything is hashed from
canonical bytes (sorted-key JSON, raw file bytes): no ``hash()``, no PYTHONHASHSEED, no pickle.
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import asdict, dataclass
from pathlib import Path

import xxhash

LAYOUT_VERSION = 1  # bump when the bytes of a stored block change meaning (record.py or the copy order)
SAMPLES_PER_FILE = 16  # chunks of each weight file hashed into the fingerprint
SAMPLE_BYTES = 1 << 16


@dataclass(frozen=True, slots=True)
class StoreNamespace:
    """What a stored block's bytes depend on besides its tokens.

    ``cache_layout`` is the backend's cache spec as text (tensor names and per-block shapes),
    ``layers`` the cache layers stored in this pool (indices into the engine's cache list) and
    ``pool`` names the pool (``full`` or ``swa``). Created by the engine at start; the store writes
    its digest into every record header and the folder name.
    """

    model: str  # weights fingerprint (weights_fingerprint)
    tokenizer: str  # tokenizer fingerprint (tokenizer_fingerprint), "" when the model has none
    cache_layout: str
    block_size: int
    dtype: str
    layers: tuple[int, ...]
    pool: str
    layout_version: int = LAYOUT_VERSION

    def digest(self) -> bytes:
        """32 bytes: SHA-256 of the canonical JSON of every field."""
        text = json.dumps(asdict(self), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).digest()

    def describe(self) -> dict:
        return asdict(self)


def store_key(namespace_digest: bytes, block_hash: bytes) -> bytes:
    """32-byte key of one block: SHA-256(namespace digest || the engine's block hash)."""
    return hashlib.sha256(namespace_digest + block_hash).digest()


def weights_fingerprint(folder: Path) -> str:
    """Hex fingerprint of a model folder's weights: config.json's bytes and, per ``*.safetensors``
    file (sorted by name, subfolders excluded), its name, size, JSON header (tensor names, dtypes,
    shapes, offsets) and xxh3-128 of ``SAMPLES_PER_FILE`` evenly spaced 64 KiB chunks. Retrained
    weights of the same shapes change the sampled bytes; hashing every byte of a 700 GB checkpoint at
    each start would take minutes, so the fingerprint samples."""
    h = hashlib.sha256()
    config = folder / "config.json"
    h.update(config.read_bytes() if config.is_file() else b"")
    for path in sorted(folder.glob("*.safetensors")):
        size = path.stat().st_size
        h.update(path.name.encode() + b"\0" + struct.pack("<Q", size))
        with path.open("rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            h.update(f.read(min(header_len, size)))
            step = max(1, size // SAMPLES_PER_FILE)
            for i in range(SAMPLES_PER_FILE):
                f.seek(min(i * step, max(0, size - SAMPLE_BYTES)))
                h.update(xxhash.xxh3_128_digest(f.read(SAMPLE_BYTES)))
    return h.hexdigest()


def tokenizer_fingerprint(folder: Path) -> str:
    """Hex SHA-256 of tokenizer.json and tokenizer_config.json (empty string when neither exists)."""
    files = [folder / name for name in ("tokenizer.json", "tokenizer_config.json")]
    present = [p for p in files if p.is_file()]
    if not present:
        return ""
    h = hashlib.sha256()
    for path in present:
        h.update(path.name.encode() + b"\0" + path.read_bytes())
    return h.hexdigest()
