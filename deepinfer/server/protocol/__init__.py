"""Pydantic models of the HTTP APIs' requests and responses (one module per API).

Requests ignore fields they do not know (clients send many optional ones); fields the server knows
but cannot honour are rejected by the API modules with a 400 that names them.
"""
