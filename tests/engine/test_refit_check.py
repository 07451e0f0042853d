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


@pytest.mark.parametrize(
    ("backend", "device"), [("gloo", "cpu"), ("cpu:gloo,cuda:nccl", "cpu"), ("nccl", "cuda:3"), ("mpi", "cpu")]
)
def test_the_check_puts_its_tensors_where_the_group_moves_them(
    backend: str, device: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under NCCL the check's sources and destinations go on the rank's current GPU (torchrun's LOCAL_RANK),
    where the executor wants them; a group whose libraries move CPU tensors keeps them on the CPU."""
    import torch

    from shardcore.engine.device import collective_device

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert collective_device(backend) == torch.device(device)


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
    what = "megatron -> megatron layout, in the source's dtypes, dense only"
    assert lines[1] == f"checking {what}" and f"checked {what}" in lines  # echoed before the run and with its result
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
    assert "checked megatron -> megatron layout, in the source's dtypes, dense then delta (on, anchor every 5, " in (
        result.stdout
    )
    # the dense refit and the delta refit side by side: the delta's wire bytes a fraction of the dense one's
    header = next(line for line in lines if line.startswith("shard "))
    assert header.split()[3:8] == ["dense", "wire", "dense", "s", "delta"], header
    for row in lines[lines.index(header) + 1 : -1]:
        dense, delta = row.split()[4:6], row.split()[7:9]
        assert dense[0] == "4.72" and dense[1] == "MB" and (delta[1] == "kB" or float(delta[0]) < 0.5), row
    result = subprocess.run([*argv, "--json"], capture_output=True, text=True, env=_env(), timeout=300, cwd=ROOT)
    _assert_refit_checked(result)
    document = json.loads(result.stdout)
    assert document["execute"]["delta"] == "on, anchor every 5, checksum after applying"
    assert document["checked"] == {"from_layout": "megatron", "to_layout": "megatron", "to_dtype": None,
                                   "scale": None, "delta": "on, anchor every 5, checksum after applying"}  # fmt: skip
    assert all(0 < row["wire_bytes"] < row["bytes"] // 10 for row in document["shards"]), document["shards"]
    for row in document["shards"]:
        dense, changed = row["refits"]["dense"], row["refits"]["delta"]
        assert dense["bytes"] == changed["bytes"] == row["bytes"] and dense["wire_bytes"] == row["bytes"]
        assert changed["wire_bytes"] == row["wire_bytes"] < dense["wire_bytes"] // 10


QWEN2_7B = {  # Qwen2-7B's sizes (its config.json), made here: no download
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "num_attention_heads": 28,
    "num_key_value_heads": 4,
    "num_hidden_layers": 28,
    "vocab_size": 152064,
    "torch_dtype": "bfloat16",
    "tie_word_embeddings": False,
}
SEVEN_B = ["--shards", "tp=2+tp=2", "--from", "0", "--to", "1", "--to-layout", "vllm"]


def _refused_before_any_start(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    """``main(argv)`` fails on its input in one line, before any process starts, in under 5 s."""
    import multiprocessing
    import time

    from shardcore.cli import main

    before = set(multiprocessing.active_children())  # a session's kept test worlds (conftest), if any
    started = time.monotonic()
    code = main(argv)
    elapsed = time.monotonic() - started
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and err.count("\n") == 1 and err.startswith("shardcore: error: "), err
    assert set(multiprocessing.active_children()) <= before  # no process started
    assert elapsed < 5, f"took {elapsed:.1f}s"
    return err


def test_a_refit_check_the_machine_cannot_hold_is_refused_before_any_start(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """A Qwen2-7B-sized model into vLLM on 4 local processes: each rank makes whole every tensor it checks (the
    whole model, 15 GB in bf16), so the 4 need far more than a 24 GiB machine; the kernel killed them after
    40-60 s before this check (issue 43)."""
    from shardcore.cli.check import MIB_PER_PROCESS, _available_mib
    from shardcore.engine.live.refit_check import check_held_bytes
    from shardcore.refit.options import DEFAULT_BUCKET_BYTES
    from shardcore.refit.request import RefitRequest

    path = tmp_path / "config.json"
    path.write_text(json.dumps(QWEN2_7B))
    request = RefitRequest(model=f"hf:{path}", shards="tp=2+tp=2", src=0, dst=(1,), to_layout="vllm")
    plan = request.plan(4)
    held = [check_held_bytes(plan, rank, DEFAULT_BUCKET_BYTES) for rank in range(4)]
    assert all(plan.manifest.nbytes < bytes_ for bytes_ in held)  # the whole model, and its own part on top
    need = sum(held) + 4 * (MIB_PER_PROCESS << 20)
    assert need > 24 << 30
    available = _available_mib()
    if available is None or available << 20 >= need:
        pytest.skip(f"this machine holds {need / 2**30:.0f} GiB: the check would run")
    err = _refused_before_any_start(capsys, ["refit", "--check", "--nproc", "4", *SEVEN_B, "--model", f"hf:{path}"])
    assert f"--nproc 4: 4 processes would hold about {need / 2**30:.1f} GiB" in err, err
    assert "GiB is available here: refit a smaller model or part of it (--tensors), or use fewer processes" in err


def test_delta_with_fp8_through_a_layout_is_refused_before_any_start(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """It failed on every rank, after starting the processes, as "shardcore check failed"."""
    path = tmp_path / "config.json"
    small = {**QWEN2_7B, "hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 2}
    path.write_text(json.dumps({**small, "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 1000}))
    argv = ["refit", "--check", "--nproc", "4", *SEVEN_B, "--model", f"hf:{path}", "--to-dtype", "float8_e4m3fn"]
    err = _refused_before_any_start(capsys, [*argv, "--delta"])
    assert err == (
        "shardcore: error: --delta with fp8 through a layout: the destinations quantize what lands, so they hold "
        "fp8, not the wire's bytes a delta builds on; refit without delta\n"
    )
