"""`shardcore plan`: the table, --rank, --json, and one clear line with exit 2 for a bad spec."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from shardcore import plan_layout
from shardcore.cli import main

ROOT = Path(__file__).resolve().parents[2]
SPEC = "tp=4,pp=2,role=train,name=policy+tp=2,ep=2,dp=2,role=prefill+tp=1,dp=4,role=decode"


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_plan_table(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _run(capsys, "plan", "--world", "16", "--shards", SPEC)
    assert code == 0 and err == ""
    lines = out.strip().splitlines()
    header = lines[0].split()
    for column in ("shard", "role", "name", "tp", "cp", "pp", "dp", "ep", "expt_tp", "expt_dp"):
        assert column in header
    rows = [line for line in lines[1:] if line.strip()]
    assert len(rows) == 3
    assert "train" in rows[0] and "policy" in rows[0] and "[0, 8)" in rows[0]
    assert "prefill" in rows[1] and "[8, 12)" in rows[1]
    assert "decode" in rows[2] and "[12, 16)" in rows[2]


def test_plan_table_lists_idle_ranks(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(capsys, "plan", "--world", "12", "--shards", "tp=4", "--rank-offset", "2", "--allow-idle")
    assert code == 0
    assert "[2, 6)" in out and "[0, 2)" in out and "[6, 12)" in out


def test_plan_rank(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(capsys, "plan", "--world", "16", "--shards", SPEC, "--rank", "9")
    assert code == 0
    groups = plan_layout(16, SPEC).groups_of(9)
    lines = {line.split()[0]: line for line in out.splitlines() if line.split()}
    assert str(list(groups["tp"])) in lines["tp"]  # type: ignore[arg-type]
    assert str(list(groups["tp_ep"])) in lines["tp_ep"]  # type: ignore[arg-type]
    assert "rank 9" in out and "shard 1" in out


def test_plan_idle_rank(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(capsys, "plan", "--world", "6", "--shards", "tp=4", "--allow-idle", "--rank", "5")
    assert code == 0 and "rank 5 is idle" in out


def test_plan_json(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(capsys, "plan", "--world", "16", "--shards", SPEC, "--json", "--order", "tp-pp-dp")
    assert code == 0
    data = json.loads(out)
    assert data == plan_layout(16, SPEC, order="tp-pp-dp").to_dict()
    assert [shard["ranks"] for shard in data["shards"]] == [[0, 8], [8, 12], [12, 16]]


def test_plan_json_rank(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(capsys, "plan", "--world", "16", "--shards", SPEC, "--json", "--rank", "3")
    assert code == 0
    rank = json.loads(out)["rank"]
    assert rank["shard"] == 0
    assert rank["groups"]["tp"] == [0, 1, 2, 3] and rank["groups"]["pp"] == [3, 7]
    assert rank["groups"]["pos_embd"] == [3] and rank["groups"]["embd"] == [3, 7]


@pytest.mark.parametrize(
    ("argv", "token"),
    [
        (["--world", "4", "--shards", "tp=abc"], "'abc'"),
        (["--world", "4", "--shards", "tp=2,ep=4"], "ep"),
        (["--world", "4", "--shards", "tp=8"], "world has 4"),
        (["--world", "8", "--shards", "tp=4"], "allow-idle"),
        (["--world", "4", "--shards", "[tp: 4"], "neither JSON nor YAML"),
    ],
)
def test_plan_bad_input_is_one_line_and_exit_2(capsys: pytest.CaptureFixture[str], argv: list[str], token: str) -> None:
    code, out, err = _run(capsys, "plan", *argv)
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and token in err


def test_python_dash_m(tmp_path: Path) -> None:
    spec = tmp_path / "shards.yaml"
    spec.write_text("- {tp: 2, role: prefill}\n- {tp: 1, dp: 2, role: decode}\n", encoding="utf-8")
    done = subprocess.run(
        [sys.executable, "-m", "shardcore", "plan", "--world", "4", "--shards", f"@{spec}", "--json"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert [shard["spec"]["role"] for shard in json.loads(done.stdout)["shards"]] == ["prefill", "decode"]
    bad = subprocess.run(
        [sys.executable, "-m", "shardcore", "plan", "--world", "4", "--shards", "role=x"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 2 and bad.stdout == ""
    assert len(bad.stderr.strip().splitlines()) == 1 and "'x'" in bad.stderr


def test_plan_rank_outside_the_world(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = _run(capsys, "plan", "--world", "4", "--shards", "tp=4", "--rank", "9")
    assert code == 2 and len(err.strip().splitlines()) == 1 and "rank 9" in err


def test_rank_outside_the_world_prints_only_the_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--world", "8", "--shards", "tp=8", "--rank", "9"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "rank 9 is outside the world [0, 8)" in err


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    from shardcore import __version__

    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0 and capsys.readouterr().out == f"shardcore {__version__}\n"


def _help(capsys: pytest.CaptureFixture[str], command: str) -> str:
    with pytest.raises(SystemExit):
        main([command, "--help"])
    return " ".join(capsys.readouterr().out.split())  # argparse wraps lines


def test_help_explains_order_and_strategy_and_shows_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    text = _help(capsys, "check")
    assert "keeps each pipeline stage's ranks contiguous" in text and "(default: tp-cp-dp-pp)" in text
    assert "members only" in text and "Megatron's pattern" in text and "(default: auto)" in text
    assert "(default: 8)" in text and "(default: 120.0)" in text
    assert "-v, --verbose" in text and "-q, --quiet" in text
    assert "(default: 0)" in _help(capsys, "plan")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["plan", "--world", "8", "--shards", "tp=8", "--ranks-per-node", "0"], "argument --ranks-per-node: 0 is"),
        (["plan", "--world", "0", "--shards", "tp=8"], "argument --world: 0 is not a positive integer"),
        (["plan", "--world", "8", "--shards", "tp=8", "--rank-offset", "-1"], "argument --rank-offset: -1 is"),
        (["check", "--shards", "tp=2", "--timeout", "0"], "argument --timeout: 0 is not a positive number"),
        (["check", "--shards", "tp=2", "--nproc", "x"], "argument --nproc: x is not a positive integer"),
    ],
)
def test_errors_name_the_flag(capsys: pytest.CaptureFixture[str], argv: list[str], message: str) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_check_without_torch_says_how_to_install_it(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "torch", None)  # find_spec("torch") is None, as without torch
    code, out, err = _run(capsys, "check", "--nproc", "2", "--shards", "tp=2")
    assert code == 2 and out == ""
    assert err.count("\n") == 1
    assert "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu" in err


def test_a_huge_nproc_is_refused_with_the_limit() -> None:
    from shardcore.cli.check import CheckError, check_machine, local_limit

    limit, why = local_limit()
    with pytest.raises(CheckError, match=rf"--nproc 100000: at most {limit} local processes here \(") as raised:
        check_machine(100000)
    assert f"({why})" in str(raised.value)  # the limit's reason, said


def test_more_processes_than_the_memory_holds_are_refused() -> None:
    from shardcore.cli.check import MIB_PER_PROCESS, CheckError, _available_mib, check_machine, local_limit

    available = _available_mib()
    if available is None:
        pytest.skip("no /proc/meminfo here")
    too_many = available // MIB_PER_PROCESS + 1
    if too_many > local_limit()[0]:
        pytest.skip("this machine's process limit is below what its memory holds")
    with pytest.raises(CheckError, match=rf"--nproc {too_many}: {too_many} processes need about .* GiB is available"):
        check_machine(too_many)


def test_what_the_ranks_hold_beyond_the_available_memory_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """check_load, run once the plan says what each rank holds: the total, the rank holding the most, the way out."""
    from shardcore.cli import check
    from shardcore.cli.check import GIB, CheckError, Load, check_load

    monkeypatch.setattr(check, "_available_mib", lambda: 4096)
    load = Load([GIB, 3 * GIB], "the test's tensors", "hold less", "--world")
    with pytest.raises(CheckError) as raised:
        check_load(2, load)
    assert str(raised.value) == (
        "--world 2: 2 processes would hold about 4.5 GiB (the test's tensors; rank 1 the most, 3.0 GiB, plus about "
        "250 MiB each) but 4.0 GiB is available here: hold less"
    )
    check_load(1, Load([3 * GIB], "the test's tensors", "hold less"))  # 3.2 GiB: it fits
    check_load(2, Load([], "nothing", "hold less"))
    monkeypatch.setattr(check, "_available_mib", lambda: None)  # no /proc/meminfo: nothing to check against
    check_load(2, load)


def test_many_processes_per_core_warn() -> None:
    import os

    from shardcore.cli.check import OVERSUBSCRIBED, check_machine, local_limit

    cores = os.cpu_count() or 1
    many = OVERSUBSCRIBED * cores + 1
    if many > local_limit()[0]:
        pytest.skip("this machine's limit is below the warning threshold")
    assert any(f"{many} processes on {cores} core" in warning for warning in check_machine(many))
    assert not any("core" in warning for warning in check_machine(1))


def test_rank_coordinates_are_listed_outermost_first(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(capsys, "plan", "--world", "16", "--shards", "tp=2,pp=2,ep=2,dp=4", "--rank", "13")
    assert code == 0
    line = next(line for line in out.splitlines() if "coords" in line)
    assert line.endswith("coords pp=1, dp=2, cp=0, tp=1, expt_dp=1, ep=0, expt_tp=1")
    code, out, _ = _run(
        capsys,
        "plan",
        "--world",
        "16",
        "--shards",
        "tp=2,pp=2,dp=4,ep=2,expt_tp=1",
        "--rank",
        "13",
        "--order",
        "tp-pp-dp",
    )
    line = next(line for line in out.splitlines() if "coords" in line)
    assert line.endswith("coords dp=3, pp=0, cp=0, tp=1, expt_dp=3, ep=1, expt_tp=0")  # dp outermost here


def test_output_into_a_closed_pipe_is_no_traceback() -> None:
    reader = subprocess.Popen(["head", "-c", "1"], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL)
    writer = subprocess.run(
        [sys.executable, "-m", "shardcore", "plan", "--world", "3000", "--shards", "+".join(["tp=1"] * 3000)],
        cwd=ROOT,
        stdout=reader.stdin,
        stderr=subprocess.PIPE,
        text=True,
        timeout=120,
    )
    reader.stdin.close()  # type: ignore[union-attr]
    reader.wait(timeout=30)
    assert writer.returncode == 141  # as a shell reports a pipe writer ended by SIGPIPE
    assert "Traceback" not in writer.stderr and "BrokenPipe" not in writer.stderr


def test_counts_are_singular_for_one() -> None:
    from shardcore.plan.arguments import counted

    assert [counted(1, "rank"), counted(2, "rank")] == ["1 rank", "2 ranks"]
    assert [counted(1, "process", "processes"), counted(3, "process", "processes")] == ["1 process", "3 processes"]


@pytest.mark.parametrize(
    ("shards", "hint"),
    [
        ("tp:2,pp:2", "bad entry 'tp:2': write key=value, e.g. 'tp=2,pp=2' (':' is for JSON or YAML)"),
        ("tp: 2, pp: 2+tp:4", "e.g. 'tp=2,pp=2+tp=4'"),
        ("spec.json", "'spec.json' looks like a file: give a spec file as @spec.json"),
        ("tp:2,pp=2", "bad entry 'tp:2': expected key=value, e.g. tp=2 (write tp=2)"),
    ],
)
def test_a_mistyped_spec_gets_the_fix_it_needs(capsys: pytest.CaptureFixture[str], shards: str, hint: str) -> None:
    code, out, err = _run(capsys, "plan", "--world", "8", "--allow-idle", "--shards", shards)
    assert code == 2 and out == ""
    assert hint in err and "PyYAML" not in err and "JSON nor YAML" not in err, err


def test_a_spec_file_named_without_its_at_sign(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    spec = tmp_path / "layout"
    spec.write_text("tp=2\n")
    code, _, err = _run(capsys, "plan", "--world", "2", "--shards", str(spec))
    assert code == 2 and f"give a spec file as @{spec}" in err
    assert _run(capsys, "plan", "--world", "2", "--shards", f"@{spec}")[0] == 0


def test_yaml_documents_with_colons_still_parse(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("yaml")
    for shards in ("tp: 2", "name: a.json", '{"tp": 2}'):
        assert _run(capsys, "plan", "--world", "2", "--allow-idle", "--shards", shards)[0] == 0, shards


def test_a_near_miss_model_is_told_the_preset(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ("refit", "--world", "8", "--shards", "tp=4,role=train+tp=4", "--from", "0", "--to", "1")
    code, _, err = _run(capsys, *argv, "--model", "tiny-mo")
    assert code == 2 and "did you mean 'tiny-moe'?" in err


def test_every_error_has_one_prefix(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["plan", "--world", "x", "--shards", "tp=2"])
    usage_error = capsys.readouterr().err.splitlines()[-1]
    code, _, spec_error = _run(capsys, "plan", "--world", "8", "--shards", "tp=3")
    assert code == 2
    assert usage_error.startswith("shardcore: error: argument --world: x is not")
    assert spec_error.startswith("shardcore: error: ")


def _usage_error(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    """argparse's usage error: exit 2, and the last line of stderr (after the usage), one line."""
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err.splitlines()[-1]


@pytest.mark.parametrize(
    ("argv", "unknown", "meant"),
    [
        (["plan", "--world", "8", "--shard", "tp=8"], "--shard", "--shards"),  # was taken as --shards
        (["plan", "--wor", "8", "--shards", "tp=8"], "--wor", "--world"),
        (["check", "--shards", "tp=2", "--nproc", "2", "--time", "3"], "--time", "--timeout"),
        (
            ["refit", "--world", "4", "--shards", "tp=2+tp=2", "--from", "0", "--to", "1", "--mod", "tiny-dense"],
            "--mod",
            "--model",
        ),
        (
            ["replan", "--world", "8", "--shards", "tp=8", "--lost", "3", "--model", "tiny-dense", "--memory", "8"],
            "--memory",
            "--memory-gb",
        ),
    ],
)
def test_abbreviated_flags_are_refused_on_every_subcommand(
    capsys: pytest.CaptureFixture[str], argv: list[str], unknown: str, meant: str
) -> None:
    """argparse's allow_abbrev is off everywhere: a prefix is no flag, so a flag added later never changes
    what an old command line means."""
    assert _usage_error(capsys, argv) == f"shardcore: error: unrecognized option '{unknown}'; did you mean '{meant}'?"


@pytest.mark.parametrize(
    ("argv", "unknown", "meant"),
    [
        (["check", "--nprocs", "4", "--shards", "tp=4"], "--nprocs", "--nproc"),
        (["plan", "--wrold", "8", "--shards", "tp=8"], "--wrold", "--world"),  # before "--world is required"
        (["plan", "--world", "8", "--shards=tp=8", "--jsn=1"], "--jsn", "--json"),
        (["backends", "--jason"], "--jason", "--json"),
        (["--versoin"], "--versoin", "--version"),
        (["plan", "--world", "8", "--shards", "tp=8", "--zzzzzz"], "--zzzzzz", None),
    ],
)
def test_an_unknown_flag_is_named_with_the_closest_one(
    capsys: pytest.CaptureFixture[str], argv: list[str], unknown: str, meant: str | None
) -> None:
    hint = "" if meant is None else f"; did you mean '{meant}'?"
    assert _usage_error(capsys, argv) == f"shardcore: error: unrecognized option '{unknown}'{hint}"


def test_a_value_that_looks_like_a_flag_after_a_double_dash_is_left_to_argparse(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert "unrecognized arguments: -- --x" in _usage_error(
        capsys, ["plan", "--world", "8", "--shards", "tp=8", "--", "--x"]
    )


@pytest.mark.parametrize(
    ("shards", "warning"),
    [
        ("tp=4,,pp=2", "shard 0 ('tp=4,,pp=2'): an empty item is skipped, as in Megatron; remove the comma"),
        ("tp=\uff14,pp=2", r"tp='\uff14' (non-ASCII U+FF14) is read as tp=4: write the digits in ASCII"),
    ],
)
def test_megatron_valid_but_careless_specs_warn_in_one_line(
    capsys: pytest.CaptureFixture[str], shards: str, warning: str
) -> None:
    code, out, err = _run(capsys, "plan", "--world", "8", "--shards", shards)
    assert code == 0 and err == f"shardcore: warning: {warning}\n"
    assert out.splitlines()[1].split()[5:8] == ["4", "1", "2"]  # tp, cp, pp


def test_a_look_alike_role_is_one_line_showing_the_character(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _run(capsys, "plan", "--world", "8", "--shards", "tp=4,pp=2,role=tr\u0430in")
    assert code == 2 and out == "" and err.count("\n") == 1
    assert r"role='tr\u0430in' (non-ASCII U+0430): expected one of train, prefill, decode" in err


def test_progress_says_what_the_running_ranks_hold_when_quiet_for_a_while() -> None:
    import io

    from shardcore.cli.check import HELD_EVERY, Progress

    out = io.StringIO()
    progress = Progress(4, verbose=False, quiet=False, out=out)
    progress.held({0: 1 << 30, 3: 3 << 30}, 12.5)
    assert out.getvalue() == ""  # a progress line was just printed (at the start): nothing yet
    progress.printed -= HELD_EVERY
    progress.held({0: 1 << 30, 3: 3 << 30}, 12.5)
    assert out.getvalue() == "  running  2 ranks hold 4.29 GB, the most rank 3 (3.22 GB) (12.5s)\n"
    Progress(4, verbose=False, quiet=True, out=out).held({0: 1}, 1.0)  # -q: nothing
    assert out.getvalue().count("\n") == 1
