"""`shardcore refit`: the summary table, --rank, --json (--transfers), --list-models, one-line errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shardcore.cli import main
from shardcore.cli.check import local_limit
from shardcore.plan.layout import plan_layout
from shardcore.refit import PRESETS, RefitStats, plan_refit, preset
from shardcore.refit.options import OPTION_FLAGS

SPEC = "tp=2,pp=2,dp=2,ep=2,role=train + tp=4,ep=4,expt_tp=1,role=prefill + tp=1,dp=4,ep=2,role=decode"
BASE = ("refit", "--world", "16", "--shards", SPEC, "--from", "0", "--to", "1,2", "--model", "tiny-moe")


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_summary_table(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _run(capsys, *BASE, "--ranks-per-node", "4")
    assert code == 0 and err == ""
    lines = out.splitlines()
    assert lines[0].startswith("refit tiny-moe (78 tensors")
    assert lines[1].split()[:3] == ["to", "role", "spec"] and "busiest receiver" in lines[1]
    assert lines[2].split()[:2] == ["1", "prefill"] and lines[3].split()[:2] == ["2", "decode"]
    assert "busiest sender: rank" in out and "lower bound" in out and "estimate" in out
    stats = RefitStats.of(plan_refit(plan_layout(16, SPEC), 0, [1, 2], preset("tiny-moe"), 4))
    assert f"peers per rank (each a connection): max {stats.most_peers}, median {stats.median_peers}" in out


def test_a_destination_row_names_its_busiest_receiver(capsys: pytest.CaptureFixture[str]) -> None:
    """The 'busiest receiver' of a destination row is a rank of that destination receiving most (the whole refit's
    busiest sender, a source rank, is named on its own line), in the table and in JSON."""
    code, out, _ = _run(capsys, *BASE)
    assert code == 0
    layout = plan_layout(16, SPEC)
    plan = plan_refit(layout, 0, [1, 2], preset("tiny-moe"))
    received: dict[int, int] = {}
    for transfer in plan.transfers():
        if not transfer.is_local:
            received[transfer.dst] = received.get(transfer.dst, 0) + transfer.bytes
    header, *rows = out.splitlines()[1:4]
    column = header.index("busiest receiver")
    for row, shard in zip(rows, (1, 2)):
        ranks = layout.shards[shard].ranks
        rank = int(row[column:].split()[0])
        assert rank in ranks and received[rank] == max(received[r] for r in ranks)
    code, out, _ = _run(capsys, *BASE, "--json")
    for entry in json.loads(out)["shards"]:
        ranks = layout.shards[entry["shard"]].ranks
        assert entry["busiest_receiver"] in ranks and entry["received"] == max(received[r] for r in ranks)


def test_rank_transfers_match_the_plan(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(capsys, *BASE, "--rank", "9")
    assert code == 0
    layout = plan_layout(16, SPEC)
    mine = plan_refit(layout, 0, [1, 2], preset("tiny-moe")).for_rank(9)
    assert f"rank 9: sends 0 (0 B), receives {len(mine.recvs)}" in out
    rows = [line.split() for line in out.splitlines() if line.startswith("recv ")]
    assert [(int(row[1]), row[2]) for row in rows] == [(t.src, t.tensor) for t in mine.recvs]


def test_json_with_transfers(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(capsys, *BASE, "--json", "--transfers", "--rank", "3")
    assert code == 0
    data = json.loads(out)
    plan = plan_refit(plan_layout(16, SPEC), 0, [1, 2], preset("tiny-moe"))
    assert data["transfers"] == [t.to_dict() for t in plan.transfers()]
    assert (
        data["total_bytes"]
        == RefitStats.of(plan).total_bytes
        == sum(t["bytes"] for t in data["transfers"] if t["src"] != t["dst"])
    )
    assert data["tensors"]["output_layer.weight"] == {"shape": [1024, 128], "dtype": "float32", "itemsize": 4}
    assert [s["shard"] for s in data["shards"]] == [1, 2]
    peers: dict[int, set[int]] = {}
    for t in data["transfers"]:
        if t["src"] != t["dst"]:
            peers.setdefault(t["src"], set()).add(t["dst"])
            peers.setdefault(t["dst"], set()).add(t["src"])
    counts = sorted(len(others) for others in peers.values())
    assert data["peers_per_rank"] == {"max": counts[-1], "p50": counts[(len(counts) - 1) // 2]}
    assert len(data["rank"]["sends"]) == len(plan.for_rank(3).sends)


def test_list_models(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(capsys, "refit", "--list-models")
    assert code == 0 and out.split() == list(PRESETS)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (("--to", "1,x"), "--to '1,x': expected shard indices"),
        (("--to", "7"), "destination shard 7"),
        (("--model", "gpt5"), "cannot read manifest 'gpt5'"),
        (("--rank", "99"), "rank 99 is outside the world"),
        (("--shards", "tp=3+tp=4,dp=3"), "over tp=3 of shard 0"),
        (("--intra-gbps", "0"), "--intra-gbps 0.0"),
        (
            ("--min-piece", "1 parsec"),
            "--min-piece='1 parsec': expected a size: whole bytes >= 0 or a number with a unit",
        ),
        (("--min-piece", "-5"), "--min-piece='-5': expected a size"),
        (("--tensors", "*lora*"), "tensor pattern '*lora*' matches no tensor of 'tiny-moe'"),
        (("--tensors", ","), "--tensors is empty"),
    ],
)
def test_bad_input_is_one_line(capsys: pytest.CaptureFixture[str], argv: tuple[str, ...], message: str) -> None:
    args = list(BASE)
    for flag, value in zip(argv[::2], argv[1::2]):
        if flag in args:
            args[args.index(flag) + 1] = value
        else:
            args += [flag, value]
    if "--shards" in argv:
        args[args.index("--to") + 1] = "1"
        args[args.index("--world") + 1] = "15"
    code, out, err = _run(capsys, *args)
    assert code == 2 and out == ""
    assert err.startswith("shardcore: error: ") and message in err and err.count("\n") == 1


def test_fan_out_floor_and_subset_flags(capsys: pytest.CaptureFixture[str]) -> None:
    two_nodes = ("refit", "--world", "8", "--shards", "tp=4,role=train + tp=2 + tp=2", "--from", "0", "--to", "1,2")
    argv = (*two_nodes, "--model", "tiny-dense", "--ranks-per-node", "4", "--fan-out", "--min-piece", "64KiB")
    code, out, _ = _run(capsys, *argv, "--json", "--transfers")
    assert code == 0
    data = json.loads(out)
    plan = plan_refit(
        plan_layout(8, "tp=4,role=train + tp=2 + tp=2"),
        0,
        [1, 2],
        preset("tiny-dense"),
        4,
        fan_out=True,
        min_piece_bytes=64 << 10,
    )
    stats = RefitStats.of(plan)
    assert data["transfers"] == [t.to_dict() for t in plan.transfers()] and any(
        t["hop"] == 1 for t in data["transfers"]
    )
    assert (data["fan_out"], data["min_piece_bytes"], data["refitted_tensors"]) == (True, 64 << 10, len(plan.manifest))
    assert data["inter_node_bytes"] == stats.inter_node_bytes < data["inter_node_bytes_without_fan_out"]
    assert data["relayed_bytes"] == stats.relayed_bytes > 0
    code, out, _ = _run(capsys, *argv)
    assert code == 0 and "fan-out relayed" in out and "inter-node without it" in out
    code, out, _ = _run(capsys, *BASE, "--tensors", "*.experts.*,embedding.*", "--json")
    part = plan_refit(plan_layout(16, SPEC), 0, [1, 2], preset("tiny-moe")).subset(
        lambda t: ".experts." in t.name or t.name.startswith("embedding.")
    )
    assert code == 0 and json.loads(out)["total_bytes"] == RefitStats.of(part).total_bytes
    assert json.loads(out)["refitted_tensors"] == len(part.tensors)  # type: ignore[arg-type]
    code, _, err = _run(capsys, *two_nodes, "--model", "tiny-dense", "--fan-out")
    assert code == 2 and "--fan-out relays tiles inside nodes: give --ranks-per-node K too" in err


def test_missing_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = _run(capsys, "refit", "--world", "4", "--shards", "tp=2+tp=2", "--model", "tiny-dense")
    assert code == 2 and err == "shardcore: error: refit needs --from, --to (or --list-models)\n"


def _one_line_error(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    """Run a refit line that must fail on its input: exit 2, nothing on stdout, one short line on stderr."""
    code, out, err = _run(capsys, *argv)
    assert code == 2 and out == "", (code, err[:500])
    assert err.startswith("shardcore: error: ") and err.count("\n") == 1 and len(err) < 1024, err[:2000]
    return err


@pytest.mark.parametrize(
    ("document", "message"),
    [
        ('{"tensors": [{"name": "w", "shape": [4], "stage": 5}]}', "tensor w: stage=5: expected first"),
        ("tensors:\n  - {name: w, shape: [4], stage: null}\n", "tensor w: stage=None"),
        ("tensors:\n  - {name: w, shape: [8], tp_dim: 0, blocks: 8, stage: all}\n", "tensor w: blocks=8"),
        ("tensors:\n  - {name: w, shape: [8], dtype: [x], stage: all}\n", "tensor w: dtype=['x']"),
        ('{"tensors": [{"name": "w", "shape": [' + "9" * 5000 + '], "stage": "all"}]}', "(5000 digits)"),
        ("- " * 100 + "x\n", "nested more than 64 levels"),
        ("tensors: *nowhere" + "x" * 5000 + "\n", "neither JSON nor YAML"),
        ("tensors:\n  - {name: w, shape: &a [4], stage: [" + ", ".join(["*a"] * 2000) + "]}\n", "stage=[[4], [4], "),
    ],
)
def test_bad_manifest_file_is_one_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, document: str, message: str
) -> None:
    """A bad manifest file: exit 2 with one line naming the file, the tensor and the field (was exit 1, TypeError)."""
    path = tmp_path / "model.yaml"
    path.write_text(document)
    args = list(BASE)
    args[args.index("--model") + 1] = str(path)
    err = _one_line_error(capsys, *args)
    assert f"manifest '{path}'" in err and message in err, err


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [
        ("--to", "9" * 5000, "--to shard=999999999999... (5000 digits): too many digits"),
        ("--to", "-1", "--to shard=-1: expected a whole number from 0"),
        ("--from", "9" * 4000, "--from=999999999999... (4000 digits): expected a whole number from 0"),
        ("--to", "1," + "x" * 5000, "expected shard indices separated by commas"),
        ("--model", "x" * 5000, "(5000 characters): File name too long"),
        ("--order", "x" * 5000, "characters)... xxxx"),
        ("--order", "x" * 5000, "xxxx' (choose from 'tp-cp-dp-pp', 'tp-cp-pp-dp', 'tp-dp-pp', 'tp-pp-dp')"),
        ("--verify", "bogus", "invalid choice: 'bogus' (choose from 'size', 'checksum')"),
    ],
)
def test_huge_flags_give_short_errors(capsys: pytest.CaptureFixture[str], flag: str, value: str, message: str) -> None:
    args = list(BASE)
    if flag in args:
        args[args.index(flag) + 1] = value
    else:
        args += [flag, value]
    try:
        err = _one_line_error(capsys, *args)
    except SystemExit as exit_:  # argparse: usage, then one error line
        assert exit_.code == 2
        err = capsys.readouterr().err.splitlines()[-1]
    assert message in err and len(err) < 1024, err[:2000]


def test_check_refuses_more_processes_than_the_machine_holds(capsys: pytest.CaptureFixture[str]) -> None:
    """As `check` does, before anything starts (here torch is not even needed)."""
    limit, _ = local_limit()
    args = ("refit", "--check", "--nproc", str(limit + 1), "--shards", "tp=2+tp=2", "--from", "0", "--to", "1")
    err = _one_line_error(capsys, *args, "--model", "tiny-dense")
    assert f"--nproc {limit + 1}: at most {limit} local processes here" in err


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (("--transfers",), "--transfers needs --json"),  # was silently ignored
        (("--bucket-bytes", "4096"), "--bucket-bytes needs --check"),
        (("--max-ops", "8", "--verify", "checksum"), "--max-ops, --verify need --check"),
        (("--refit-version", "3"), "--refit-version needs --check"),
        (("--delta",), "--delta needs --check"),
        (("--check", "--anchor-every", "3", "--delta-checksum"), "--anchor-every, --delta-checksum need --delta"),
        (("--check", "--changed", "0.1"), "--changed needs --delta"),
    ],
)
def test_flags_that_act_with_another_are_refused_without_it(
    capsys: pytest.CaptureFixture[str], extra: tuple[str, ...], message: str
) -> None:
    assert _one_line_error(capsys, *BASE, *extra) == f"shardcore: error: {message}\n"


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (("--bucket-bytes", "1"), "--bucket-bytes 1: expected a whole number from 32 to"),  # the executor's minimum
        (("--max-ops", "1"), "--max-ops 1: expected a whole number from 2 to"),
        (("--delta", "--anchor-every", str(2**63)), f"--anchor-every {2**63}: expected a whole number from 1 to"),
        (("--transfers", "--json"), "--transfers lists the plan's transfers, not the live run's"),
    ],
)
def test_check_refuses_what_the_executor_cannot_run_before_any_start(
    capsys: pytest.CaptureFixture[str], extra: tuple[str, ...], message: str
) -> None:
    """Before a process starts: here torch is not even needed."""
    args = ("refit", "--check", "--nproc", "4", "--shards", "tp=2+tp=2", "--from", "0", "--to", "1")
    assert message in _one_line_error(capsys, *args, "--model", "tiny-dense", *extra)


def test_every_executor_option_has_its_flag_in_the_help(capsys: pytest.CaptureFixture[str]) -> None:
    """The flags are made from the options' own table (``OPTION_FLAGS``), with its help."""
    with pytest.raises(SystemExit):
        main(["refit", "--help"])
    shown = " ".join(capsys.readouterr().out.split())
    for option in OPTION_FLAGS.values():
        assert option.flag in shown and " ".join(option.help.split()) in shown


def test_every_executor_flag_parses_as_its_table_row_says(capsys: pytest.CaptureFixture[str]) -> None:
    """The parser reads a flag's kind from its ``OPTION_FLAGS`` row alone (choices, a switch, a whole number from
    ``minimum``), never from its field's name."""
    from shardcore.cli.main import build_parser
    from shardcore.cli.refit import _dest

    parser = build_parser()
    base = ["refit", "--check", "--delta", "--model", "tiny-dense", "--shards", "tp=2+tp=2", "--from", "0", "--to", "1"]
    for field, option in OPTION_FLAGS.items():
        dest = _dest(option)
        if option.choices is not None:
            for choice in option.choices:
                assert getattr(parser.parse_args([*base, option.flag, choice]), dest) == choice
            refused = [*base, option.flag, "none-of-them"]
        elif option.metavar is None:
            assert getattr(parser.parse_args([*base, option.flag]), dest) is True
            continue
        else:
            assert getattr(parser.parse_args([*base, option.flag, str(option.minimum)]), dest) == option.minimum
            refused = [*base, option.flag, str(option.minimum - 1)]
        with pytest.raises(SystemExit):
            parser.parse_args(refused)
        assert f"argument {option.flag}:" in capsys.readouterr().err, field


QWEN2_SMALL = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "vocab_size": 1000,
    "torch_dtype": "bfloat16",
}


@pytest.mark.parametrize(("key", "value"), [("hidden_size", "256"), ("vocab_size", "1000"), ("head_dim", 6.5)])
def test_a_bad_hf_config_field_is_named_by_its_hf_key(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, key: str, value: object
) -> None:
    """The user's key (``hidden_size``), not the internal field it becomes (``hidden``); a string vocab_size
    was a TypeError."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**QWEN2_SMALL, key: value}))
    args = ("refit", "--world", "4", "--shards", "tp=2+tp=2", "--from", "0", "--to", "1", "--model", f"hf:{path}")
    err = _one_line_error(capsys, *args)
    assert f"HF config {key}={value!r}: expected a whole number" in err, err


def test_an_hf_config_without_its_prefix_is_told_to_pass_it_as_hf(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(QWEN2_SMALL))
    args = ("refit", "--world", "4", "--shards", "tp=2+tp=2", "--from", "0", "--to", "1", "--model", str(path))
    err = _one_line_error(capsys, *args)
    assert "this looks like a Hugging Face config.json: pass it as hf:PATH" in err and str(path) in err


@pytest.mark.parametrize("to", ["0", "1,0"])
def test_a_shard_onto_itself_is_refused(capsys: pytest.CaptureFixture[str], to: str) -> None:
    args = ("refit", "--world", "4", "--shards", "tp=2+tp=2", "--from", "0", "--to", to, "--model", "tiny-dense")
    err = _one_line_error(capsys, *args)
    assert "destination shard 0 is the source shard: a refit onto itself moves nothing" in err
