"""The CLI starts without the stages' heavy libraries: ``rayline --help``, and each command's ``--help`` (its
options built from the command's request), load no Ray Serve, Ray Data or pandas. Only a command that runs a
stage needs them, and importing them costs every start over a second."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from tests.support import REPO_ROOT

pytestmark = pytest.mark.unit

HEAVY = ("ray.serve", "ray.data", "pandas")

# Runs the entry point (pyproject's `rayline = "rayline.cli:app"`) on each command line `rayline [COMMAND] --help`,
# in one process; the last line printed is the heavy modules then loaded.
PROGRAM = textwrap.dedent(
    """
    import json, sys
    import typer.main
    from rayline.cli import app

    def commands(group, path):
        for name, command in group.commands.items():
            if hasattr(command, "commands"):
                yield from commands(command, [*path, name])
            else:
                yield [*path, name]

    heavy = sys.argv[1:]
    for args in [[], *commands(typer.main.get_command(app), [])]:
        sys.argv = ["rayline", *args, "--help"]  # the command line, as the console script's process has it
        app(standalone_mode=False)
    print()
    print(json.dumps(sorted(m for m in heavy if m in sys.modules)))
    """
)


def test_the_cli_and_every_commands_help_load_no_ray_serve_ray_data_or_pandas() -> None:
    done = subprocess.run(
        [sys.executable, "-c", PROGRAM, *HEAVY], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert "rayline serve rollout" in done.stdout, "the walk reached no subcommand's help"
    loaded = json.loads(done.stdout.splitlines()[-1])
    assert loaded == [], f"importing the CLI loaded {loaded}: import them inside the command that needs them"
