"""ShardSpec: defaults, derived sizes, dict / string / JSON / YAML / @file round trips."""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
from pathlib import Path

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from shardcore import ShardSpec, ShardSpecError, format_shards, parse_shards

ROLES = (None, "train", "prefill", "decode")


@st.composite
def specs(draw: st.DrawFn) -> ShardSpec:
    """A valid ShardSpec: small sizes, an expert grid that tiles, maybe a role and a name."""
    tp, cp, pp, dp = (draw(st.integers(1, 4)) for _ in range(4))
    per_stage = tp * cp * dp
    expt_tp = draw(st.sampled_from([d for d in range(1, per_stage + 1) if per_stage % d == 0]))
    rest = per_stage // expt_tp
    ep = draw(st.sampled_from([d for d in range(1, rest + 1) if rest % d == 0]))
    name = draw(st.none() | st.text(min_size=1, max_size=10).filter(_valid_name))
    return ShardSpec(tp=tp, pp=pp, cp=cp, dp=dp, ep=ep, expt_tp=expt_tp, role=draw(st.sampled_from(ROLES)), name=name)


def _unique_names(shards: list[ShardSpec]) -> bool:
    names = [spec.name for spec in shards if spec.name is not None]
    return len(set(names)) == len(names)


shard_lists = st.lists(specs(), min_size=1, max_size=4).filter(_unique_names)


def _valid_name(name: str) -> bool:
    try:
        ShardSpec(name=name)
    except ShardSpecError:
        return False
    return True


def test_defaults_and_derived_sizes() -> None:
    spec = ShardSpec()
    assert (spec.tp, spec.pp, spec.cp, spec.dp, spec.ep, spec.expt_tp) == (1, 1, 1, 1, 1, 1)
    assert spec.role is None and spec.name is None
    spec = ShardSpec(tp=4, cp=2, pp=2, dp=3, ep=2, expt_tp=2)
    assert spec.world_size == 48
    assert spec.expt_dp == 48 // (2 * 2 * 2)


def test_expt_tp_resolves_to_tp() -> None:
    assert ShardSpec(tp=2).expt_tp == 2
    assert ShardSpec(tp=2) == ShardSpec(tp=2, expt_tp=2)
    assert hash(ShardSpec(tp=2)) == hash(ShardSpec(tp=2, expt_tp=2))


def test_spec_is_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        ShardSpec().tp = 2  # type: ignore[misc]


@pytest.mark.parametrize("value", [True, False, 1.0, "2", None])
def test_sizes_must_be_ints(value: object) -> None:
    with pytest.raises(ShardSpecError, match="tp="):
        ShardSpec(tp=value)  # type: ignore[arg-type]


def test_from_dict_rejects_unknown_keys_and_non_mappings() -> None:
    with pytest.raises(ShardSpecError, match="'tpp'"):
        ShardSpec.from_dict({"tpp": 2})
    with pytest.raises(ShardSpecError, match="list"):
        ShardSpec.from_dict([("tp", 2)])  # type: ignore[arg-type]


@settings(deadline=None, max_examples=200)
@given(specs())
def test_dict_round_trip(spec: ShardSpec) -> None:
    data = spec.to_dict()
    assert {"tp", "pp", "cp", "dp", "ep", "expt_tp"} <= data.keys()
    assert ("role" in data) == (spec.role is not None) and ("name" in data) == (spec.name is not None)
    assert ShardSpec.from_dict(data) == spec
    assert ShardSpec.from_dict(json.loads(json.dumps(data))) == spec


@settings(deadline=None, max_examples=200)
@given(shard_lists)
def test_string_round_trip(shards: list[ShardSpec]) -> None:
    assert parse_shards(format_shards(shards)) == tuple(shards)
    assert parse_shards(";".join(map(str, shards))) == tuple(shards)


@settings(deadline=None, max_examples=100)
@given(shard_lists)
def test_json_yaml_and_file_inputs(shards: list[ShardSpec]) -> None:
    dicts = [spec.to_dict() for spec in shards]
    expected = tuple(shards)
    assert parse_shards(json.dumps(dicts)) == expected
    assert parse_shards(yaml.safe_dump(dicts)) == expected
    assert parse_shards(dicts) == expected
    assert parse_shards(shards) == expected
    assert parse_shards([str(spec) for spec in shards]) == expected
    with tempfile.TemporaryDirectory() as tmp:
        for suffix, text in (
            (".json", json.dumps(dicts)),
            (".yaml", yaml.safe_dump(dicts)),
            (".txt", format_shards(shards) + "\n"),
        ):
            path = Path(tmp) / f"shards{suffix}"
            path.write_text(text, encoding="utf-8")
            assert parse_shards(f"@{path}") == expected
            assert parse_shards(f"  @{path} ") == expected


def test_handwritten_yaml_and_json() -> None:
    text = """
# a training window and two inference engines
- {tp: 4, pp: 2, role: train, name: policy}
- tp: 2
  dp: 2
  ep: 2
  role: prefill
- {tp: 1, dp: 2, role: decode}
"""
    assert parse_shards(text) == (
        ShardSpec(tp=4, pp=2, role="train", name="policy"),
        ShardSpec(tp=2, dp=2, ep=2, role="prefill"),
        ShardSpec(dp=2, role="decode"),
    )
    assert parse_shards('[{"tp": 2, "expt_tp": null}, {"dp": 4}]') == (ShardSpec(tp=2), ShardSpec(dp=4))


def test_single_spec_and_file_relative_path(tmp_path: Path) -> None:
    assert parse_shards(ShardSpec(tp=2)) == (ShardSpec(tp=2),)
    (tmp_path / "s.yaml").write_text("- {tp: 2}\n", encoding="utf-8")
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        assert parse_shards("@s.yaml") == (ShardSpec(tp=2),)
    finally:
        os.chdir(cwd)


def test_names_with_document_characters_round_trip() -> None:
    """A name may hold ':' or '#'; its spec string must still parse as the grammar, not YAML."""
    shards = (ShardSpec(tp=2, name="llama:70b"), ShardSpec(name="a # b"), ShardSpec(name="[x]"))
    assert parse_shards(format_shards(shards)) == shards


def test_role_case_is_alike_in_every_input() -> None:
    """Megatron's grammar lower-cases the role; dicts, JSON and YAML do the same."""
    expected = (ShardSpec(tp=2, role="prefill"),)
    for spec in (
        "tp=2,role=PREFILL",
        [{"tp": 2, "role": "Prefill"}],
        '[{"tp": 2, "role": "PreFill"}]',
        "- {tp: 2, role: PREFILL}",
    ):
        assert parse_shards(spec) == expected
    assert ShardSpec(role="DECODE").role == "decode"
    with pytest.raises(ShardSpecError, match="role=5"):
        ShardSpec(role=5)  # type: ignore[arg-type]


def test_one_mapping_is_one_shard() -> None:
    expected = (ShardSpec(tp=2, pp=2),)
    assert parse_shards({"tp": 2, "pp": 2}) == expected
    assert parse_shards('{"tp": 2, "pp": 2}') == expected
    assert parse_shards("tp: 2\npp: 2\n") == expected


def test_duplicate_names_are_an_error() -> None:
    with pytest.raises(ShardSpecError, match="name='policy' is given to shards 0 and 2"):
        parse_shards("tp=2,name=policy+tp=2,name=ref+tp=1,name=policy")
    with pytest.raises(ShardSpecError, match="shards 0 and 1"):
        parse_shards([ShardSpec(name="a"), {"name": "a"}])
    assert len(parse_shards("tp=2,name=a+tp=2,name=b+tp=2+tp=2")) == 4  # unnamed shards are fine


LONG = 170_000
KINDS = ("tp=8,pp=4,dp=2,role=train", "tp=2,dp=2,ep=4,expt_tp=1,role=prefill", "tp=1,dp=4,role=decode")


@pytest.mark.parametrize("form", ["string", "dicts"])
def test_a_170000_shard_spec_parses_in_under_two_seconds(form: str) -> None:
    import time

    shards = [KINDS[i % len(KINDS)] for i in range(LONG)]
    kinds = [parse_shards(kind)[0].to_dict() for kind in KINDS]
    spec = "+".join(shards) if form == "string" else [dict(kinds[i % len(KINDS)]) for i in range(LONG)]
    started = time.process_time()
    parsed = parse_shards(spec)
    assert time.process_time() - started < 2.0
    assert len(parsed) == LONG and [str(s) for s in parsed[:3]] == [str(parse_shards(k)[0]) for k in KINDS]


def test_equal_shards_parsed_once_still_check_each_value() -> None:
    with pytest.raises(ShardSpecError, match=r"shard 1 \(\{'tp': True\}\): tp=True"):
        parse_shards([{"tp": 1}, {"tp": True}])  # equal as dict keys, not as shards
    with pytest.warns(UserWarning) as caught:
        parse_shards("tp=2,tp=4+tp=2,tp=4")
    assert [str(w.message).split(":")[0] for w in caught] == ["shard 0 ('tp=2,tp=4')", "shard 1 ('tp=2,tp=4')"]


def test_a_yaml_base_60_number_too_long_for_int_is_a_spec_error() -> None:
    with pytest.raises(ShardSpecError, match="must hold a list of shards"):
        parse_shards("9" * 4301 + ":59")
