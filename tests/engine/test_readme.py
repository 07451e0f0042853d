"""The READMEs' blocks that need torch (groups, refits, live checks) run as written (``tests/readme.py``
says how); this env has the DTensor and Hyper-Parallel backends, the plugins' READMEs need no other."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("torch")

from tests.readme import Block, every_block, run_block

BLOCKS = [b for b in every_block() if b.not_run is None and b.needs_torch]


@pytest.mark.parametrize("block", BLOCKS, ids=lambda block: block.name)
def test_block_runs_with_torch(block: Block, tmp_path: Path) -> None:
    run_block(block, tmp_path)
