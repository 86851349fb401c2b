"""The ``deepinfer`` command line: ``deepinfer run`` (also ``python -m deepinfer.run``).

Heavy imports (torch, the engine) happen inside the subcommands, so ``deepinfer --help`` is instant.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence

from deepinfer import __version__, envs

MALLOC_TUNABLES = "glibc.malloc.mmap_threshold=4294967295:glibc.malloc.trim_threshold=4294967295"


def reexec_with_malloc_tuning() -> None:
    """Re-execute this process once with glibc's malloc thresholds raised: without it, large
    temporaries are mmapped and unmapped every step and page faults can double the run time."""
    if (
        os.environ.get("GLIBC_TUNABLES")
        or not envs.get("DEEPINFER_MALLOC_TUNING")
        or not sys.platform.startswith("linux")
    ):
        return
    env = {**os.environ, "GLIBC_TUNABLES": MALLOC_TUNABLES}
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompts", nargs="*", help="prompts to complete ('-' reads one prompt from stdin)")
    parser.add_argument("--file", help="read prompts from a file, one per line")
    parser.add_argument(
        "--model", help="Hugging Face model folder (default: the bundled deepinfer-tiny-coder)"
    )
    parser.add_argument("--max-tokens", type=int, default=128, help="tokens to generate per prompt")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--accelerator", help="cpu | nvidia | ascend | auto (default: DEEPINFER_ACCELERATOR)")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    parser.add_argument("--stream", action="store_true", help="print text as it is generated")
    parser.add_argument("--json", action="store_true", help="print one JSON object per prompt")


def _read_prompts(args: argparse.Namespace) -> list[str]:
    prompts = []
    for p in args.prompts:
        prompts.append(sys.stdin.read() if p == "-" else p)
    if args.file:
        with open(args.file, encoding="utf-8") as f:
            prompts += [line.rstrip("\n") for line in f if line.strip()]
    if not prompts and not sys.stdin.isatty():
        data = sys.stdin.read()
        if data.strip():
            prompts.append(data)
    if not prompts:
        raise SystemExit("deepinfer run: no prompt given (pass prompts as arguments, --file, or stdin)")
    return prompts


def run(args: argparse.Namespace) -> int:
    prompts = _read_prompts(args)
    from deepinfer.llm import LLM
    from deepinfer.sampling_params import SamplingParams

    options = {"dtype": args.dtype}
    if args.accelerator:
        options["accelerator"] = args.accelerator
    llm = LLM(args.model, **options)
    engine = llm.engine
    params = SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        max_tokens=args.max_tokens,
    )
    if not args.json:
        print(
            f"deepinfer {__version__} | platform {engine.platform.describe()} | model {engine.checkpoint.path.name} "
            f"({str(engine.dtype).removeprefix('torch.')})",
            file=sys.stderr,
        )
    for i, prompt in enumerate(prompts):
        rid = engine.new_request_id()
        engine.add_request(rid, prompt, None, params)
        if not args.json:
            print(f"--- prompt {i + 1}", file=sys.stderr)
            print(prompt, end="", flush=True)
        shown = 0
        out = None
        while engine.has_unfinished_requests():
            for out in engine.step():
                if args.stream and not args.json:
                    text = out.outputs[0].text
                    print(text[shown:], end="", flush=True)
                    shown = len(text)
        _report(out, prompt, args, shown)
    return 0


def _report(out, prompt: str, args: argparse.Namespace, shown: int) -> None:
    completion = out.outputs[0]
    m = out.metrics
    generated = len(completion.token_ids)
    decode_time = (m.finished_time or time.monotonic()) - (m.first_token_time or m.arrival_time)
    decode_tps = (generated - 1) / decode_time if generated > 1 and decode_time > 0 else None
    if args.json:
        print(
            json.dumps(
                {
                    "prompt": prompt,
                    "text": completion.text,
                    "token_ids": completion.token_ids,
                    "finish_reason": completion.finish_reason,
                    "prompt_tokens": len(out.prompt_token_ids),
                    "generated_tokens": generated,
                    "ttft_s": m.ttft,
                    "decode_tokens_per_s": decode_tps,
                }
            ),
            flush=True,
        )
        return
    print(completion.text[shown:], flush=True)
    tps = f"{decode_tps:.1f} tok/s" if decode_tps is not None else "n/a"
    print(
        f"[{completion.finish_reason} | prompt {len(out.prompt_token_ids)} tokens | {generated} generated | "
        f"TTFT {m.ttft * 1000:.1f} ms | decode {tps}]",
        file=sys.stderr,
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="deepinfer", description="DeepSeek-family inference engine")
    parser.add_argument("--version", action="version", version=f"deepinfer {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    add_run_arguments(sub.add_parser("run", help="complete prompts with a model"))
    args = parser.parse_args(argv)
    reexec_with_malloc_tuning()
    if args.command == "run":
        return run(args)
    parser.error(f"unknown command {args.command}")
    return 2
