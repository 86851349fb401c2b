"""The DeepSeek-V3 family model, its configuration and the checkpoint loader."""
