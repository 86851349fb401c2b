"""The engine core: requests, the scheduler, the KV-cache manager, the engine loop."""
