"""The documentation's code blocks, as CI runs them: every fenced block of README.md, of every page under
``docs/`` and of every plugin's README runs as written, in a fresh process, or says on its first line why it
cannot; a block that does neither is a test failure.

The rule, by the fence's tag (its first word), wherever the fence sits (at column 0, or indented inside a
list item: the block is then read without that indent):

* ``python``, ``bash``, ``sh``: a program. It runs, unless its first line is ``# not run: REASON`` (a GPU,
  an NPU, several nodes, an install from the network; the reason is required).
* ``text``, ``yaml``, ``json``, ``toml``: shown, not run: a program's output, a file's contents, a command's
  synopsis.
* anything else, or no tag: an error, since CI could neither run it nor tell that it is only shown.

Where a program runs, also said on its first line:

* ``# runs on every rank: torchrun --nproc-per-node N FILE``: the block is one rank's program; CI runs it
  on N local gloo ranks (``shardcore.testing.run_world``, which sets the variables torchrun sets).
* ``# runs in the ENV env`` (``megatron``, ``vllm``), alone or followed by `` on every rank: torchrun ...``:
  the block needs that tox env's packages (megatron-core; vLLM) and runs only there, in a test of its own
  that collects ``blocks_for(ENV)`` and runs each with ``run_block`` (``tests/megatron/test_readme.py``).
  Such a test sits under the root ``tests/`` package: under ``--import-mode=importlib`` a plugin's own
  ``tests/`` folder is imported as a package named ``tests``, where ``tests.readme`` is not found.
* Otherwise a ``python`` block runs with ``python -c`` and a ``bash``/``sh`` block with ``bash -e``, each in
  an empty folder (with a ``docs/`` inside, for commands that write pictures there), where ``shardcore`` is
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
RUN = {"python": "python", "bash": "bash", "sh": "bash"}
"""The tags of blocks that are programs, and the language each runs as."""
SHOWN = frozenset({"text", "yaml", "json", "toml"})
"""The tags of blocks that are shown, not run: output, a file's contents, a synopsis."""
ENVS = ("megatron", "vllm")
"""The tox envs a ``# runs in the ENV env`` block may name (each runs ``blocks_for(ENV)`` in a test)."""
BLOCK_TIMEOUT = 300.0

_OPEN = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})(?P<info>.*)$")
_NOT_RUN = re.compile(r"^# not run: (\S.{9,})$")
_RUNS = re.compile(
    r"^# runs(?: in the (?P<env>[\w-]+) env)?(?: on every rank: torchrun --nproc-per-node (?P<ranks>[1-9]\d*) \S+)?$"
)
_NEEDS_TORCH = {
    "python": re.compile(r"\b(?:import torch|from torch\b|build_shards|execute_refit|shardcore_\w+)"),
    "bash": re.compile(r"\bshardcore (?:check\b|\w+ .*--check\b)|\btorchrun\b", re.DOTALL),
}


def documents() -> list[Path]:
    """Every page whose blocks CI runs: README.md, ``docs/**/*.md`` and ``plugins/*/README.md``."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")), *sorted((ROOT / "plugins").glob("*/README.md"))]


@dataclass(frozen=True)
class Block:
    """One fenced block: where it is (``line``: its opening fence's), its tag and code (without the fence's indent)."""

    document: Path
    line: int
    language: str
    code: str
    closed: bool = True

    @property
    def name(self) -> str:
        """``README.md:85`` (``docs/refit.md:7``, ``plugins/NAME/README.md:7``): the block's id in test reports."""
        path = self.document.relative_to(ROOT) if self.document.is_relative_to(ROOT) else self.document
        return f"{path}:{self.line}"

    @property
    def first_line(self) -> str:
        return self.code.split("\n", 1)[0].strip()

    @property
    def runs(self) -> bool:
        """A program (``python``, ``bash``, ``sh``) that does not say ``# not run``."""
        return self.language in RUN and not self.first_line.startswith("# not run")

    @property
    def not_run(self) -> str | None:
        """Why CI does not run a program, or None."""
        found = _NOT_RUN.match(self.first_line) if self.language in RUN else None
        return found.group(1) if found else None

    @property
    def _runs_marker(self) -> re.Match[str] | None:
        return _RUNS.match(self.first_line) if self.runs else None

    @property
    def ranks(self) -> int | None:
        """The world a ``# runs ... on every rank`` block runs on, or None."""
        found = self._runs_marker
        return int(found.group("ranks")) if found and found.group("ranks") else None

    @property
    def needs_torch(self) -> bool:
        return self.ranks is not None or bool(_NEEDS_TORCH[RUN[self.language]].search(self.code))

    @property
    def env(self) -> str | None:
        """The tox env that runs it (``core``, ``dtensor``, or one of ``ENVS``), or None where nothing does."""
        if not self.runs or self.problem is not None:
            return None
        found = self._runs_marker
        if found and found.group("env"):
            return found.group("env")
        return "dtensor" if self.needs_torch else "core"

    @property
    def problem(self) -> str | None:
        """Why the block is neither run nor shown, or is a program CI cannot run as written; None when fine."""
        if not self.closed:
            return "its fence is never closed"
        if not self.language:
            return "a fence with no tag: tag a program python, bash or sh (it runs), output or data text/yaml/json/toml"
        if self.language in SHOWN:
            return None
        if self.language not in RUN:
            return f"a '{self.language}' block is neither run nor shown: tag it python, bash, sh, or text"
        if self.first_line.startswith("# not run"):
            return None if self.not_run else "'# not run: REASON' needs a reason of 10 characters or more"
        if self.first_line.startswith("# runs"):
            found = _RUNS.match(self.first_line)
            if found is None or not (found.group("env") or found.group("ranks")):
                return "write '# runs on every rank: torchrun --nproc-per-node N FILE' or '# runs in the ENV env'"
            if found.group("env") and found.group("env") not in ENVS:
                return f"no test runs the '{found.group('env')}' env's blocks: one of {', '.join(ENVS)}"
        if "[--" in self.code:
            return "optional flags in brackets do not run: say them in prose"
        return None


def blocks(document: Path) -> list[Block]:
    """Every fenced block of ``document``, in order, at any indent (read without the fence's indent)."""
    lines = document.read_text(encoding="utf-8").split("\n")
    found: list[Block] = []
    index = 0
    while index < len(lines):
        opening = _OPEN.match(lines[index])
        index += 1
        if opening is None:
            continue
        indent, fence = len(opening.group("indent")), opening.group("fence")
        language = opening.group("info").strip().split(" ", 1)[0].lower() if opening.group("info").strip() else ""
        start, code = index, []
        while index < len(lines):
            stripped = lines[index].strip()
            if stripped.startswith(fence) and set(stripped) == {fence[0]}:
                break
            line = lines[index]
            code.append(line[min(indent, len(line) - len(line.lstrip())) :])  # the fence's indent, no more
            index += 1
        closed = index < len(lines)
        index += 1
        found.append(Block(document, start, language, "\n".join(code) + ("\n" if code else ""), closed))
    return found


def every_block() -> list[Block]:
    """Every fenced block of every page ``documents()`` lists."""
    return [block for document in documents() for block in blocks(document)]


def blocks_for(env: str) -> list[Block]:
    """The blocks the tox env ``env`` runs: ``core``, ``dtensor``, or one of ``ENVS`` (its own test collects them)."""
    return [block for block in every_block() if block.env == env]


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
    program = [sys.executable, "-c"] if RUN[block.language] == "python" else ["bash", "-e", "-c"]
    argv = [*program, block.code]
    return subprocess.run(argv, capture_output=True, text=True, env=env, cwd=folder, timeout=BLOCK_TIMEOUT)


def run_on_rank(rank: int, world_size: int, code: str) -> str:
    """One rank of a ``# runs on every rank`` block (``run_world``'s worker): the block's code as its
    ``__main__``, in the world ``run_world`` initialised; returns what it printed."""
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(code, f"<README block, rank {rank} of {world_size}>", "exec"), {"__name__": "__main__"})
    return printed.getvalue()


def run_block(block: Block, folder: Path) -> None:
    """Run a runnable block and fail with its output when it fails (or when it cannot run as written)."""
    if block.env is None:
        raise AssertionError(f"{block.name} does not run: {block.problem or block.not_run or 'shown only'}")
    if block.ranks is not None:
        from shardcore.testing import run_world

        run_world(block.ranks, run_on_rank, block.code, timeout=BLOCK_TIMEOUT)
        return
    result = run_alone(block, folder)
    if result.returncode != 0 or "Traceback" in result.stderr:  # not assert: the core env runs under -O too
        raise AssertionError(f"{block.name} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
