"""The documentation's blocks that need torch (groups, refits, live checks) run as written
(``tests/readme.py`` says how); this env has the DTensor and Hyper-Parallel backends, the pages need no other
(blocks that need megatron-core or vLLM say so and run in their own envs)."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("torch")

from tests.readme import Block, blocks_for, run_block


@pytest.mark.parametrize("block", blocks_for("dtensor"), ids=lambda block: block.name)
def test_block_runs_with_torch(block: Block, tmp_path: Path) -> None:
    run_block(block, tmp_path)
