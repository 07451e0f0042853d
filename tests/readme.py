"""The README's code blocks, as CI runs them: every fenced ``python`` and ``bash`` block of README.md and of
the plugins' READMEs runs as written, in a fresh process, or says on its first line why it cannot.

The conventions, written in the blocks themselves so that a reader sees them too:

* ``# not run: REASON``: CI does not run the block (a GPU, an NPU, several nodes, an install from the
  network); the reason is required.
* ``# runs on every rank: torchrun --nproc-per-node N FILE``: the block is one rank's program; CI runs it
  on N local gloo ranks (``shardcore.testing.run_world``, which sets the variables torchrun sets).
* Otherwise a ``python`` block runs with ``python -c`` and a ``bash`` block with ``bash -e``, each in an
  empty folder (with a ``docs/`` inside, for commands that write pictures there), where ``shardcore`` is
  this checkout's command.

A block needs torch when it builds groups, moves weights or starts a live check; those run in the
``dtensor`` tox env (``tests/engine/test_readme.py``; it has the Hyper-Parallel backend too), the others
in ``core`` (``tests/core/test_readme.py``), which has no torch.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import stat
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
READMES = (ROOT / "README.md", *sorted((ROOT / "plugins").glob("*/README.md")))
_FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```[ \t]*$", re.DOTALL | re.MULTILINE)
_NOT_RUN = re.compile(r"^# not run: (\S.*)$")
_ON_EVERY_RANK = re.compile(r"^# runs on every rank: torchrun --nproc-per-node (\d+) \S+$")
_NEEDS_TORCH = {
    "python": re.compile(r"\b(?:import torch|from torch\b|build_shards|execute_refit|shardcore_\w+)"),
    "bash": re.compile(r"\bshardcore (?:check\b|\w+ .*--check\b)|\btorchrun\b", re.DOTALL),
}
BLOCK_TIMEOUT = 300.0


@dataclass(frozen=True)
class Block:
    """One fenced block: where it is, its language and code, and what its first line says about running it."""

    readme: Path
    line: int
    language: str
    code: str

    @property
    def name(self) -> str:
        """``README.md:85`` (the plugins' as ``plugins/NAME/README.md:7``): the block's id in test reports."""
        return f"{self.readme.relative_to(ROOT)}:{self.line}"

    @property
    def first_line(self) -> str:
        return self.code.split("\n", 1)[0].strip()

    @property
    def not_run(self) -> str | None:
        """Why CI does not run it, or None."""
        found = _NOT_RUN.match(self.first_line)
        return found.group(1) if found else None

    @property
    def ranks(self) -> int | None:
        """The world a ``# runs on every rank`` block runs on, or None."""
        found = _ON_EVERY_RANK.match(self.first_line)
        return int(found.group(1)) if found else None

    @property
    def needs_torch(self) -> bool:
        return self.ranks is not None or bool(_NEEDS_TORCH[self.language].search(self.code))


def blocks(readme: Path) -> list[Block]:
    """The ``python`` and ``bash`` blocks of ``readme``, in order."""
    text = readme.read_text(encoding="utf-8")
    return [
        Block(readme, text.count("\n", 0, found.start()) + 1, found.group(1), found.group(2))
        for found in _FENCE.finditer(text)
        if found.group(1) in _NEEDS_TORCH
    ]


def every_block() -> list[Block]:
    return [block for readme in READMES for block in blocks(readme)]


def _shardcore_on_path(folder: Path) -> dict[str, str]:
    """An environment where ``shardcore`` (and ``python``) are this interpreter running this checkout."""
    bin_dir = folder / ".bin"
    bin_dir.mkdir(exist_ok=True)
    for name, command in (("shardcore", f'"{sys.executable}" -m shardcore'), ("python", f'"{sys.executable}"')):
        script = bin_dir / name
        script.write_text(f'#!/bin/sh\nexec {command} "$@"\n')
        script.chmod(script.stat().st_mode | stat.S_IXUSR)
    pythonpath = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "PYTHONPATH": pythonpath}


def run_alone(block: Block, folder: Path) -> subprocess.CompletedProcess[str]:
    """Run a block that is not one rank's program in ``folder``; the caller checks the outcome."""
    (folder / "docs").mkdir(exist_ok=True)
    env = _shardcore_on_path(folder)
    env.pop("SHARDCORE_BACKEND", None)
    argv = [sys.executable, "-c", block.code] if block.language == "python" else ["bash", "-e", "-c", block.code]
    return subprocess.run(argv, capture_output=True, text=True, env=env, cwd=folder, timeout=BLOCK_TIMEOUT)


def run_on_rank(rank: int, world_size: int, code: str) -> str:
    """One rank of a ``# runs on every rank`` block (``run_world``'s worker): the block's code as its
    ``__main__``, in the world ``run_world`` initialised; returns what it printed."""
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(code, f"<README block, rank {rank} of {world_size}>", "exec"), {"__name__": "__main__"})
    return printed.getvalue()


def run_block(block: Block, folder: Path) -> None:
    """Run any runnable block and fail with its output when it fails."""
    if block.ranks is not None:
        from shardcore.testing import run_world

        run_world(block.ranks, run_on_rank, block.code, timeout=BLOCK_TIMEOUT)
        return
    result = run_alone(block, folder)
    if result.returncode != 0 or "Traceback" in result.stderr:  # not assert: the core env runs under -O too
        raise AssertionError(f"{block.name} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
