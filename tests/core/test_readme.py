"""The READMEs' blocks that need no torch run as written (``tests/readme.py`` says how); every block runs
somewhere in CI or says why it cannot."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.readme import Block, every_block, run_block

BLOCKS = every_block()


def test_every_block_runs_in_ci_or_says_why_not() -> None:
    assert len(BLOCKS) >= 15  # README.md's and the plugins'
    for block in BLOCKS:
        assert block.not_run is None or len(block.not_run) > 10, f"{block.name}: say why it does not run"
        if block.first_line.startswith("# runs on every rank"):
            assert block.ranks is not None, f"{block.name}: '# runs on every rank: torchrun --nproc-per-node N FILE'"
        assert "[--" not in block.code, f"{block.name}: optional flags in brackets do not run; say them in prose"


@pytest.mark.parametrize(
    "block", [b for b in BLOCKS if b.not_run is None and not b.needs_torch], ids=lambda block: block.name
)
def test_block_runs_without_torch(block: Block, tmp_path: Path) -> None:
    run_block(block, tmp_path)
