"""``deepinfer router`` and ``deepinfer cluster``: their arguments and entry points (registered in
``deepinfer.cli``). Bad configuration is one line on stderr naming the option, and exit status 2."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pathlib import Path

from deepinfer.model_zoo import model_argument
from deepinfer.router.config import RouterConfig


def _default(field: str) -> object:
    return RouterConfig.model_fields[field].default


def add_router_options(parser: argparse.ArgumentParser) -> None:
    """Options shared by ``router`` and ``cluster`` (how requests are routed)."""
    parser.add_argument("--host", default=_default("host"), help="address the router listens on")
    parser.add_argument("--port", type=int, default=_default("port"), help="TCP port the router listens on")
    parser.add_argument(
        "--api-key",
        help="require this key from clients on /v1/*, the API docs and /router/workers (default: "
        "DEEPINFER_API_KEY; unset: no key needed)",
    )
    parser.add_argument(
        "--model",
        type=model_argument,
        help="model folder (or bundled model name) whose tokenizer the router counts prompt tokens with (default: the bundled one)",
    )
    parser.add_argument(
        "--prefill-policy",
        default=_default("prefill_policy"),
        choices=["estimated-compute", "least-requests", "round-robin"],
        help="how the worker for a long prompt is chosen (the others are baselines)",
    )
    parser.add_argument(
        "--prefill-horizon-s",
        type=float,
        default=_default("prefill_horizon_s"),
        help="estimated-compute: place a long prompt only once a worker's expected prompt backlog is under this",
    )
    parser.add_argument(
        "--prefill-queue-limit",
        type=int,
        default=_default("prefill_queue_limit"),
        help="estimated-compute: long prompts that may wait in the router for a worker (beyond: 429); 0: "
        "place each at arrival",
    )
    parser.add_argument(
        "--min-disaggregated-tokens",
        type=int,
        default=_default("min_disaggregated_tokens"),
        help="prompts shorter than this go straight to a decode-capable worker",
    )
    parser.add_argument(
        "--request-timeout-s",
        type=float,
        default=_default("request_timeout_s"),
        help="each request's deadline in seconds, retries included",
    )
    parser.add_argument(
        "--first-byte-timeout-s",
        type=float,
        default=_default("first_byte_timeout_s"),
        help="streaming: a worker that sends no output within this many seconds is retried elsewhere",
    )
    parser.add_argument(
        "--max-attempts", type=int, default=_default("max_attempts"), help="workers tried per request"
    )
    parser.add_argument(
        "--kv-lease-s",
        type=float,
        default=_default("kv_lease_s"),
        help="how long a prefill worker holds handed-off KV blocks for the decode worker",
    )
    parser.add_argument(
        "--poll-interval-s",
        type=float,
        default=_default("poll_interval_s"),
        help="seconds between load / health polls of each worker",
    )
    parser.add_argument(
        "--poll-timeout-s",
        type=float,
        default=_default("poll_timeout_s"),
        help="a load poll slower than this many seconds fails",
    )
    parser.add_argument(
        "--eject-after",
        type=int,
        default=_default("eject_after"),
        help="consecutive failed polls that eject a worker (the next good poll re-admits it)",
    )
    parser.add_argument(
        "--connect-timeout-s",
        type=float,
        default=_default("connect_timeout_s"),
        help="seconds to connect to a worker",
    )
    parser.add_argument(
        "--max-request-bytes",
        type=int,
        default=_default("max_request_bytes"),
        help="larger request bodies get 413 before they are read (as deepinfer serve)",
    )
    parser.add_argument(
        "--body-timeout-s",
        type=float,
        default=_default("body_timeout_s"),
        help="seconds a request body may take to arrive (then 408)",
    )
    parser.add_argument(
        "--startup-timeout-s",
        type=float,
        default=_default("startup_timeout_s"),
        help="wait this long for workers",
    )
    parser.add_argument(
        "--log-level",
        default=_default("log_level"),
        choices=["debug", "info", "warning", "error"],
        help="log level of the router",
    )


def add_router_arguments(parser: argparse.ArgumentParser) -> None:
    """``deepinfer router``: its workers, registration and cluster secret, and the shared options."""
    for role in ("prefill", "decode", "both"):
        parser.add_argument(f"--{role}", nargs="+", metavar="URL", help=f"{role}-role worker URLs")
    parser.add_argument(
        "--accept-registrations",
        action="store_true",
        help="let workers join with deepinfer serve --register-with URL (they prove themselves with the "
        "cluster secret, which this needs)",
    )
    parser.add_argument(
        "--cluster-secret-file",
        metavar="PATH",
        help="file holding the secret the router and its workers share: sent to workers on every request, "
        "required from workers that register (default: DEEPINFER_CLUSTER_SECRET; unset: none)",
    )
    parser.add_argument(
        "--deregister-after-s",
        type=float,
        default=_default("deregister_after_s"),
        help="forget a registered worker that stays ejected this long (workers named here are only ejected)",
    )
    add_router_options(parser)


def api_key(args: argparse.Namespace) -> str | None:
    """The clients' API key: ``--api-key``, else ``DEEPINFER_API_KEY``, else ``None``; an empty one is
    a ``ValueError`` naming where it came from."""
    from deepinfer import envs

    if args.api_key is not None:
        if not args.api_key:
            raise ValueError("--api-key is empty: give a key, or leave the option out to route without one")
        return args.api_key
    key = envs.get("DEEPINFER_API_KEY")
    if key is not None and not key:
        raise ValueError("DEEPINFER_API_KEY is set but empty: give a key, or unset it to route without one")
    return key


def router_config(args: argparse.Namespace, **overrides) -> RouterConfig:
    """The ``RouterConfig`` of parsed arguments; ``ValueError`` naming the option when invalid."""
    from pydantic import ValidationError

    from deepinfer.web.auth import load_cluster_secret

    values = {
        "api_key": api_key(args),
        "deregister_after_s": getattr(args, "deregister_after_s", _default("deregister_after_s")),
        "prefill": tuple(getattr(args, "prefill", ()) or ()),
        "decode": tuple(getattr(args, "decode", ()) or ()),
        "both": tuple(getattr(args, "both", ()) or ()),
        "accept_registrations": getattr(args, "accept_registrations", False),
        "model": args.model,
        "host": args.host,
        "port": args.port,
        "prefill_policy": args.prefill_policy,
        "prefill_horizon_s": args.prefill_horizon_s,
        "prefill_queue_limit": args.prefill_queue_limit,
        "min_disaggregated_tokens": args.min_disaggregated_tokens,
        "request_timeout_s": args.request_timeout_s,
        "first_byte_timeout_s": args.first_byte_timeout_s,
        "max_attempts": args.max_attempts,
        "kv_lease_s": args.kv_lease_s,
        "poll_interval_s": args.poll_interval_s,
        "poll_timeout_s": args.poll_timeout_s,
        "eject_after": args.eject_after,
        "connect_timeout_s": args.connect_timeout_s,
        "max_request_bytes": args.max_request_bytes,
        "body_timeout_s": args.body_timeout_s,
        "startup_timeout_s": args.startup_timeout_s,
        "log_level": args.log_level,
        **overrides,
    }
    if "cluster_secret" not in overrides:
        values["cluster_secret"] = load_cluster_secret(getattr(args, "cluster_secret_file", None))
    try:
        config = RouterConfig(**values)
    except ValidationError as exc:
        first = exc.errors()[0]
        message = str(first["msg"]).removeprefix("Value error, ")
        if first["loc"]:  # a field's error; a check across fields names its options itself
            message = "--" + str(first["loc"][0]).replace("_", "-") + ": " + message
        raise ValueError(message) from None
    config.workers()  # a URL given twice
    if not (config.prefill or config.decode or config.both) and not config.accept_registrations:
        raise ValueError(
            "no workers: give --prefill, --decode or --both URLs (or --accept-registrations to let workers join)"
        )
    if config.prefill and not (config.decode or config.both) and not config.accept_registrations:
        raise ValueError(
            "--prefill: prefill workers need a --decode or --both worker to finish their requests"
        )
    return config


async def check_workers(config: RouterConfig) -> None:
    """Reach and check every configured worker once (``WorkerRejected`` says which and why)."""
    from deepinfer.router.app import http_client, make_registry
    from deepinfer.router.metrics import RouterMetrics

    async with http_client(config) as client:
        registry = make_registry(config, client, RouterMetrics())
        await registry.add_configured(config.workers(), config.startup_timeout_s)


def serve_router(config: RouterConfig) -> None:
    """Run the router until interrupted (workers already checked)."""
    import uvicorn

    from deepinfer.router.app import build_router_app

    print(f"deepinfer router: http://{config.host}:{config.port} ({config.prefill_policy})", flush=True)
    uvicorn.run(
        build_router_app(config), host=config.host, port=config.port, log_level=config.log_level,
        timeout_graceful_shutdown=30,  # SIGTERM: streams in flight may finish (serve's drain default)
    )  # fmt: skip


def run_router(args: argparse.Namespace) -> int:
    from deepinfer.router.registry import WorkerRejected

    try:
        config = router_config(args)
        asyncio.run(check_workers(config))
    except (ValueError, WorkerRejected, FileNotFoundError) as exc:
        print(f"deepinfer router: {exc}", file=sys.stderr)
        return 2
    serve_router(config)
    return 0


def add_cluster_arguments(parser: argparse.ArgumentParser) -> None:
    """``deepinfer cluster``: how many workers of each role, their settings, and the shared options."""
    for role in ("prefill", "decode", "both"):
        parser.add_argument(
            f"--{role}", type=int, default=0, metavar="N", help=f"{role}-role workers to start"
        )
    parser.add_argument(
        "--kv-store-path",
        help="the workers' shared KV store directory (their --kv-shared-path): prefill workers hand "
        "prompts' KV blocks to decode workers through it; required with prefill or decode workers",
    )
    parser.add_argument("--worker-threads", type=int, help="torch threads per worker (OMP_NUM_THREADS)")
    parser.add_argument(
        "--worker-kv-cache-gib",
        type=float,
        default=1.0,
        help="KV cache per worker (they share this host's memory)",
    )
    parser.add_argument(
        "--serve-args", default="", help="extra 'deepinfer serve' options for every worker, as one string"
    )
    parser.add_argument(
        "--log-dir",
        type=Path,
        help="keep the workers' logs in this directory (default: a temporary one, removed at exit)",
    )
    add_router_options(parser)


def run_cluster(args: argparse.Namespace) -> int:
    import shlex

    from deepinfer.router import cluster

    counts = {"prefill": args.prefill, "decode": args.decode, "both": args.both}
    try:
        for role, n in counts.items():
            if n < 0:
                raise ValueError(f"--{role}: {n} is not a worker count (>= 0)")
        if not (args.decode or args.both):
            raise ValueError("--decode/--both: the cluster needs at least one worker that can decode")
        if args.worker_kv_cache_gib <= 0:
            raise ValueError(f"--worker-kv-cache-gib: {args.worker_kv_cache_gib} is not a size (> 0)")
        if args.worker_threads is not None and args.worker_threads < 1:
            raise ValueError(f"--worker-threads: {args.worker_threads} is not a thread count (>= 1)")
        if args.kv_store_path is None and (args.prefill or args.decode):
            raise ValueError(
                "--kv-store-path: a cluster with prefill or decode workers needs a shared KV store "
                "directory (the prefill->decode handoff goes through it)"
            )
        if args.kv_store_path is not None:
            cluster.check_store_path(args.kv_store_path)
        if args.log_dir is not None:
            try:
                args.log_dir.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise ValueError(f"--log-dir: cannot create {args.log_dir}: {exc.strerror}") from None
            if not os.access(args.log_dir, os.W_OK):
                raise ValueError(f"--log-dir: {args.log_dir} is not writable")
        from deepinfer.web.auth import new_cluster_secret

        # the workers are started below; a secret of this run's own, for the router and them
        config = router_config(
            argparse.Namespace(**{**vars(args), "prefill": [], "decode": [], "both": []}),
            accept_registrations=True,
            cluster_secret=new_cluster_secret(),
        )
    except ValueError as exc:
        print(f"deepinfer cluster: {exc}", file=sys.stderr)
        return 2
    serve_args = ["--kv-cache-memory-gib", str(args.worker_kv_cache_gib), *shlex.split(args.serve_args)]
    if args.kv_store_path is not None:  # a host tier as large as the device cache, then the shared dir
        serve_args += [
            "--kv-shared-path",
            args.kv_store_path,
            "--kv-host-cache-gib",
            str(args.worker_kv_cache_gib),
        ]
    return cluster.run_cluster(
        {r: n for r, n in counts.items() if n},
        args.model,
        serve_args,
        args.worker_threads,
        config,
        serve_router,
        args.log_dir,
    )
