"""The documentation's blocks that need megatron-core (``# runs in the megatron env``) run as written, in the
megatron envs (``tests/readme.py`` says how; megatron-core 0.16.1 in ``megatron``, 0.19.2 in ``megatron019``).

It sits under the root ``tests/`` package: under ``--import-mode=importlib`` a plugin's ``tests/`` folder is
imported as a package named ``tests`` itself, where ``tests.readme`` is not found."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("megatron.core")

from tests.readme import Block, blocks_for, run_block


@pytest.mark.parametrize("block", blocks_for("megatron"), ids=lambda block: block.name)
def test_block_runs_with_megatron_core(block: Block, tmp_path: Path) -> None:
    run_block(block, tmp_path)
