"""The engine core as its own process: the typed messages between an API front and its cores
(:mod:`~deepinfer.core.messages`), the core's loop around an ``LLMEngine``
(:mod:`~deepinfer.core.engine_core`), how a core is started and watched
(:mod:`~deepinfer.core.launch`), and the front's asyncio client (:mod:`~deepinfer.core.client`).

A core is what a data-parallel rank or a prefill/decode worker is made of: it owns one engine
(scheduler, KV cache, model runner), takes token ids in and sends token ids out, and is addressed by
its ``engine_id``. Importing this package imports neither torch nor the server stack.
"""
