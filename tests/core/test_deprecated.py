"""Renamed public names keep a deprecated alias for a release (CHANGELOG.md lists them)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import shardcore
import shardcore.refit

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name", ["RefitInputError", "RefitPeerError"])
def test_the_refit_errors_old_home_warns_and_gives_the_same_class(name: str) -> None:
    with pytest.warns(DeprecationWarning, match=rf"shardcore.refit.{name} is deprecated .* use shardcore.{name}"):
        found = getattr(shardcore.refit, name)
    assert found is getattr(shardcore, name)


def test_refit_execute_is_resolved_without_refit_importing_the_engine() -> None:
    # a fresh process: shardcore.refit loads no engine module until the old name is used
    code = (
        "import sys, warnings; import shardcore.refit as r; "
        "print(any(m.startswith('shardcore.engine') for m in sys.modules)); "
        "warnings.simplefilter('error', DeprecationWarning)\n"
        "try:\n    r.execute\nexcept DeprecationWarning as w:\n    print(w)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    lines = result.stdout.splitlines()
    assert lines == [
        "False",
        "shardcore.refit.execute is deprecated and goes in the next release: use shardcore.execute_refit",
    ], result.stderr


def test_other_missing_names_are_attribute_errors() -> None:
    with pytest.raises(AttributeError, match=r"module 'shardcore\.refit' has no attribute 'executes'"):
        shardcore.refit.executes  # noqa: B018


def test_weight_map_numbers_warns_and_gives_read_bys_numbers() -> None:
    from shardcore.refit.families import manifest_from_hf_config

    config = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 1,
              "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100}  # fmt: skip
    weights = manifest_from_hf_config(config).vllm(2, 1)[1]
    source = "model.layers.0.self_attn.k_proj.weight"
    with pytest.warns(DeprecationWarning, match="WeightMap.numbers is deprecated .* use WeightMap.read_by"):
        numbers = weights.numbers(source)
    assert numbers == tuple(number for _, number in weights.read_by(source)) and len(numbers) == 2


def test_a_plans_scale_positions_warn_and_give_the_manifests() -> None:
    from shardcore.plan.layout import plan_layout
    from shardcore.refit import plan_refit, preset

    manifest = preset("tiny-dense").converted("float8_e4m3fn", "tensor")
    plan = plan_refit(plan_layout(4, "tp=2,role=train + tp=2"), 0, [1], manifest)
    with pytest.warns(DeprecationWarning, match=r"RefitPlan.scale_positions is deprecated .* plan.manifest.scale"):
        found = plan.scale_positions
    expected = {p for p, tensor in enumerate(plan.manifest.tensors) if tensor.scale_of is not None}
    assert found == plan.manifest.scale_positions == expected and found
