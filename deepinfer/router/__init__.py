"""The router tier of a deepinfer service: the ``deepinfer router`` HTTP proxy in front of prefill,
decode and aggregated workers, its pure routing policies and load bookkeeping (shared with the
simulator), the worker's side of the protocol (``GET /load``, self-registration), the P->D handoff
protocol, balance measurement, and ``deepinfer cluster`` (a local cluster of worker processes plus a
router). Named for the process it runs in: everything here either is the router or talks to it.
"""
