"""What the HTTP processes (the API server and the router) share, below both: error shapes per API
dialect (``errors``), server-sent-event framing (``sse``) and the P->D handoff's wire messages
(``handoff``). Imports FastAPI/Starlette and msgspec only; never the engine.
"""
