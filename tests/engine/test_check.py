"""`shardcore check` on live worlds: the local launcher and torchrun (without numpy) give the same
table; bad input fails before any process starts; a worker's errors come back once each, without
tracebacks; Ctrl-C ends every process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from dataclasses import replace
from pathlib import Path

import pytest

pytest.importorskip("torch")

from shardcore import plan_layout
from shardcore.cli import main
from shardcore.engine.live.launch import distinct_errors
from shardcore.plan.layout import distinct_groups
from shardcore_dtensor import DTensorBackend

ROOT = Path(__file__).resolve().parents[2]

NO_NUMPY = textwrap.dedent(
    """
    import sys

    class _NoNumpy:
        def find_spec(self, name, path=None, target=None):
            if name == "numpy" or name.startswith("numpy."):
                raise ModuleNotFoundError(f"No module named {name!r}")
            return None

    sys.meta_path.insert(0, _NoNumpy())
    """
)

FAILING_PLUGIN = textwrap.dedent(
    """
    from shardcore import Backend, hookimpl
    from shardcore.errors import LayoutError


    class Failing(Backend):
        name = "failing"
        description = "test backend: every member rank fails to make its handle"

        def make_handle(self, plan, rank, groups, options):
            if plan.index == 0:
                raise LayoutError(f"rank {rank}: shard 0 cannot be served")
            raise RuntimeError("shard 1 has no device")


    @hookimpl
    def shardcore_register_backends(register):
        register(Failing())
    """
)


def _in_check_workers(action: str) -> str:
    """A ``sitecustomize.py`` that runs ``action`` (indented code) in the workers of ``shardcore check`` only."""
    return textwrap.dedent(
        """
        import os

        with open(f"/proc/{os.getppid()}/cmdline", "rb") as parent, open("/proc/self/cmdline", "rb") as me:
            worker = b"shardcore\\0check" in parent.read() and b"spawn_main" in me.read()  # not its resource tracker
        if worker:
        """
    ) + textwrap.indent(textwrap.dedent(action), "    ")


SLOW_STORE_CONNECT = _in_check_workers(  # a store connection that times out, as on a busy machine
    """
    from datetime import timedelta

    import torch.distributed as dist

    try:
        dist.TCPStore("127.0.0.1", 1, is_master=False, timeout=timedelta(seconds=0.5))
    except Exception:
        pass
    """
)
WORKERS_STAY = _in_check_workers(  # workers still busy when Ctrl-C comes, however fast the machine
    """
    import time

    time.sleep(120)
    """
)

CASES = [
    ("tp=2,role=train+tp=1,dp=2,role=decode", 4, []),
    ("tp=2,pp=2", 5, ["--allow-idle", "--strategy", "world", "--order", "tp-cp-pp-dp"]),
]


def write_distribution(
    folder: Path, module: str, source: str, name: str, entry_points: str, version: str = "0.1"
) -> None:
    """An installed one-module distribution in ``folder``, laid out as pip lays one out, to put on PYTHONPATH:
    ``module``.py holding ``source``, and the dist-info of ``name`` ``version`` whose entry_points.txt is
    ``entry_points``."""
    (folder / f"{module}.py").write_text(source)
    info = folder / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    (info / "entry_points.txt").write_text(entry_points)


def _env(extra_path: Path | None = None) -> dict[str, str]:
    paths = [str(p) for p in (extra_path, ROOT) if p is not None]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([*paths, os.environ.get("PYTHONPATH", "")])}
    env.pop("SHARDCORE_BACKEND", None)
    return env


def _expected_verified(spec: str, world: int, flags: list[str]) -> list[int]:
    order = flags[flags.index("--order") + 1] if "--order" in flags else "tp-cp-dp-pp"
    layout = plan_layout(world, spec, order=order, allow_idle="--allow-idle" in flags)
    return [
        sum(len(distinct_groups(plan.groups_of(rank, DTensorBackend.group_names))) for rank in plan.ranks)
        for plan in layout.shards
    ]


def _table_rows(out: str) -> list[list[str]]:
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("shard "))
    return [line.split() for line in lines[start + 1 :] if line and not line.startswith("all groups")]


def _assert_checked(result: subprocess.CompletedProcess[str], spec: str, world: int, flags: list[str]) -> None:
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    assert "backend dtensor (the default)" in result.stdout
    assert result.stdout.rstrip().endswith("all groups match the plan")
    rows = [row for row in _table_rows(result.stdout) if row[0] != "idle"]
    verified = [int(row[-5]) for row in rows]
    assert verified == _expected_verified(spec, world, flags)
    assert all(row[-1] == "ok" for row in rows)
    assert all(float(row[-4]) > 0 for row in rows)  # import s: every rank imported torch


@pytest.mark.parametrize(("spec", "world", "flags"), CASES)
def test_local_mode(spec: str, world: int, flags: list[str]) -> None:
    argv = [sys.executable, "-m", "shardcore", "check", "--nproc", str(world), "--shards", spec, *flags]
    result = subprocess.run(argv, capture_output=True, text=True, env=_env(), timeout=300, cwd=ROOT)
    _assert_checked(result, spec, world, flags)
    progress = [line.split()[:2] for line in result.stderr.splitlines() if line.startswith("  ")]
    assert [stage for stage, count in progress if count == f"{world}/{world}"] == [
        "started",
        "joined",
        "imported",
        "built",
        "verified",
    ]
    if "--strategy" not in flags:
        assert "strategy local: groups are created lazily here" in result.stdout


@pytest.mark.parametrize(("spec", "world", "flags"), CASES)
def test_torchrun_mode_without_numpy(tmp_path: Path, spec: str, world: int, flags: list[str]) -> None:
    (tmp_path / "sitecustomize.py").write_text(NO_NUMPY)
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world)]
    argv += ["-m", "shardcore", "check", "--shards", spec, *flags]
    result = subprocess.run(argv, capture_output=True, text=True, env=_env(tmp_path), timeout=300, cwd=ROOT)
    assert "Failed to initialize NumPy" in result.stderr  # numpy really was hidden from torch
    _assert_checked(result, spec, world, flags)
    assert f"torchrun world of {world} ranks" in result.stdout
    assert f"all {world} ranks verified their groups" in result.stderr


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--backend", "DTensor"], "did you mean 'dtensor'?"),
        (["--backend", "nope"], "no backend named 'nope'; installed: "),
        (["--option", "colour=red"], "unknown option(s) 'colour' for backend 'dtensor'"),
        (["--backend", "hyperparallel", "--order", "tp-cp-pp-dp", "--shards", "pp=2"], "order='tp-cp-pp-dp'"),
        (["--strategy", "local", "--env", "TORCH_DIST_INIT_BARRIER=1"], "strategy='local' cannot work here"),
        (["--env", "TORCH_DIST_INIT_BARRIER=yes"], "TORCH_DIST_INIT_BARRIER='yes'"),
        (["--nproc", "100000"], "--nproc 100000: at most"),
        (["--option", "x" * 5000], "(5000 characters): expected KEY=VALUE"),
        (["--option", "colour=" + "[" * 5000], "unknown option(s) 'colour'"),
        (["--option", "colour=" + "9" * 5000], "unknown option(s) 'colour'"),
        (["--backend", "x" * 5000], "(5000 characters); installed: "),
        (["--env", "TORCH_DIST_INIT_BARRIER=" + "y" * 5000], "TORCH_DIST_INIT_BARRIER='yyyyyy"),
    ],
)
def test_bad_input_fails_before_any_process_starts(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, argv: list[str], message: str
) -> None:
    import multiprocessing

    monkeypatch.delenv("SHARDCORE_BACKEND", raising=False)
    if "--env" in argv:
        key, _, value = argv[argv.index("--env") + 1].partition("=")
        monkeypatch.setenv(key, value)
        argv = argv[: argv.index("--env")]
    shards = [] if "--shards" in argv else ["--shards", "tp=2"]
    nproc = [] if "--nproc" in argv else ["--nproc", "2"]
    before = set(multiprocessing.active_children())  # a session's kept test worlds (conftest), if any
    code = main(["check", *nproc, *shards, *argv])
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("shardcore: error: ") and message in err
    assert len(err) < 1024
    assert set(multiprocessing.active_children()) <= before  # no process started


def test_a_worker_failure_shows_each_distinct_error_once(tmp_path: Path) -> None:
    entry_points = "[shardcore.backends]\nfailing = failing_backend\n"
    write_distribution(tmp_path, "failing_backend", FAILING_PLUGIN, "failing-backend", entry_points)
    argv = [sys.executable, "-m", "shardcore", "check", "--nproc", "4", "--shards", "tp=2+tp=2"]
    argv += ["--backend", "failing", "--timeout", "30"]
    started = time.monotonic()
    result = subprocess.run(argv, capture_output=True, text=True, env=_env(tmp_path), timeout=300, cwd=ROOT)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    errors = result.stderr[result.stderr.index("shardcore: error:") :].splitlines()
    assert errors == [
        "shardcore: error: shardcore check failed:",
        "ranks [0, 1] (2 ranks): shard 0 cannot be served",
        "ranks [2, 3] (2 ranks): RuntimeError: shard 1 has no device",
    ]
    assert time.monotonic() - started < 120


def test_a_plugin_that_fails_to_import_is_one_line_before_any_start(tmp_path: Path) -> None:
    source = "raise ImportError('needs libfoo.so')\n"
    entry_points = "[shardcore.backends]\nbroken = broken_backend\n"
    write_distribution(tmp_path, "broken_backend", source, "broken-backend", entry_points)
    argv = [sys.executable, "-m", "shardcore", "check", "--nproc", "2", "--shards", "tp=2", "--backend", "broken"]
    result = subprocess.run(argv, capture_output=True, text=True, env=_env(tmp_path), timeout=120, cwd=ROOT)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr == "shardcore: error: backend 'broken' failed to import: needs libfoo.so\n"


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as status:
            return not any(line.startswith("State:") and "Z" in line.split()[1] for line in status)
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads process children from /proc")
def test_ctrl_c_ends_quietly_with_no_stray_process(tmp_path: Path) -> None:
    (tmp_path / "sitecustomize.py").write_text(WORKERS_STAY)
    argv = [sys.executable, "-m", "shardcore", "check", "--nproc", "3", "--shards", "tp=3", "--timeout", "60"]
    env = _env(tmp_path)
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    children: list[int] = []
    deadline = time.monotonic() + 120
    while len(children) < 4 and time.monotonic() < deadline and process.poll() is None:  # 3 workers, 1 tracker
        time.sleep(0.05)
        with open(f"/proc/{process.pid}/task/{process.pid}/children", encoding="ascii") as file:
            children = [int(pid) for pid in file.read().split()]
    assert len(children) >= 4, "the workers never started"
    workers = [pid for pid in children if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()]
    assert len(workers) == 3 and all(_blocks_sigint(pid) for pid in workers)  # Ctrl-C reaches the parent only
    process.send_signal(signal.SIGINT)
    _, err = process.communicate(timeout=60)
    assert process.returncode == 130, err
    assert err.rstrip().endswith("shardcore: interrupted") and "Traceback" not in err
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in children) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert [pid for pid in children if _alive(pid)] == []


def _blocks_sigint(pid: int) -> bool:
    """Whether process ``pid`` blocks SIGINT (its ``SigBlk`` mask in /proc)."""
    status = Path(f"/proc/{pid}/status").read_text(encoding="ascii")
    mask = next(int(line.split()[1], 16) for line in status.splitlines() if line.startswith("SigBlk:"))
    return bool(mask >> (signal.SIGINT - 1) & 1)


def test_distinct_errors_group_ranks_and_ignore_the_rank_prefix() -> None:
    errors = {0: "rank 0: boom", 1: "rank 1: boom", 2: "other", 5: "rank 5: boom"}
    assert distinct_errors(errors) == ["ranks [0, 1, 5] (3 ranks): boom", "rank 2: other"]


def test_the_header_names_the_backend_actually_used(monkeypatch: pytest.MonkeyPatch) -> None:
    from shardcore.cli.check import _header
    from shardcore.engine.live.check import CheckOptions, prepare

    monkeypatch.setenv("SHARDCORE_BACKEND", "toy")
    options = CheckOptions(shards="tp=2")
    prepared = prepare(options, 2)
    assert (prepared.backend, prepared.backend_source) == ("toy", "$SHARDCORE_BACKEND")
    assert prepared.options == replace(options, backend="toy")  # what the workers run: resolved once, here
    assert "backend toy (from $SHARDCORE_BACKEND)" in _header(prepared, options, "1 local gloo process")
    assert prepare(CheckOptions(shards="tp=2", backend="dtensor"), 2).backend_source == "--backend"


def test_a_store_connection_that_times_out_prints_no_cpp_stack(tmp_path: Path) -> None:
    (tmp_path / "sitecustomize.py").write_text(SLOW_STORE_CONNECT)
    argv = [sys.executable, "-m", "shardcore", "check", "--nproc", "2", "--shards", "tp=2", "--timeout", "30"]
    result = subprocess.run(argv, capture_output=True, text=True, env=_env(tmp_path), timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    assert "frame #" not in result.stderr and "socket.cpp" not in result.stderr, result.stderr
    verbose = subprocess.run([*argv, "-v"], capture_output=True, text=True, env=_env(tmp_path), timeout=300, cwd=ROOT)
    assert "socket.cpp" in verbose.stderr  # the connections really timed out; -v shows torch's own lines


SLOW_SPEAKER = """
import os, time

if os.environ.get("LOCAL_RANK") == "0" and "TORCHELASTIC_RUN_ID" in os.environ:
    time.sleep(5)  # the speaker starts last, as one rank of a loaded machine does
"""


def test_under_torchrun_a_bad_spec_is_one_line_not_one_per_rank(tmp_path: Path) -> None:
    (tmp_path / "sitecustomize.py").write_text(SLOW_SPEAKER)
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3"]
    argv += ["-m", "shardcore", "check", "--shards", "tp=2,pp=2"]
    result = subprocess.run(argv, capture_output=True, text=True, env=_env(tmp_path), timeout=300, cwd=ROOT)
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if "shardcore: error:" in line]
    assert len(errors) == 1 and "tp=2,pp=2" in errors[0] and "the world has 3" in errors[0], result.stderr
    assert not errors[0].startswith("shardcore: error: rank ")  # the speaker's line, not a quiet rank's after its grace


def test_under_torchrun_a_quiet_rank_prints_its_own_error_after_the_grace(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from shardcore.cli import check as cli_check

    monkeypatch.setattr(cli_check, "SPEAKER_GRACE_S", 0.2)
    for name, value in {"RANK": "2", "LOCAL_RANK": "2", "WORLD_SIZE": "3"}.items():
        monkeypatch.setenv(name, value)
    started = time.monotonic()
    cli_check.report_error("only this rank failed")
    assert time.monotonic() - started >= 0.2
    assert capsys.readouterr().err == "shardcore: error: rank 2: only this rank failed\n"


def test_a_rank_killed_by_a_signal_is_named_with_what_it_held() -> None:
    """A real worker killed by SIGKILL (as the kernel's out-of-memory killer kills) is named so, with the memory
    it was last seen to hold; it was "rank 1 died (exit code -9)". The memory samples reach ``on_held``."""
    from shardcore.engine.live.launch import run_local_job
    from shardcore.errors import GroupCreationError
    from tests.engine import fault_workers

    samples: list[dict[int, int]] = []
    with pytest.raises(GroupCreationError) as raised:
        run_local_job(2, fault_workers.held_then_killed, 1, 60.0, on_held=lambda held, _: samples.append(held))
    message = str(raised.value)
    assert message.startswith(
        "shardcore check failed:\nrank 1: rank 1 killed by SIGKILL: likely out of memory; it held ~"
    )
    held = message.rsplit("~", 1)[1]
    number, unit = held.split()
    assert unit in ("MB", "GB") and float(number) * (1e3 if unit == "GB" else 1) >= fault_workers.BALLAST / 1e6
    assert any(sample.get(1, 0) >= fault_workers.BALLAST for sample in samples)


def test_check_json_is_the_result_alone_on_stdout() -> None:
    argv = [sys.executable, "-m", "shardcore", "check", "--nproc", "3", "--shards", "tp=2", "--allow-idle", "--json"]
    result = subprocess.run(argv, capture_output=True, text=True, env=_env(), timeout=300, cwd=ROOT)
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr
    document = json.loads(result.stdout)
    assert (document["world"], document["backend"], document["order"], document["ok"]) == (
        3,
        "dtensor",
        "tp-cp-dp-pp",
        True,
    )
    assert document["strategy"].startswith("local")
    shard, idle = document["shards"]
    assert (shard["shard"], shard["spec"], shard["ranks"], shard["failures"], shard["ok"]) == (
        0,
        "tp=2",
        [0, 2],
        [],
        True,
    )
    assert shard["groups_verified"] == _expected_verified("tp=2", 3, ["--allow-idle"])[0]
    assert shard["import_seconds"] > 0
    assert (idle["shard"], idle["ranks"], idle["ok"]) == (None, [2, 3], True)
