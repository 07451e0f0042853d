"""`shardcore refit --check` end to end: local gloo processes and torchrun (without numpy) execute a
plan and compare every destination byte; bad input fails before any process starts."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

from shardcore.plan.layout import plan_layout
from shardcore.refit import RefitStats, plan_refit, preset
from tests.engine.test_check import NO_NUMPY, ROOT, _env

SHARDS = "tp=2,role=train+tp=1,role=decode+tp=1,role=decode"
ARGS = ["--shards", SHARDS, "--from", "0", "--to", "1,2", "--model", "tiny-dense"]


def _assert_refit_checked(result: subprocess.CompletedProcess[str]) -> None:
    """``--json``: every destination shard ok, and every byte the plan moves counted live."""
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    document = json.loads(result.stdout)
    assert document["ok"] and [row["shard"] for row in document["shards"]] == [1, 2]
    assert all(row["ok"] and not row["mismatches"] for row in document["shards"])
    plan = plan_refit(plan_layout(4, SHARDS), 0, [1, 2], preset("tiny-dense"))
    stats = RefitStats.of(plan)
    moved = {shard.index: shard.bytes + shard.local_bytes for shard in stats.shards}
    assert {row["shard"]: row["bytes"] for row in document["shards"]} == moved


def test_local_refit_check_speaks_like_check() -> None:
    # it printed nothing for the whole run (-v too), raw byte counts, and no summary line
    argv = [sys.executable, "-m", "shardcore", "refit", "--check", "--nproc", "4", "-v", *ARGS]
    result = subprocess.run(argv, capture_output=True, text=True, env=_env(), timeout=300, cwd=ROOT)
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr
    for stage in ("started", "joined", "planned", "executed"):
        assert f"  {stage:<8} 4/4 (" in result.stderr, stage  # each stage's count, as check prints it
        assert all(f"  rank {rank} {stage} (" in result.stderr for rank in range(4)), stage  # -v: every rank's
    lines = result.stdout.splitlines()
    assert lines[0].startswith("shardcore refit --check: 4 local gloo processes, tiny-dense from shard 0 to 1, 2")
    header = lines.index(next(line for line in lines if line.startswith("shard ")))
    rows = lines[header + 1 : -1]
    assert [row.split()[0] for row in rows] == ["1", "2"] and all(row.endswith(" ok") for row in rows), result.stdout
    assert all(" 4.72 MB " in row for row in rows)  # human units, as the plan's table has them
    assert lines[-1].startswith("all 2 destination ranks hold the source's tensors bitwise: 9.45 MB moved")


def test_local_refit_check_json_counts_every_byte() -> None:
    argv = [sys.executable, "-m", "shardcore", "refit", "--check", "--nproc", "4", "--json", *ARGS]
    _assert_refit_checked(subprocess.run(argv, capture_output=True, text=True, env=_env(), timeout=300, cwd=ROOT))


def test_torchrun_refit_check_without_numpy(tmp_path: Path) -> None:
    (tmp_path / "sitecustomize.py").write_text(NO_NUMPY)
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4"]
    argv += ["-m", "shardcore", "refit", "--check", "--json", *ARGS]
    result = subprocess.run(argv, capture_output=True, text=True, env=_env(tmp_path), timeout=300, cwd=ROOT)
    assert "Failed to initialize NumPy" in result.stderr  # numpy really was hidden from torch
    _assert_refit_checked(result)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--to", "7"], "7"),
        (["--model", "no-such-model"], "no-such-model"),
        (["--from", "5"], "5"),
    ],
)
def test_bad_refit_check_input_is_one_line_before_any_start(argv: list[str], message: str) -> None:
    args = [*ARGS]
    for flag, value in zip(argv[::2], argv[1::2]):
        args[args.index(flag) + 1] = value
    command = [sys.executable, "-m", "shardcore", "refit", "--check", "--nproc", "4", *args]
    result = subprocess.run(command, capture_output=True, text=True, env=_env(), timeout=120, cwd=ROOT)
    assert result.returncode == 2
    assert result.stderr.startswith("shardcore: error:") and message in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_local_refit_check_of_a_delta_refit_counts_the_wire_bytes() -> None:
    """``--delta``: a refit, an optimizer step changing 2 % of the elements, then a delta refit, checked bitwise;
    the summary and ``--json`` show the encoded bytes beside the tensor bytes."""
    delta = ["--delta", "--delta-checksum", "--anchor-every", "5"]
    argv = [sys.executable, "-m", "shardcore", "refit", "--check", "--nproc", "4", *ARGS, *delta]
    result = subprocess.run(argv, capture_output=True, text=True, env=_env(), timeout=300, cwd=ROOT)
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr
    lines = result.stdout.splitlines()
    assert "delta on, anchor every 5, checksum after applying" in lines[0], lines[0]
    assert lines[-1].startswith("all 2 destination ranks hold the source's tensors bitwise: 9.45 MB moved ("), lines
    result = subprocess.run([*argv, "--json"], capture_output=True, text=True, env=_env(), timeout=300, cwd=ROOT)
    _assert_refit_checked(result)
    document = json.loads(result.stdout)
    assert document["execute"]["delta"] == "on, anchor every 5, checksum after applying"
    assert all(0 < row["wire_bytes"] < row["bytes"] // 10 for row in document["shards"]), document["shards"]
