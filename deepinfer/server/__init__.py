"""The HTTP server: OpenAI Chat Completions / Completions / Responses and Anthropic Messages APIs
over one engine (``deepinfer serve``).

``build_app(engine, config)`` makes the FastAPI app; ``launch.serve`` builds the engine and runs it
with uvicorn. Needs the ``server`` extra (fastapi, uvicorn, prometheus-client); the engine itself
never imports this package.
"""
