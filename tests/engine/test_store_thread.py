"""shardcore's store calls run on one thread per process, and a process that used it ends quietly."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from tests.engine.test_check import ROOT, _env

SCRIPT = textwrap.dedent(
    """
    from shardcore.testing import run_world
    from tests.engine.engine_workers import sessions_on_one_store_thread

    print(run_world(4, sessions_on_one_store_thread, 5))
    """
)


def test_every_store_call_of_a_process_runs_on_one_thread_that_ends_with_it() -> None:
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=_env(), timeout=300, cwd=ROOT
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str([["shardcore-store-1"]] * 4)  # ten meetings, one thread, never replaced
    # a daemon thread still holding a store client at exit aborts the process ("terminate called ...")
    assert "terminate called" not in result.stderr, result.stderr
