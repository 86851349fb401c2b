"""deepinfer.kvstore: the KV store beyond the device, shared by engine processes and hosts.

Named ``kvstore`` (not ``kv_cache``) because it is a *store* in the storage sense: content-addressed,
write-once records that outlive the process that wrote them, with tiers (host memory, a local disk
directory, a shared filesystem directory), retention by traffic class and crash-safe files. The device
side (which request holds which device block, the in-memory prefix index) stays in
``deepinfer.engine.kv_cache_manager``; this package is what that cache spills to and loads from, and
what a prefill worker hands a decode worker's blocks through.

Modules: ``keys`` (the versioned key namespace), ``record`` (the on-disk block format),
``retention`` (pure TTL and eviction policy, clock injected), ``host_tier`` / ``pack_tier`` (local
disk: a pack file per write batch) / ``file_tier`` (shared mount: a file per block) (the tiers), ``store`` (the tiered store with asynchronous batched load/save and leases), ``metrics``
(plain-data counters), ``config`` (``KVStoreConfig``) and ``cli``.
The engine's side (the scheduler's and runner's hooks into a store) is
``deepinfer.engine.kv_connector``; this package never imports the engine. Importing it imports nothing
heavy; torch is needed only by the host tier.
"""
