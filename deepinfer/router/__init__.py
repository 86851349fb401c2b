"""The router tier of a deepinfer service: the ``deepinfer router`` HTTP proxy in front of prefill,
decode and aggregated workers, its pure routing policies and load bookkeeping (shared with the
simulator), the P->D handoff's state machine, balance measurement, and ``deepinfer cluster`` (a local cluster of worker processes plus a
router). Named for the process it runs in. The worker's side of the protocol (``GET /load``,
self-registration) is ``deepinfer.server.router_api``; what both sides share is in ``deepinfer.web``
(errors, SSE, handoff messages) and ``deepinfer.core.load`` (the load report).
"""
