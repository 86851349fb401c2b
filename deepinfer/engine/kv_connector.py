"""The engine's connector to the KV store: what the scheduler and the model runner call.

Created by ``LLMEngine`` when ``EngineConfig.kv_store`` is set; holds the store of the full-attention
pool and the device cache tensors. Scheduler side (host bookkeeping, never waits on I/O):

- ``begin_load(request, cached)`` at admission, after the device prefix cache: asks the store how many
  further leading blocks it holds; if any, takes device blocks for them, starts an asynchronous load
  and the request leaves the waiting queue (other requests keep running);
- ``poll()`` each step: loads that completed are copied host -> device into their blocks, registered
  in the device prefix cache and released, and their requests return to the head of the waiting
  queue, where the device prefix cache now covers them;
- ``replay_tokens(request, cached)``: for models with sliding-window layers, how many tokens before the
  hit point must be recomputed because the hit lacks the window's sliding-window KV (see below);
- ``saves(request, num_computed)``: the request's blocks whose KV is complete and not yet saved, as
  (key, device block id, class) for the step to copy down after its forward pass.

Runner side: ``save_blocks`` copies device blocks into host slots and commits them (written behind
to disk and shared). Keys are ``keys.store_key`` of the engine's SHA-256 block-hash chain.

Sliding-window layers: only the full-attention layers' rows are stored (pool ``full``); a hit from the
store lacks the sliding-window rows, so the request replays the tokens before the hit point with a
*write floor* (full-attention layers do not write rows below it, so shared cached rows are never
rewritten; sliding-window rows there were missing, not cached). ``exact`` replays the receptive field
``num_swa_layers * (window - 1)`` tokens, which makes the result identical to a cold run; ``bounded``
replays ``swa_replay_tokens``. Device blocks loaded without sliding-window rows stay marked, so any
later hit on them replays too.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from deepinfer import envs
from deepinfer.backends.cache_spec import KVCacheSpec
from deepinfer.engine.block_pool import BlockPool, KVBlock
from deepinfer.engine.request import Request
from deepinfer.kvstore.config import KVStoreConfig
from deepinfer.kvstore.keys import StoreNamespace, store_key, tokenizer_fingerprint, weights_fingerprint
from deepinfer.kvstore.retention import RetentionPolicy
from deepinfer.kvstore.store import DirSpec, KVStore, LoadHandle

GIB = 1 << 30


@dataclass(slots=True)
class _Load:
    request: Request
    held: list[KVBlock]  # the device-cache prefix, referenced while loading
    blocks: list[KVBlock]  # fresh device blocks the load fills
    first: int  # index of blocks[0] in the request's block list
    handle: LoadHandle


class StoreConnector:
    def __init__(
        self,
        config: KVStoreConfig,
        kv_caches: Sequence[Sequence[torch.Tensor]],
        cache_spec: KVCacheSpec,
        windows: Sequence[int | None],
        model_dir: Path,
        tokenizer_dir: Path,
        pool: BlockPool,
        pin_memory: bool,
        synchronize: Callable[[], None],
    ) -> None:
        """``windows``: the sliding window of each cache layer (None: full attention)."""
        self.config = config
        self.kv_caches = kv_caches
        self.block_size = cache_spec.block_size
        self.pool = pool
        self.synchronize = synchronize
        self.policy = RetentionPolicy(dict(config.ttls), config.default_class)
        self.full_layers = [i for i, w in enumerate(windows) if w is None]
        self.swa_layers = [i for i, w in enumerate(windows) if w is not None]
        swa = [w for w in windows if w is not None]
        self.window = max(swa) if swa else 0
        self.num_swa_layers = len(swa)
        mode = config.swa_replay or envs.get("DEEPINFER_SWA_REPLAY")
        if mode not in ("exact", "bounded"):
            raise ValueError(f"DEEPINFER_SWA_REPLAY={mode!r}: expected exact or bounded")
        self.replay_mode = mode
        itemsize = torch.empty((), dtype=cache_spec.dtype).element_size()
        self._segments = [  # (layer, tensor index, bytes) in slot order
            (layer, t, itemsize * _numel(spec.block_shape))
            for layer in self.full_layers
            for t, spec in enumerate(cache_spec.tensors)
        ]
        slot_bytes = sum(n for _, _, n in self._segments)
        namespace = StoreNamespace(
            model=weights_fingerprint(model_dir),
            tokenizer=tokenizer_fingerprint(tokenizer_dir),
            cache_layout=repr([(t.name, t.block_shape) for t in cache_spec.tensors]),
            block_size=cache_spec.block_size,
            dtype=str(cache_spec.dtype).removeprefix("torch."),
            layers=tuple(self.full_layers),
            pool="full",
        )
        self.ns_digest = namespace.digest()
        host_slots = int(config.host_cache_gib * GIB) // slot_bytes
        if host_slots < 1:
            raise ValueError(f"kv_host_cache_gib={config.host_cache_gib} holds no {slot_bytes}-byte block")
        disk = DirSpec(Path(config.path), int(config.capacity_gib * GIB)) if config.path else None
        shared = (
            DirSpec(Path(config.shared_path), int(config.shared_capacity_gib * GIB))
            if config.shared_path
            else None
        )
        self.store = KVStore(
            namespace,
            slot_bytes,
            host_slots,
            self.policy,
            disk,
            shared,
            pin_memory,
            max_pending_writes=config.write_queue_blocks,
            write_window_s=config.write_window_ms / 1e3,
        )
        self._checked: set[str] = set()  # requests already looked up in the store (once per admission)
        self._loading: dict[str, _Load] = {}
        self._saved: dict[str, int] = {}  # request id -> blocks saved so far
        self._no_swa: dict[int, bytes] = {}  # device block id -> hash, for blocks loaded without SWA rows

    # ------------------------------------------------------------------ keys
    def key(self, block_hash: bytes) -> bytes:
        return store_key(self.ns_digest, block_hash)

    def request_keys(self, request: Request) -> list[str]:
        """Hex store keys of the request's full blocks, in order: what a prefill worker hands to the
        decode worker that loads them (``KVStore.lookup`` / ``load`` by these keys)."""
        return [self.key(h).hex() for h in request.block_hashes]

    def check_class(self, cls: str | None) -> str:
        return self.policy.check_class(cls)

    # ------------------------------------------------------------------ scheduler side
    @property
    def num_loading(self) -> int:
        return len(self._loading)

    def idle_wait(self, timeout: float = 0.005) -> None:
        """With nothing to compute, wait up to ``timeout`` s for a pending load (none: return)."""
        for load in self._loading.values():
            with contextlib.suppress(TimeoutError):
                load.handle.wait(timeout)
            return

    def is_loading(self, request: Request) -> bool:
        return request.request_id in self._loading

    def begin_load(self, request: Request, cached: list[KVBlock]) -> bool:
        """Look the request's uncached leading blocks up in the store (once per admission); if some
        are there, start loading them and return True (the request then waits in the connector).
        A request that asks for prompt log-probabilities loads nothing: every position is computed."""
        rid = request.request_id
        if rid in self._checked or request.sampling_params.prompt_logprobs is not None:
            return False
        self._checked.add(rid)
        max_blocks = (request.num_tokens - 1) // self.block_size
        first = len(cached)
        keys = [self.key(h) for h in request.block_hashes[first:max_blocks]]
        if not keys:
            return False
        cls = self.check_class(request.sampling_params.traffic_class)
        found = self.store.lookup(keys, cls)
        room = self.pool.num_free_blocks - sum(1 for b in cached if b.ref_cnt == 0)
        found = min(found, room)
        if found <= 0:
            return False
        self.pool.take(cached)
        blocks = self.pool.allocate(found)
        self._loading[rid] = _Load(request, cached, blocks, first, self.store.load(keys[:found], cls))
        return True

    def poll(self) -> list[Request]:
        """Finish completed loads (copy into device blocks, register, release); returns their
        requests, to be admitted again."""
        self.store.maybe_collect()
        done = []
        for rid, load in list(self._loading.items()):
            if not load.handle.done():
                continue
            del self._loading[rid]
            slots = load.handle.slots
            hashes = load.request.block_hashes
            self._copy_in(slots, [b.block_id for b in load.blocks[: len(slots)]])
            for i, block in enumerate(load.blocks[: len(slots)]):
                block_hash = hashes[load.first + i]
                self.pool.register(block, block_hash)
                if self.num_swa_layers:
                    self._no_swa[block.block_id] = block_hash
            load.handle.release()
            self.pool.release(list(reversed(load.held + load.blocks)))
            done.append(load.request)
        return done

    def cancel(self, request: Request) -> None:
        """Drop a request's state (finished, aborted or preempted); a pending load is released
        once it completes."""
        rid = request.request_id
        self._saved.pop(rid, None)
        self._checked.discard(rid)
        load = self._loading.pop(rid, None)
        if load is not None:
            load.handle.wait()
            load.handle.release()
            self.pool.release(list(reversed(load.held + load.blocks)))

    def replay_tokens(self, request: Request, cached: list[KVBlock]) -> int:
        """Tokens before the hit point to recompute because sliding-window rows are missing there."""
        if not self.num_swa_layers or not cached:
            return 0
        hit = len(cached) * self.block_size
        span = (
            self.num_swa_layers * (self.window - 1)
            if self.replay_mode == "exact"
            else self.config.swa_replay_tokens
        )
        first = max(0, (hit - span) // self.block_size)
        if not any(self._no_swa.get(b.block_id) == b.block_hash for b in cached[first:]):
            return 0
        return min(hit, span)

    def saves(
        self, request: Request, num_computed: int, block_ids: list[int]
    ) -> list[tuple[bytes, int, str]]:
        """(key, device block id, class) of the request's blocks complete after ``num_computed``
        tokens and not saved yet. Blocks the host tier already holds are only touched."""
        rid = request.request_id
        start = self._saved.get(rid, 0)
        end = min(num_computed // self.block_size, len(request.block_hashes), len(block_ids))
        if end <= start:
            return []
        cls = self.check_class(request.sampling_params.traffic_class)
        out = []
        for i in range(start, end):
            key = self.key(request.block_hashes[i])
            if not self.store.save_existing(key, cls):
                out.append((key, block_ids[i], cls))
        self._saved[rid] = end
        return out

    # ------------------------------------------------------------------ runner side
    def save_blocks(self, saves: list[tuple[bytes, int, str]]) -> None:
        """Copy device blocks into host slots and commit them (call after the step's forward)."""
        slots = self.store.reserve_many(len(saves))
        if not slots:
            return
        self._copy_out([block_id for _, block_id, _ in saves[: len(slots)]], slots)
        self.store.commit_many([(key, slot, cls) for (key, _, cls), slot in zip(saves, slots)])

    def _copy_in(self, slots: list[int], block_ids: list[int]) -> None:
        """Host slots -> device blocks, one gather and one indexed copy per cache tensor."""
        if not slots:
            return
        host = self.store.host.data[torch.tensor(slots)]  # [n, slot_bytes]
        device = self.kv_caches[0][0].device
        ids = torch.tensor(block_ids, device=device)
        offset = 0
        for layer, t, n in self._segments:
            dst = self.kv_caches[layer][t]
            part = host[:, offset : offset + n].contiguous().view(dst.dtype).view(len(slots), *dst.shape[1:])
            dst.index_copy_(0, ids, part.to(device))
            offset += n
        for layer in self.swa_layers:  # not stored: zeros (finite) until the replay writes them
            for tensor in self.kv_caches[layer]:
                tensor.index_fill_(0, ids, 0)
        self.synchronize()

    def _copy_out(self, block_ids: list[int], slots: list[int]) -> None:
        """Device blocks -> host slots (call after the forward that computed them): per run of
        consecutive slots (a fresh reservation is one run) and cache tensor, one gather straight
        into the slots' bytes (on CPU no intermediate tensor; on a device one gather there and one
        copy down)."""
        ids = torch.tensor(block_ids, device=self.kv_caches[0][0].device)
        host = self.store.host.data
        for first, slot, count in _runs(slots):
            rows, sel = host[slot : slot + count], ids[first : first + count]
            offset = 0
            for layer, t, n in self._segments:
                src = self.kv_caches[layer][t]
                flat, dst = src.view(src.shape[0], -1), rows[:, offset : offset + n].view(src.dtype)
                if src.device.type == "cpu":
                    torch.index_select(flat, 0, sel, out=dst)
                else:
                    dst.copy_(flat.index_select(0, sel))
                offset += n

    def stats(self) -> dict:
        return self.store.snapshot()

    def close(self, timeout_s: float = 30.0) -> bool:
        """Write the store's queued blocks (within ``timeout_s``) and close it; False if some were not."""
        return self.store.close(timeout_s)


def _runs(slots: list[int]) -> list[tuple[int, int, int]]:
    """``slots`` as runs of consecutive values: (index of the run's first, first slot, length)."""
    runs: list[tuple[int, int, int]] = []
    for i, slot in enumerate(slots):
        if runs and runs[-1][1] + runs[-1][2] == slot:
            first, start, count = runs[-1]
            runs[-1] = (first, start, count + 1)
        else:
            runs.append((i, slot, 1))
    return runs


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
