"""Data-parallel engine cores whose model runner is scripted, for the official-client suite.

``python -m tests.parallel.scripted_rank SPEC_JSON SCRIPT_DIR`` is ``python -m deepinfer.core.main
SPEC_JSON`` (the process ``deepinfer serve --data-parallel-size N`` starts for rank i), with one
change: once the rank is built, its engine's runner is wrapped by tests/server's ``ScriptedRunner``,
whose scripts are read from SCRIPT_DIR. The test process writes them there (``ScriptFiles``, the
``runner`` of the server handle) before it sends the request they are for, so whichever rank the
front picks finds the script. Everything else (lockstep, expert parallelism, the channel to the
front, dying with the front) is the production code.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from deepinfer.core.launch import CoreProcess, CoreSpec, core_environment
from deepinfer.tokenizer import Tokenizer
from tests.conftest import REPO_ROOT


class ScriptFiles:
    """The test side: ``script(key, output)`` as tests/server's ``ScriptedRunner`` has it, written to
    a folder the ranks read (one JSON file per call, numbered in order, renamed into place whole)."""

    def __init__(self, folder: Path, tokenizer: Tokenizer) -> None:
        self.folder, self.tokenizer = folder, tokenizer
        self.written = 0

    def script(self, key: str, output: str) -> list[int]:
        ids = self.tokenizer.encode(output, add_special_tokens=False)
        self.written += 1
        name = f"{self.written:06d}"
        tmp = self.folder / f".{name}.tmp"
        tmp.write_text(json.dumps({"key": key, "ids": ids}))
        os.replace(tmp, self.folder / f"{name}.json")
        return ids


class ScriptedRankProcess(CoreProcess):
    """A ``CoreProcess`` running this module instead of ``deepinfer.core.main``."""

    def __init__(self, spec: CoreSpec, script_dir: Path) -> None:
        self.engine_id = spec.engine_id
        command = [
            sys.executable,
            "-m",
            "tests.parallel.scripted_rank",
            spec.model_dump_json(),
            str(script_dir),
        ]
        env = {**core_environment(os.environ), "PYTHONPATH": str(REPO_ROOT)}
        self._proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, cwd=REPO_ROOT, env=env)


def _scripted_runner(script_dir: Path):
    from tests.server.conftest import ScriptedRunner

    class FileScriptedRunner(ScriptedRunner):
        """Reads the script files written to ``script_dir`` since it last looked, in the order they
        were written (a key scripted again takes its latest script)."""

        def __init__(self, engine) -> None:
            super().__init__(engine)
            self.read: set[str] = set()

        def _script_for(self, prompt_token_ids: list[int]) -> list[int] | None:
            for name in sorted(
                n for n in os.listdir(script_dir) if n.endswith(".json") and n not in self.read
            ):
                entry = json.loads((script_dir / name).read_text())
                self.scripts[entry["key"]] = entry["ids"]
                self.read.add(name)
            return super()._script_for(prompt_token_ids)

    return FileScriptedRunner


def main(argv: list[str]) -> int:
    from deepinfer.core import main as core_main
    from deepinfer.parallel import core as parallel_core

    spec_json, script_dir = argv
    runner = _scripted_runner(Path(script_dir))
    build_rank = parallel_core.build_rank

    def build_scripted_rank(config, engine_id):
        rank = build_rank(config, engine_id)
        runner(rank.engine)
        return rank

    parallel_core.build_rank = build_scripted_rank  # core_main imports it when it builds the rank
    return core_main.main([spec_json])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
