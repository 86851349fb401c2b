"""``deepinfer serve``: check the settings, bind the port, start the engine core process, serve.

Everything a user can get wrong is checked before the model loads and reported in one line: the
settings (``EngineConfig`` / ``ServerConfig`` validation), an empty ``--api-key``, the model folder,
and the port (bound here, first). The engine core runs in its own process (``deepinfer.core``);
this process is the API front.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
from pathlib import Path
from typing import get_args

from deepinfer import envs
from deepinfer.config import WEIGHTS_HELP, EngineConfig, Weights
from deepinfer.model_zoo import model_argument
from deepinfer.server.config import ServerConfig
from deepinfer.web.auth import load_cluster_secret


def _default(config: type[EngineConfig | ServerConfig], field: str) -> object:
    """A config field's default, so the command line and the config class never disagree."""
    return config.model_fields[field].default


def port_number(text: str) -> int:
    """argparse type: a TCP port, 0..65535."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{port} is not a port number (0..65535; 0 picks a free one)")
    return port


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", type=model_argument,
        help="Hugging Face model folder, or a bundled model's name: deepinfer-tiny-coder (the default), "
        "deepinfer-tiny-coder-fp8",
    )  # fmt: skip
    parser.add_argument(
        "--served-model-name", help="the model name clients send (default: the folder's name)"
    )
    parser.add_argument(
        "--host",
        default=_default(ServerConfig, "host"),
        help="address to listen on (0.0.0.0: every interface; then set an API key)",
    )
    parser.add_argument(
        "--port", type=port_number, default=_default(ServerConfig, "port"), help="TCP port (0: any free one)"
    )
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
    parser.add_argument(
        "--max-tokens-default",
        type=int,
        default=_default(ServerConfig, "max_tokens_default"),
        help="new tokens for a request that sets no max_tokens (0: up to the context length)",
    )
    parser.add_argument(
        "--max-tokens-limit",
        type=int,
        help="most new tokens a request may ask for (default: the context length)",
    )
    parser.add_argument(
        "--request-timeout", type=float, help="seconds a request may run before it is ended with an error"
    )
    parser.add_argument(
        "--drain-timeout",
        type=float,
        default=_default(ServerConfig, "drain_timeout_s"),
        help="on SIGTERM/SIGINT: seconds in-flight requests may take to finish",
    )
    parser.add_argument(
        "--restart-engine",
        action="store_true",
        help="restart the engine core if it dies (default: exit non-zero so an orchestrator restarts us)",
    )
    parser.add_argument(
        "--front-nice",
        type=int,
        default=_default(ServerConfig, "front_nice"),
        help="raise the API front's nice value by this much, so HTTP work yields the CPU to the engine "
        "cores (0-19; 0: off; Linux)",
    )
    parser.add_argument(
        "--timeout-keep-alive",
        type=float,
        default=_default(ServerConfig, "timeout_keep_alive_s"),
        help="close connections idle this many seconds",
    )
    parser.add_argument(
        "--body-timeout",
        type=float,
        default=_default(ServerConfig, "body_timeout_s"),
        help="seconds a request body may take to arrive (then 408)",
    )
    parser.add_argument("--accelerator", help="cpu | nvidia | ascend | auto (default: DEEPINFER_ACCELERATOR)")
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="model dtype: activations, and the weights not kept quantised",
    )
    parser.add_argument("--weights", default="as-stored", choices=list(get_args(Weights)), help=WEIGHTS_HELP)
    parser.add_argument(
        "--kv-cache-memory-gib",
        type=float,
        help="KV-cache size (default: 90%% of free memory less one profiled step's peak)",
    )
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
    parser.add_argument(
        "--max-decode-steps",
        type=int,
        default=1,
        help="decode iterations one step may run back to back at small batches, cut to about 4 ms: "
        "streams then get tokens in bursts of up to this many (default 1, one token per step, for even "
        f"streaming; the offline engine's default is {_default(EngineConfig, 'max_decode_steps')})",
    )
    from deepinfer.parallel.serve_args import add_parallel_arguments

    add_parallel_arguments(parser)
    parser.add_argument(
        "--role",
        choices=["prefill", "decode", "both"],
        help="what routers send this worker (default: the platform's node role: 950PR prefill, 950DT decode, others both)",
    )
    parser.add_argument(
        "--register-with",
        metavar="URL",
        help="register with the router at URL (and keep doing so; needs the cluster secret); "
        "deregister when stopping",
    )
    parser.add_argument(
        "--cluster-secret-file",
        metavar="PATH",
        help="file holding the secret this worker shares with its router (default: "
        "DEEPINFER_CLUSTER_SECRET; unset: no router may give handoff orders, and /load and /kv/release "
        "take the API key)",
    )
    parser.add_argument("--deterministic", action="store_true", help="batch-invariant mode (README)")
    parser.add_argument(
        "--log-level",
        default=_default(ServerConfig, "log_level"),
        choices=["debug", "info", "warning", "error"],
        help="log level of the HTTP server",
    )


def engine_config(args: argparse.Namespace, model: Path) -> EngineConfig:
    """The core's EngineConfig from ``deepinfer serve`` arguments (text is made by the front)."""
    from deepinfer.kvstore.cli import config_from_args as kvstore_config_from_args

    options = {
        "max_model_len": args.max_model_len,
        "max_num_seqs": args.max_num_seqs,
        "dtype": args.dtype,
        "weights": args.weights,
        "accelerator": args.accelerator,
        "kv_cache_memory_gib": args.kv_cache_memory_gib,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "long_prefill_token_threshold": args.long_prefill_token_threshold,
        "speculative": args.speculative,
        "num_draft_tokens": args.num_draft_tokens,
        "step_time_budget_ms": args.step_time_budget_ms,
        "async_scheduling": args.async_scheduling or None,
        "max_decode_steps": args.max_decode_steps,
        "deterministic": args.deterministic or None,
        "kv_store": kvstore_config_from_args(args),
    }
    from deepinfer.parallel.serve_args import parallel_options

    options.update(parallel_options(args))
    return EngineConfig(
        model=str(model), detokenize=False, **{k: v for k, v in options.items() if v is not None}
    )


def server_config(args: argparse.Namespace, model: Path) -> ServerConfig:
    from deepinfer.core.load import model_fingerprint  # numpy: not on the --help path

    if args.api_key is not None:
        api_key = args.api_key
        if not api_key:
            raise ValueError("--api-key is empty: give a key, or leave the option out to serve without one")
    else:
        api_key = envs.get("DEEPINFER_API_KEY")
        if api_key is not None and not api_key:
            raise ValueError(
                "DEEPINFER_API_KEY is set but empty: give a key, or unset it to serve without one"
            )
    cluster_secret = load_cluster_secret(args.cluster_secret_file)
    if args.register_with and cluster_secret is None:
        raise ValueError(
            "--register-with: registering with a router needs the cluster secret: give "
            "--cluster-secret-file PATH or set DEEPINFER_CLUSTER_SECRET (the router's)"
        )
    return ServerConfig(
        served_model_name=args.served_model_name or model.name,
        host=args.host,
        port=args.port,
        api_key=api_key,
        cluster_secret=cluster_secret,
        max_queued_requests=args.max_queued_requests,
        max_request_bytes=args.max_request_bytes,
        max_tokens_default=args.max_tokens_default or None,
        max_tokens_limit=args.max_tokens_limit,
        request_timeout_s=args.request_timeout,
        drain_timeout_s=args.drain_timeout,
        restart_engine=args.restart_engine,
        front_nice=args.front_nice,
        timeout_keep_alive_s=args.timeout_keep_alive,
        body_timeout_s=args.body_timeout,
        log_level=args.log_level,
        role=args.role,
        model_fingerprint=model_fingerprint(model),
    )


def kv_store_summary(engine: EngineConfig) -> str:
    """The startup banner's words for the engine's KV store: ``off``, or ``on`` and where each tier
    lives (host memory size, disk folder, shared folder)."""
    store = engine.kv_store
    if store is None:
        return "off"
    tiers = [f"host memory {store.host_cache_gib:g} GiB"]
    if store.path is not None:
        per_rank = " (a rank-N subfolder per data-parallel rank)" if engine.data_parallel_size > 1 else ""
        tiers.append(f"disk {store.path}{per_rank}, {store.capacity_gib:g} GiB")
    if store.shared_path is not None:
        tiers.append(f"shared {store.shared_path}, {store.shared_capacity_gib:g} GiB")
    return "on: " + "; ".join(tiers)


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (raises OSError saying why not)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.listen(2048)
    sock.set_inheritable(False)
    return sock


def serve(args: argparse.Namespace) -> int:
    """Run the server described by parsed ``deepinfer serve`` arguments; returns the exit code."""
    from deepinfer.model_zoo import default_model_path

    model = Path(args.model) if args.model else default_model_path()
    if not (model / "config.json").is_file():
        raise ValueError(f"--model {model}: not a model folder (no config.json)")
    engine = engine_config(args, model)
    config = server_config(args, model)
    if engine.data_parallel_size > 1 and config.restart_engine:
        raise ValueError(
            "--restart-engine does not combine with --data-parallel-size > 1 (a rank cannot rejoin)"
        )
    if config.api_key is None and not config.loopback:
        print(
            f"deepinfer serve: warning: listening on {config.host} without an API key: anyone who can reach "
            "this address can use the model (set --api-key or DEEPINFER_API_KEY)",
            file=sys.stderr,
        )
    try:
        sock = bind(config.host, config.port)
    except OSError as exc:
        raise ValueError(f"cannot listen on {config.host}:{config.port}: {exc.strerror or exc}") from None
    return _serve(model, engine, config, sock, args.register_with)


def _serve(
    model: Path,
    engine: EngineConfig,
    config: ServerConfig,
    sock: socket.socket,
    register_with: str | None = None,
) -> int:
    import uvicorn
    import uvloop

    from deepinfer.core.client import EngineClient
    from deepinfer.core.launch import CoreProcess, CoreSpec
    from deepinfer.server.app import build_app
    from deepinfer.server.priority import CoreSpawner, lower_front_priority
    from deepinfer.server.router_api import Registration, advertised_url, worker_role
    from deepinfer.server.runner import IdleTimeoutHttpToolsProtocol, Server, run
    from deepinfer.tokenizer import Tokenizer

    tokenizer_dir = Path(engine.tokenizer or engine.model)
    tokenizer = Tokenizer(tokenizer_dir) if (tokenizer_dir / "tokenizer.json").is_file() else None
    front = os.getpid()
    holder: dict[str, Server] = {}
    spawner = CoreSpawner()  # engine cores start from its thread, at this process's original priority
    client = EngineClient(
        lambda engine_id, address: spawner.run(
            CoreProcess, CoreSpec(engine_id=engine_id, address=address, parent_pid=front, engine=engine)
        ),
        tokenizer,
        config.max_queued_requests,
        num_cores=engine.data_parallel_size,  # data parallel: core i is rank i
        restart=config.restart_engine,
        on_fatal=lambda reason: holder["server"].fatal(reason),
        request_timeout_s=config.request_timeout_s,
    )
    app = build_app(client, config, tokenizer)
    uv_config = uvicorn.Config(
        app,
        log_level=config.log_level,
        lifespan="off",
        http=IdleTimeoutHttpToolsProtocol,
        timeout_keep_alive=config.timeout_keep_alive_s,
        timeout_graceful_shutdown=5,
    )
    server = holder["server"] = Server(uv_config, app.state.serving, config.drain_timeout_s)
    host, port = sock.getsockname()[:2]

    def banner() -> str:
        info = client.info
        auth = "on (clients send the API key)" if config.api_key else "off (no API key)"
        return (
            f"deepinfer serve: model {config.served_model_name!r} at http://{host}:{port}/v1 | "
            f"role {worker_role(app.state.serving).value} | auth {auth} | "
            f"engine core pid {info.pid}: {info.description}, context {info.max_model_len}, "
            f"{info.num_kv_blocks} KV blocks of {info.block_size} tokens | KV store {kv_store_summary(engine)}"
        )

    lower_front_priority(config.front_nice, keep={spawner.native_id})
    registration = None
    if register_with:
        registration = Registration(register_with, advertised_url(config.host, port), config.cluster_secret)
        registration.start()
    try:
        return uvloop.run(run(server, client, [sock], banner))  # libuv's loop: less front CPU per event
    finally:
        if registration is not None:
            registration.stop()  # deregisters
        spawner.close()
