"""`shardcore replan --check` end to end: local processes, the lost (and released) ones killed, the survivors'
table; bad input and a tensor with no surviving copy are one line before any process starts."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytest.importorskip("torch")

from tests.engine.test_check import ROOT, _env

SPEC = "tp=2,pp=2,role=train+tp=2,dp=2,role=prefill"
BASE = ["replan", "--check", "--world", "8", "--shards", SPEC, "--model", "tiny-moe"]


def _shardcore(*argv: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "shardcore", *argv]
    return subprocess.run(command, capture_output=True, text=True, env=_env(), timeout=timeout, cwd=ROOT)


def test_a_loss_with_a_release_is_checked_on_the_survivors() -> None:
    result = _shardcore(*BASE, "--lost", "6", timeout=400)  # the best option drops prefill's replica: 7 leaves too
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("replan --check: 8 local processes, losing rank 6; option 1 (shrink)")
    assert "(released too: 7)" in lines[0]
    assert lines[1].startswith("survivors: 6 ranks of 8 formed a new world; its store: the old store, under ")
    rows = [line.split() for line in lines[3:5]]
    assert [row[0] for row in rows] == ["0", "1"] and all(row[-1] == "ok" for row in rows)
    assert [(row[5], row[6]) for row in rows] == [("0", "4"), ("0", "2")]  # restored, kept: nobody needs weights
    assert lines[5].startswith("slowest survivor: old build ") and "restore " in lines[5]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--lost", "1", "--option", "3"], "--option 3: the replan has options 1 to 1"),
        (["--lost", "1", "--new-world", "9"], "cannot start the ranks --new-world adds"),
        (["--lost", "1", "--json"], "drop --json and --svg"),
        (["--lost", "9"], "lost rank 9 is outside the world [0, 8)"),
    ],
)
def test_bad_check_input_is_one_line_before_any_start(argv: list[str], message: str) -> None:
    result = _shardcore(*BASE, *argv)
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith("shardcore: error:") and message in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and result.stdout == ""


def test_a_tensor_with_no_surviving_copy_is_named_before_any_start() -> None:
    result = _shardcore(
        "replan", "--check", "--world", "8", "--shards", "tp=2,dp=2,ep=2,role=train+tp=4,role=prefill",
        "--model", "tiny-moe", "--lost", "2,5",
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    line = result.stderr.strip()
    assert len(line.splitlines()) == 1 and line.startswith("shardcore: error: cannot restore the weights of")
    assert "no surviving copy; held only by lost ranks" in line and "checkpoint" in line and len(line) < 1100


def test_a_replan_check_the_machine_cannot_hold_is_refused_before_any_start() -> None:
    """Llama 3 70B on 8 local processes: each rank holds its old and new tensors, hundreds of GB in all."""
    from shardcore.cli.check import MIB_PER_PROCESS, _available_mib
    from shardcore.engine.live.restore_check import check_held_bytes
    from shardcore.refit.options import DEFAULT_BUCKET_BYTES
    from shardcore.replan import ReplanRequest

    spec = "tp=2,dp=2,role=train+tp=2,dp=2,role=decode"
    option = ReplanRequest(model="llama3-70b", shards=spec, world=8, lost=(3,)).option(1)
    held = [check_held_bytes(option, rank, DEFAULT_BUCKET_BYTES) for rank in range(8)]
    assert held[3] < held[0]  # the lost rank holds only its old tensors
    need = sum(held) + 8 * (MIB_PER_PROCESS << 20)
    available = _available_mib()
    if available is None or available << 20 >= need:
        pytest.skip(f"this machine holds {need / 2**30:.0f} GiB: the check would run")
    result = _shardcore("replan", "--check", "--world", "8", "--shards", spec, "--model", "llama3-70b", "--lost", "3")
    assert result.returncode == 2 and result.stdout == "", result.stderr
    assert result.stderr.startswith(f"shardcore: error: --world 8: 8 processes would hold about {need / 2**30:.1f} GiB")
    assert result.stderr.endswith("GiB is available here: check a smaller model or world\n")
    assert result.stderr.count("\n") == 1
