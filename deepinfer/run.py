"""``python -m deepinfer.run [prompts...]``: complete prompts with a model (``deepinfer run``)."""

from __future__ import annotations

import sys

from deepinfer.cli import Parser, add_run_arguments, reexec_with_malloc_tuning, run


def main() -> int:
    parser = Parser(prog="python -m deepinfer.run", description="Complete prompts with a model.")
    add_run_arguments(parser)
    args = parser.parse_args()
    reexec_with_malloc_tuning()
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
