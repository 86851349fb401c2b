"""``deepinfer router --help`` and ``deepinfer cluster --help`` (issue 34, "as a newcomer reads it"):
every option has help text, and each option with a default shows it."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from deepinfer.cli import Parser
from deepinfer.router.cli import add_cluster_arguments, add_router_arguments


@pytest.mark.parametrize("command", ["router", "cluster"])
def test_every_option_has_help_and_shows_its_default(command: str) -> None:
    parser = Parser(prog=f"deepinfer {command}")
    (add_router_arguments if command == "router" else add_cluster_arguments)(parser)
    done = subprocess.run([sys.executable, "-m", "deepinfer.cli", command, "--help"], capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    shown = "".join(done.stdout.split())  # argparse wraps lines (at spaces and after hyphens)
    options = [a for a in parser._actions if a.option_strings and a.dest != "help"]
    assert len(options) > 20
    for action in options:
        name = action.option_strings[-1]
        assert action.help, f"{command} {name} has no help text"
        assert name in shown, f"{command} --help does not list {name}"
        assert "".join(action.help.replace("%%", "%").split()) in shown, f"{command} --help: {name}'s help"
        if action.default not in (None, False, argparse.SUPPRESS):
            assert f"(default:{action.default})" in shown, f"{command} --help: {name}'s default"
