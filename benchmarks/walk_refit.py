"""The walk of one refit: which of shardcore's modules ``shardcore refit --check`` passes, in order, and how often
control comes back into a module it has already been in and left.

It runs the CLI in a subprocess whose interpreter (and each spawned worker's) starts with a profile hook
(``sitecustomize``, written to a temporary folder put first on ``PYTHONPATH``: nothing in shardcore is changed).
The hook watches every Python call and keeps, per process, each *edge* the first time it is taken: a call that
enters a shardcore module from another one (the caller is the nearest shardcore frame up the stack, so a call
back from torch counts as coming from the module that called torch). Imports are not walked: a module's body
running, and what it calls directly, are left out. It writes each new edge at once, so a worker
ended by its parent leaves its walk behind.

Reported per process (the CLI's parent and each worker): the modules in the order they are first entered (the
walk), the edges, and the *re-entries*: edges whose callee module had been entered before that edge was first
taken (control left it and came back from elsewhere). A module per concept, each called from its one owner,
makes few; modules that call each other both ways make many. Loops are counted once: each edge counts once
however often it is taken.

It walks the shardcore of the checkout it lies in (``CHECKOUT``: put on ``PYTHONPATH`` after the hook, the CLI run
with ``-P`` so that the folder it runs in, which ``-m`` would put first, cannot bring another checkout's).

Run (from any folder; the numbers in BENCHMARKS.md compare two checkouts, each its own script):
    python <checkout>/benchmarks/walk_refit.py [--show] [-- <refit arguments>]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

DEFAULT_REFIT = [
    "--shards", "tp=2,role=train+tp=1,dp=2", "--from", "0", "--to", "1", "--model", "tiny-dense",
    "--check", "--nproc", "4", "-q",
]  # fmt: skip

CHECKOUT = Path(__file__).resolve().parents[1]
"""The checkout whose shardcore is walked: the one this script lies in."""

HOOK = """
import json, os, sys, threading

_out = os.environ.get("SHARDCORE_WALK_DIR")
if _out:
    _roots = {}
    _seen = set()
    _file = open(os.path.join(_out, f"{os.getpid()}.jsonl"), "a", buffering=1)

    def _module(code):
        name = code.co_filename
        found = _roots.get(name)
        if found is None:
            parts = name.replace(os.sep, "/").split("/")
            found = ""
            for root in ("shardcore", "shardcore_megatron", "shardcore_dtensor", "shardcore_hyperparallel",
                         "shardcore_vllm"):
                if root in parts:
                    at = len(parts) - 1 - parts[::-1].index(root)
                    found = "/".join(parts[at:])
                    break
            _roots[name] = found
        return found

    def _hook(frame, event, arg):
        if event != "call" or frame.f_code.co_name == "<module>":
            return
        callee = _module(frame.f_code)
        if not callee:
            return
        caller, back = "", frame.f_back
        while back is not None and not caller:
            caller, code, back = _module(back.f_code), back.f_code, back.f_back
        if caller == callee or (caller and code.co_name == "<module>"):
            return
        edge = (caller, callee, frame.f_code.co_name)
        if edge not in _seen:
            _seen.add(edge)
            _file.write(json.dumps(edge) + "\\n")

    sys.setprofile(_hook)
    threading.setprofile(_hook)
"""


@dataclass
class Walk:
    """One process's walk: the modules in the order first entered, its edges, its re-entries (as text)."""

    pid: int
    modules: list[str] = field(default_factory=list)
    edges: int = 0
    reentries: list[str] = field(default_factory=list)

    @classmethod
    def of(cls, pid: int, edges: list[tuple[str, str, str]]) -> Walk:
        """The walk of ``edges`` (caller module, callee module, callee function), in the order first taken. An
        edge from outside shardcore (a thread's or the process's first call) is an entry, never a re-entry."""
        walk = cls(pid, edges=len(edges))
        for caller, callee, function in edges:
            if callee not in walk.modules:
                walk.modules.append(callee)
            elif caller:
                walk.reentries.append(f"{caller} -> {callee}:{function}")
        return walk

    @property
    def returns(self) -> list[str]:
        """The re-entries by module pair: each (caller module, module entered before) once, whatever functions."""
        return sorted({entry.split(":")[0] for entry in self.reentries})


def run(refit_args: list[str]) -> list[Walk]:
    """Run ``shardcore refit`` with the hook; each process's walk, the CLI's first."""
    with tempfile.TemporaryDirectory() as folder:
        hook, out = Path(folder, "hook"), Path(folder, "out")
        hook.mkdir()
        out.mkdir()
        (hook / "sitecustomize.py").write_text(HOOK)
        env = dict(os.environ, SHARDCORE_WALK_DIR=str(out))
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(hook), str(CHECKOUT), env.get("PYTHONPATH", "")]))
        command = [sys.executable, "-P", "-m", "shardcore", "refit", *refit_args]
        done = subprocess.run(command, env=env, stdout=sys.stderr, check=False)  # our report alone on stdout
        if done.returncode:
            raise SystemExit(f"shardcore refit exited with {done.returncode}")
        walks = []
        for path in sorted(out.iterdir(), key=lambda p: int(p.stem)):
            edges = [tuple(json.loads(line)) for line in path.read_text().splitlines()]
            if edges:
                walks.append(Walk.of(int(path.stem), edges))
        return walks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--show", action="store_true", help="print every re-entry and the walk of each process")
    parser.add_argument("--json", action="store_true", help="the walks as JSON")
    parser.add_argument("refit", nargs="*", help="arguments of `shardcore refit` (after --)")
    args = parser.parse_args()
    walks = run(args.refit or DEFAULT_REFIT)
    if args.json:
        print(json.dumps([asdict(walk) for walk in walks], indent=1))
        return
    for n, walk in enumerate(walks):
        role = "CLI (parent)" if n == 0 else f"worker {n - 1}"
        print(
            f"{role}: {len(walk.modules)} modules, {walk.edges} edges, {len(walk.reentries)} re-entries "
            f"({len(walk.returns)} module pairs)"
        )
        if args.show or n == 1:
            print("  walk: " + " -> ".join(module.removeprefix("shardcore/") for module in walk.modules))
        if args.show:
            for line in walk.reentries:
                print(f"  re-entry: {line}")


if __name__ == "__main__":
    main()
