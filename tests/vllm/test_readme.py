"""The documentation's blocks that need vLLM (``# runs in the vllm env``) run as written, in the vllm env
(``tests/readme.py`` says how): plugins/vllm/README.md's offline example starts a real engine and updates it.

It sits under the root ``tests/`` package: under ``--import-mode=importlib`` a plugin's ``tests/`` folder is
imported as a package named ``tests`` itself, where ``tests.readme`` is not found."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("vllm")

from tests.readme import Block, blocks_for, run_block


def test_the_vllm_env_has_blocks_to_run() -> None:
    assert [block.name for block in blocks_for("vllm")], "no block says '# runs in the vllm env'"


@pytest.mark.parametrize("block", blocks_for("vllm"), ids=lambda block: block.name)
def test_block_runs_with_vllm(block: Block, tmp_path: Path) -> None:
    run_block(block, tmp_path)
