"""The torch internals shardcore relies on, checked against the running torch (2.13.0 and 2.14.1 in tox).

On the running torch every internal checks out and the counter really names the next group. A torch
without one of them, or with the counter no longer naming groups, fails at shardcore's first use of
torch in one line naming the internal and the tested releases: in the library (a copy of torch's
module with the internal taken out, as another release would ship it) and from ``shardcore check``
(its ranks run a real torch patched to name groups otherwise, as torch still works then), before any group.
"""

from __future__ import annotations

import os
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")

import torch
from torch.distributed import distributed_c10d

from shardcore import TorchInternalsError
from shardcore.engine import TESTED_TORCH, check_torch_internals
from shardcore.engine.torch_state import INTERNALS

ROOT = Path(__file__).resolve().parents[2]


def test_the_running_torch_is_a_tested_release_and_has_every_internal() -> None:
    assert torch.__version__.split("+")[0] in TESTED_TORCH
    check_torch_internals("shardcore", distributed_c10d, INTERNALS)


def _without(attribute: str, world: Any = None) -> types.ModuleType:
    """A copy of torch's ``distributed_c10d`` without ``attribute`` (``_world`` replaced by ``world`` if given)."""
    copy = types.ModuleType(distributed_c10d.__name__)
    copy.__dict__.update({k: v for k, v in vars(distributed_c10d).items() if k != attribute})
    if world is not None:  # torch's functions read torch's own _world: this one names groups by the copy's

        def named(ranks: list[int], use_hashed_name: bool) -> str:
            world.group_count += 1
            return str(world.group_count - 1)

        copy._world, copy._process_group_name = world, named  # type: ignore[attr-defined]
    return copy


def _check(module: types.ModuleType) -> str:
    with pytest.raises(TorchInternalsError) as caught:
        check_torch_internals("shardcore", module, INTERNALS)
    message = str(caught.value)
    assert "\n" not in message
    assert f"torch {torch.__version__} lacks or changed torch.distributed.distributed_c10d." in message
    assert "(tested on torch 2.13.0 and 2.14.1)" in message
    return message


@pytest.mark.parametrize(
    ("attribute", "named"),
    [
        ("_get_default_group", "_get_default_group()"),
        ("_get_default_store", "_get_default_store()"),
        ("_get_process_group_name", "_get_process_group_name(group)"),
        ("_process_group_name", "_world.group_count names the next default-mode group"),
        ("shrink_group", "shrink_group(ranks"),
        ("SHRINK_ABORT", "shrink_group(ranks"),
        ("_world", "_world.group_count"),
    ],
)
def test_a_missing_function_or_constant_is_named(attribute: str, named: str) -> None:
    assert f"distributed_c10d.{named}" in _check(_without(attribute))


class _World:
    """torch's ``_world`` as another release might keep it: same counter, one field gone or changed."""

    def __init__(self, **fields: Any) -> None:
        self.group_count = distributed_c10d._world.group_count
        self.pg_names: Any = {}
        self.pg_backend_config: Any = {}
        vars(self).update(fields)


@pytest.mark.parametrize(
    ("world", "named"),
    [
        (_World(pg_names=None), "_world.pg_names"),
        (_World(pg_backend_config=[]), "_world.pg_backend_config"),
        (_World(group_count="0"), "_world.group_count"),
    ],
)
def test_a_changed_world_field_is_named(world: _World, named: str) -> None:
    assert f"distributed_c10d.{named}" in _check(_without("_world", world=world))


def test_a_counter_that_no_longer_names_groups_is_caught_and_left_as_found() -> None:
    """The counter is still an int and settable, but groups are named otherwise (by their ranks' hash)."""
    changed = _without("_process_group_name")
    changed._process_group_name = lambda ranks, use_hashed_name: distributed_c10d._hash_ranks_to_str(ranks)  # type: ignore[attr-defined]
    before = distributed_c10d._world.group_count
    assert "_world.group_count names the next default-mode group and can be set" in _check(changed)
    assert distributed_c10d._world.group_count == before


def test_check_says_it_in_one_line_from_every_rank_before_any_group_is_made(tmp_path: Path) -> None:
    """A real torch that names groups by their ranks' hash, not by the counter (patched at start-up in every
    process, the parent and each rank): torch still works, but members-only creation would pick wrong
    names; ``shardcore check`` stops with the one line instead, and no rank builds a group."""
    (tmp_path / "sitecustomize.py").write_text(
        "from torch.distributed import distributed_c10d\n\n"
        "named = distributed_c10d._process_group_name\n"
        "distributed_c10d._process_group_name = lambda ranks, use_hashed_name: named(ranks, True)\n"
    )
    environ = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    environ.pop("SHARDCORE_BACKEND", None)
    argv = [sys.executable, "-m", "shardcore", "check", "--nproc", "2", "--shards", "tp=2", "--timeout", "60"]
    result = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, env=environ, timeout=180, check=False)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr and "built" not in result.stderr
    errors = result.stderr[result.stderr.index("shardcore: error:") :].splitlines()
    assert errors[0] == "shardcore: error: shardcore check failed:", result.stderr
    assert len(errors) == 2 and "(2 ranks): torch " in errors[1], result.stderr
    named = "distributed_c10d._world.group_count names the next default-mode group and can be set"
    assert f"lacks or changed torch.distributed.{named}, which shardcore relies on" in errors[1]
    assert "(tested on torch 2.13.0 and 2.14.1)" in errors[1]
