"""Peer drivers: standalone scripts run with a peer's own interpreter (its venv), so deepinfer never
imports a peer. Each reads a JSON job ``{"model", "prompts", "output_len", "threads"}`` from the file
named by its first argument and writes ``{"wall_s", "output_tokens", "output_token_ids", "config"}``
to the file named by its second argument. They must not import deepinfer."""
