"""Layout search: the footprint against holdings, the estimate against the planner, the ranking, bad input."""

from __future__ import annotations

import json
import re
import time
from math import prod

import pytest

from shardcore import LayoutError, ManifestError, NoLayoutError, plan_layout
from shardcore.cli import main
from shardcore.errors import RefitError
from shardcore.plan import ShardSpec, valid_specs
from shardcore.refit import (
    Footprint,
    RefitStats,
    estimate_refit,
    local_shape,
    manifest_from_hf_config,
    plan_refit,
    preset,
    search,
)
from shardcore.refit.placement import check_fits

TRAIN = "tp=2,pp=2,dp=2,ep=2,role=train"


@pytest.mark.parametrize("model", ["tiny-moe", "tiny-dense"])
def test_footprint_is_what_the_busiest_rank_holds(model: str) -> None:
    manifest = preset(model)
    footprint = Footprint(manifest)
    checked = 0
    for ranks in (1, 4, 6, 8, 16):
        for spec in valid_specs(ranks):
            plan = plan_layout(ranks, spec).shards[0]
            try:
                check_fits(manifest, plan)
                fits = True
            except ManifestError:
                fits = False
            assert (footprint.fits(spec) is None) == fits, spec
            if not fits:
                continue
            held = [
                sum(prod(local_shape(t, plan, rank, manifest) or (0,)) * t.itemsize for t in manifest)
                for rank in plan.ranks
            ]
            assert footprint.weight_bytes(spec) == max(held), spec
            checked += 1
    assert checked > 100


def test_fit_errors_name_a_tensor_or_the_layers() -> None:
    footprint = Footprint(preset("tiny-moe"))
    assert "does not split into 3 equal parts" in str(footprint.fits(ShardSpec(tp=3)))
    assert "4 layers over pp=3" in str(footprint.fits(ShardSpec(pp=3)))
    assert "experts do not divide by ep=3" in str(footprint.fits(ShardSpec(dp=3, ep=3, expt_tp=1)))


@pytest.mark.parametrize(
    "destination", ["tp=1,dp=8,ep=8,expt_tp=1", "tp=4,pp=2", "tp=2,cp=2,dp=2,ep=4,expt_tp=1", "tp=8,ep=2,expt_tp=4"]
)
def test_estimate_receives_and_moves_exactly_what_the_plan_does(destination: str) -> None:
    manifest = preset("tiny-moe")
    layout = plan_layout(16, f"{TRAIN}+{destination}")
    stats = RefitStats.of(plan_refit(layout, 0, [1], manifest, 4))
    estimate = estimate_refit(layout.shards[0], layout.shards[1], Footprint(manifest), ranks_per_node=4)
    assert estimate.total_bytes == estimate.inter_node_bytes == stats.total_bytes == stats.inter_node_bytes
    assert estimate.received == max(stats.received.values()) == stats.received[estimate.busiest_receiver]
    assert not estimate.shared_node


@pytest.mark.parametrize(
    ("source", "destination"),
    [("tp=4,pp=2,dp=2", "tp=2,pp=2,dp=4"), ("tp=8,dp=2", "tp=4,pp=2,dp=2"), ("tp=2,pp=4,dp=2", "tp=8,dp=2")],
)
def test_estimated_sends_are_the_planners_within_half_a_percent(source: str, destination: str) -> None:
    """Pieces of a real model are split over every replica: the busiest sender is the even share (a tiny
    model's tensors are under the 1 MiB piece floor, sent whole, so its senders are uneven)."""
    manifest = preset("llama3-8b")
    layout = plan_layout(32, f"{source}+{destination}")
    stats = RefitStats.of(plan_refit(layout, 0, [1], manifest, 8))
    estimate = estimate_refit(layout.shards[0], layout.shards[1], Footprint(manifest), ranks_per_node=8)
    assert estimate.sent <= stats.busiest_sent <= estimate.sent * 1.005
    assert estimate.seconds == pytest.approx(stats.estimate_seconds(), rel=0.005)


def test_a_shared_node_is_flagged_and_overlap_refused() -> None:
    layout = plan_layout(12, "tp=2,dp=2+tp=4,dp=2")  # the second shard starts mid-node with 8 per node
    footprint = Footprint(preset("tiny-dense"))
    assert estimate_refit(layout.shards[0], layout.shards[1], footprint, ranks_per_node=8).shared_node
    assert not estimate_refit(layout.shards[0], layout.shards[1], footprint, ranks_per_node=4).shared_node
    with pytest.raises(RefitError, match="overlaps the source"):
        estimate_refit(layout.shards[0], layout.shards[0], footprint)


def _moe_search(**options: object) -> object:
    layout = plan_layout(24, TRAIN, allow_idle=True)
    return search(layout, 0, preset("tiny-moe"), 16, 5e6, ranks_per_node=4, **options)  # type: ignore[arg-type]


def test_ranked_by_seconds_with_the_pareto_front_marked() -> None:
    result = _moe_search(objective="refit-time")
    candidates = result.candidates
    assert result.enumerated > result.split >= result.fit_memory == len(candidates) > 0
    assert result.estimated < len(candidates)  # specs differing only in cp x dp share one estimate
    assert [(c.seconds, c.weight_bytes) for c in candidates] == sorted((c.seconds, c.weight_bytes) for c in candidates)
    assert all(c.weight_bytes <= 5e6 for c in candidates)
    for c in candidates:  # the front: nothing else at most as large and as slow, better in one
        dominated = any(
            o.weight_bytes <= c.weight_bytes
            and o.seconds <= c.seconds
            and (o.weight_bytes, o.seconds) != (c.weight_bytes, c.seconds)
            for o in candidates
        )
        assert c.pareto == (not dominated), c.spec
    assert result.front and all(c.pareto for c in result.front)
    assert all(c.destination.rank_offset == 8 and c.destination.size == 16 for c in candidates)


QWEN2_7B = {
    "model_type": "qwen2", "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
    "num_attention_heads": 28, "num_key_value_heads": 4, "vocab_size": 152064, "torch_dtype": "bfloat16",
}  # fmt: skip


def _qwen2_7b(**options: object) -> object:
    layout = plan_layout(24, "tp=4,dp=2,role=train", allow_idle=True)
    manifest = manifest_from_hf_config(QWEN2_7B).manifest
    return search(layout, 0, manifest, 16, 80e9, ranks_per_node=8, **options)  # type: ignore[arg-type]


def test_ranked_by_replicas_then_headroom_then_refit_time_by_default() -> None:
    """A serving engineer's order: Qwen2-7B on 16 ranks of 80 GB is best served by 16 replicas (tp=1,dp=16), not
    by the fastest refit (one replica); equal replicas go by memory headroom, then by refit time. Each objective
    is what the result says it used."""
    result = _qwen2_7b()
    assert result.objective == "replicas" and result.best.replicas == 16 and str(result.best.spec) == "tp=1,dp=16"
    keys = [(-c.replicas, c.weight_bytes, c.seconds) for c in result.candidates]
    assert keys == sorted(keys)
    fastest = _qwen2_7b(objective="refit-time")
    assert fastest.objective == "refit-time" and fastest.best.replicas == 1  # what search ranked first before
    assert fastest.best.seconds == min(c.seconds for c in result.candidates) < result.best.seconds
    roomy = _qwen2_7b(objective="memory")
    assert roomy.best.weight_bytes == min(c.weight_bytes for c in result.candidates)
    assert [(c.weight_bytes, c.seconds) for c in roomy.candidates] == sorted(
        (c.weight_bytes, c.seconds) for c in roomy.candidates
    )


def test_cli_says_which_objective_ranked_the_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*SEARCH, "--memory-gb", "0.005", "--top", "3"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[2].startswith("ranked by replicas: most replicas (the spec's dp) first, then the most memory headroom")
    header = out[3].split()
    assert header[:5] == ["#", "spec", "replicas", "weight/rank", "headroom"] and "slowest" in header
    replicas = [int(line.split()[2]) for line in out[4:7]]
    assert replicas == sorted(replicas, reverse=True) and replicas[0] == max(
        c.replicas for c in _moe_search().candidates
    )  # type: ignore[attr-defined]
    assert main([*SEARCH, "--memory-gb", "0.005", "--objective", "refit-time", "--json", "--top", "2"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["objective"] == "refit-time" and all("replicas" in c for c in data["candidates"])
    assert main(["refit", "--world", "8", "--shards", "tp=4 + tp=4", "--from", "0", "--to", "1", "--model",
                 "tiny-dense", "--objective", "memory", "-q"]) == 2  # fmt: skip
    assert "--objective needs --search" in capsys.readouterr().err


def test_every_fitting_spec_is_a_candidate() -> None:
    footprint = Footprint(preset("tiny-moe"))
    expected = {s for s in valid_specs(16) if footprint.fits(s) is None and footprint.weight_bytes(s) <= 5e6}
    assert {c.spec for c in _moe_search().candidates} == expected  # type: ignore[attr-defined]


def test_planned_candidates_take_the_plans_numbers() -> None:
    result = _moe_search(plan=2, objective="refit-time")
    planned = [c for c in result.candidates if c.stats is not None]  # type: ignore[attr-defined]
    assert result.planned == len(planned) == 2  # type: ignore[attr-defined]
    for candidate in planned:
        layout = plan_layout(24, TRAIN, allow_idle=True)
        stats = RefitStats.of(plan_refit(layout, 0, candidate.destination, preset("tiny-moe"), 4))
        assert candidate.seconds == stats.estimate_seconds() and candidate.stats.total_bytes == stats.total_bytes


def test_axes_limits_and_a_dense_model_keeps_its_default_expert_split() -> None:
    result = _moe_search(axes={"tp": 2, "dp": 16, "ep": 16, "expt_tp": 1})
    assert {c.spec.tp for c in result.candidates} <= {1, 2}  # type: ignore[attr-defined]
    assert all(c.spec.pp == c.spec.cp == 1 for c in result.candidates)  # type: ignore[attr-defined]
    dense = search(plan_layout(24, "tp=4,pp=2", allow_idle=True), 0, preset("tiny-dense"), 16, 1e9)
    assert all(c.spec.ep == 1 and c.spec.expt_tp == c.spec.tp for c in dense.candidates)


def test_role_is_given_to_every_candidate() -> None:
    assert {c.spec.role for c in _moe_search(role="decode").candidates} == {"decode"}  # type: ignore[attr-defined]


def test_no_layout_names_the_memory_and_the_nearest_ranks() -> None:
    layout = plan_layout(1400, "tp=8,dp=128,ep=64,expt_tp=1,role=train", allow_idle=True)
    started = time.perf_counter()
    with pytest.raises(NoLayoutError) as caught:
        search(layout, 0, preset("deepseek-v3"), 255, 80e9)
    message = str(caught.value)
    assert time.perf_counter() - started < 30
    assert "no layout of 255 ranks fits 80 GB per rank for deepseek-v3" in message
    assert "more memory per rank would admit it" in message and "256 ranks would fit" in message
    assert len(message) < 1000
    with pytest.raises(NoLayoutError, match="over axes tp, dp"):
        search(layout, 0, preset("deepseek-v3"), 8, 80e9, axes=["tp", "dp"])


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"ranks": 17}, LayoutError, "no room for 17 ranks after the shards: grow the world to 25"),
        ({"offset": 4}, LayoutError, r"ranks \[4, 20\) overlap the source shard"),
        ({"memory_bytes": 0}, LayoutError, "memory_bytes=0"),
        ({"source": 3}, RefitError, "source shard 3"),
        ({"axes": ["tq"]}, LayoutError, "unknown axis 'tq'"),
        ({"plan": -1}, RefitError, "plan=-1"),
        ({"inter_gbps": 0}, RefitError, "inter_gbps=0"),
        ({"ranks_per_node": 0}, LayoutError, "ranks_per_node=0"),
        ({"objective": "speed"}, RefitError, "objective='speed': choose one of replicas, memory, refit-time"),
    ],
)
def test_bad_arguments(kwargs: dict[str, object], error: type[Exception], message: str) -> None:
    arguments: dict[str, object] = {"source": 0, "ranks": 16, "memory_bytes": 5e6, **kwargs}
    with pytest.raises(error, match=message):
        search(plan_layout(24, TRAIN, allow_idle=True), manifest=preset("tiny-moe"), **arguments)  # type: ignore[arg-type]


def test_a_source_the_model_does_not_split_over() -> None:
    with pytest.raises(ManifestError, match="does not split into 3 equal parts"):
        search(plan_layout(8, "tp=3", allow_idle=True), 0, preset("tiny-moe"), 4, 1e9)


SEARCH = (
    "refit",
    "--search",
    "--world",
    "24",
    "--shards",
    TRAIN,
    "--from",
    "0",
    "--ranks",
    "16",
    "--model",
    "tiny-moe",
)


def test_cli_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*SEARCH, "--memory-gb", "0.005", "--ranks-per-node", "4", "--top", "3"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("search tiny-moe (78 tensors") and "to 16 ranks [8, 24)" in out[0]
    assert "specs enumerated" in out[1] and "refit classes estimated" in out[1]
    assert out[3].split()[:6] == ["#", "spec", "replicas", "weight/rank", "headroom", "estimate"]
    assert [line.split()[0] for line in out[4:7]] == ["1", "2", "3"]


def test_cli_json_matches_the_api(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*SEARCH, "--memory-gb", "0.005", "--json", "--top", "0", "--plan", "1"]) == 0
    data = json.loads(capsys.readouterr().out)
    result = _moe_search(plan=1)
    assert [c["spec"] for c in data["candidates"]] == [str(c.spec) for c in result.candidates]  # type: ignore[attr-defined]
    assert sum(c["planned"] for c in data["candidates"]) == 1 and data["fit_memory"] == result.fit_memory  # type: ignore[attr-defined]
    assert data["candidates"][0]["crosses_nodes"] is None  # no --ranks-per-node


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (("--memory-gb", "0.000001"), "no layout of 16 ranks fits 1 kB per rank"),
        (("--memory-gb", "1", "--axes", "tp:x"), "--axes 'tp:x'"),
        (("--memory-gb", "1", "--to", "1"), "--search chooses the destination"),
        ((), "refit --search needs --memory-gb"),
    ],
)
def test_cli_bad_input_is_one_line(capsys: pytest.CaptureFixture[str], extra: tuple[str, ...], message: str) -> None:
    assert main([*SEARCH, *extra, "-q"]) == 2  # -q: no progress line, which a search past 1 s prints (a loaded CI)
    err = capsys.readouterr().err
    assert err.startswith("shardcore: error: ") and message in err and err.count("\n") == 1


def test_cli_progress_on_stderr_when_it_runs_long(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import shardcore.cli.search as cli_search

    monkeypatch.setattr(cli_search, "PROGRESS_AFTER", 30.0)  # quick, however busy the machine
    assert main([*SEARCH, "--memory-gb", "0.005"]) == 0
    assert capsys.readouterr().err == ""  # a quick search says nothing
    monkeypatch.setattr(cli_search, "PROGRESS_AFTER", 0.0)
    assert main([*SEARCH, "--memory-gb", "0.005", "--plan", "1"]) == 0
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("search: ") and "specs of 16 ranks" in err[0]
    assert any("planning 1/1" in line for line in err)
    assert main([*SEARCH, "--memory-gb", "0.005", "-q"]) == 0 and capsys.readouterr().err == ""


def test_cli_marks_every_planned_row(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*SEARCH, "--memory-gb", "0.005", "--plan", "3", "--top", "0"]) == 0
    out = capsys.readouterr().out.splitlines()
    header = out[3].split()
    assert header[-2:] == ["alike", "planned"]
    rows = [line.split() for line in out[3:] if line[:1].isdigit()]
    planned = [row for row in rows if row[-1] == "yes"]
    # a planned cost never hides as 'alike' behind an estimated row: the yes rows hold the 3 planned
    assert sum(1 + int(row[-2][1:]) if row[-2].startswith("+") else 1 for row in planned) == 3
    assert any(line.startswith("planned: the 3 best by replicas") for line in out)


def test_cli_progress_names_a_long_step_while_it_runs(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import time

    import shardcore.cli.search as cli_search

    monkeypatch.setattr(cli_search, "PROGRESS_AFTER", 0.2)
    progress = cli_search._Progress(quiet=False)
    progress("planning 1/1: 'tp=8'")  # said before the threshold, and still running after it
    time.sleep(1.0)
    progress.close()
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and re.fullmatch(r"search: planning 1/1: 'tp=8' \(\d+\.\d s\)", err[0]), err
