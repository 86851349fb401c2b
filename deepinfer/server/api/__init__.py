"""The HTTP APIs: one router per API (OpenAI Chat Completions, Completions, Responses; Anthropic
Messages) plus the operational routes (models, health, metrics)."""
