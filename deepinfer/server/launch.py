"""``deepinfer serve``: build the engine, then run the app with uvicorn until interrupted."""

from __future__ import annotations

import argparse
from pathlib import Path

from deepinfer import envs
from deepinfer.config import EngineConfig
from deepinfer.server.config import ServerConfig


def _default(config: type[EngineConfig | ServerConfig], field: str) -> object:
    """A config field's default, so the command line and the config class never disagree."""
    return config.model_fields[field].default


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", help="Hugging Face model folder (default: the bundled deepinfer-tiny-coder)"
    )
    parser.add_argument(
        "--served-model-name", help="the model name clients send (default: the folder's name)"
    )
    parser.add_argument(
        "--host",
        default=_default(ServerConfig, "host"),
        help="address to listen on (0.0.0.0: every interface)",
    )
    parser.add_argument("--port", type=int, default=_default(ServerConfig, "port"))
    parser.add_argument(
        "--api-key", help="require this key from clients (default: DEEPINFER_API_KEY; unset: no key needed)"
    )
    parser.add_argument("--max-model-len", type=int, help="context length (default: the model's)")
    parser.add_argument(
        "--max-num-seqs",
        type=int,
        default=_default(EngineConfig, "max_num_seqs"),
        help="requests the engine runs at once",
    )
    parser.add_argument(
        "--max-queued-requests",
        type=int,
        default=_default(ServerConfig, "max_queued_requests"),
        help="requests that may wait beyond those; more get 429",
    )
    parser.add_argument(
        "--max-request-bytes",
        type=int,
        default=_default(ServerConfig, "max_request_bytes"),
        help="larger request bodies get 413",
    )
    parser.add_argument("--accelerator", help="cpu | nvidia | ascend | auto (default: DEEPINFER_ACCELERATOR)")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    parser.add_argument("--kv-cache-memory-gib", type=float, help="KV-cache size (default: most free memory)")
    parser.add_argument("--max-num-batched-tokens", type=int, help="token budget of one engine step")
    parser.add_argument(
        "--long-prefill-token-threshold",
        type=int,
        help="largest prompt chunk per request per step (fixed chunking)",
    )
    parser.add_argument(
        "--speculative",
        choices=["mtp", "mtp-confidence"],
        help="speculative decoding with the model's MTP layer",
    )
    parser.add_argument(
        "--num-draft-tokens",
        type=int,
        help="drafts per request per step (default: the MTP layer count; mtp-confidence: the chain "
        "length its head was trained on)",
    )
    parser.add_argument(
        "--step-time-budget-ms",
        type=float,
        help="cut prompt chunks to this predicted step time (default: off)",
    )
    parser.add_argument("--async-scheduling", action="store_true", help="plan step N+1 while step N computes")
    parser.add_argument("--deterministic", action="store_true", help="batch-invariant mode (README)")
    parser.add_argument(
        "--log-level",
        default=_default(ServerConfig, "log_level"),
        choices=["debug", "info", "warning", "error"],
    )


def serve(args: argparse.Namespace) -> int:
    """Run the server described by parsed ``deepinfer serve`` arguments."""
    import uvicorn

    from deepinfer.engine.llm_engine import LLMEngine
    from deepinfer.model_zoo import default_model_path
    from deepinfer.server.app import build_app

    model = Path(args.model) if args.model else default_model_path()
    engine_options = {
        "max_model_len": args.max_model_len,
        "max_num_seqs": args.max_num_seqs,
        "dtype": args.dtype,
        "accelerator": args.accelerator,
        "kv_cache_memory_gib": args.kv_cache_memory_gib,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "long_prefill_token_threshold": args.long_prefill_token_threshold,
        "speculative": args.speculative,
        "num_draft_tokens": args.num_draft_tokens,
        "step_time_budget_ms": args.step_time_budget_ms,
        "async_scheduling": args.async_scheduling or None,
        "deterministic": args.deterministic or None,
    }
    engine_config = EngineConfig(
        model=str(model), **{k: v for k, v in engine_options.items() if v is not None}
    )
    server_config = ServerConfig(
        served_model_name=args.served_model_name or model.name,
        host=args.host,
        port=args.port,
        api_key=args.api_key or envs.get("DEEPINFER_API_KEY"),
        max_queued_requests=args.max_queued_requests,
        max_request_bytes=args.max_request_bytes,
        log_level=args.log_level,
    )
    app = build_app(LLMEngine(engine_config), server_config)
    uvicorn.run(
        app,
        host=server_config.host,
        port=server_config.port,
        log_level=server_config.log_level,
        timeout_graceful_shutdown=5,
    )
    return 0
