"""Long fuzz run of the spec (parse_shards, plan_layout, build_shards' argument checks, `shardcore plan`) and of
refit's inputs (manifest mappings, JSON and YAML manifest files, the manifest API, `shardcore refit` lines).

Each input runs twice: once timed (CPU time), once under tracemalloc for its allocation peak. Fails on any
exception other than a ShardcoreError (or argparse's exit 2), a message (or CLI stderr line) of 1 KB or
more, a traceback or catch-all error line from the CLI, or, for the spec's inputs, > 100 ms or > 100 MB for
one input. Besides grammar tokens and junk, a share of the spec inputs holds STRESS tokens, which stress the
parsers themselves (digit strings past Python's 4,300-digit int limit, control and format characters, huge
nesting, YAML's binary and sexagesimal integers) rather than the grammar; the refit inputs are
benchmarks/manifest_inputs.py's (wrong types in every field, huge, nested and aliased values, corrupted files).

    python -m benchmarks.fuzz_long --n 100000 --seed 0
"""

from __future__ import annotations

import argparse
import contextlib
import random
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

from benchmarks.manifest_inputs import random_input as refit_input
from benchmarks.measure import measure_input
from shardcore.cli import main
from shardcore.engine.backends.shards import build_shards
from shardcore.plan.arguments import shown
from shardcore.plan.layout import plan_layout
from shardcore.plan.spec import parse_shards

TOKENS = [
    "tp",
    "pp",
    "cp",
    "dp",
    "ep",
    "expt_tp",
    "role",
    "name",
    "TP",
    "=",
    ",",
    "+",
    ";",
    " ",
    "\n",
    "-",
    ":",
    "[",
    "]",
    "{",
    "}",
    "@",
    "0",
    "1",
    "2",
    "4",
    "8",
    "16",
    "-1",
    "99999999999999999999",
    "train",
    "prefill",
    "decode",
    "x",
    "é",
    "\x00",
    "1e3",
    "0x10",
    "_",
    "=2",
    "=4",
    ",tp=",
    "+tp=",
    "- {tp: 2}\n",
    "- tp: ",
]
LONG = [4299, 4300, 4301, 5000, 60_000]
"""Digit counts around and past Python's int-conversion limit."""
STRESS = [
    *("9" * n for n in LONG),
    *("-" + "9" * n for n in LONG[:3]),
    "0" * 5000 + "2",
    "1_" * 3000 + "1",
    "\u0662" * 5000,  # Arabic-Indic digits: int() reads them
    "\uff19" * 4400,  # fullwidth digits
    "0b" + "1" * 20_000,  # YAML 1.1 binary: converted without the decimal limit
    "0x" + "f" * 5000,
    ":".join(["59"] * 3000),  # YAML 1.1 sexagesimal
    "1e99999",
    "nan",
    "-inf",
    "\x0b",
    "\x0c",
    "\x1b[31m",
    "\x7f",
    "\x85",
    "\u2028",
    "\u202e",
    "\u200b",
    "\ufeff",
    "\ud800",
    "\U0001f680",
    "e\u0301",
    "\x00",
    "x" * 100_000,
    "[" * 70,
    "{" * 70,
    "- " * 70,
    "&a [*a, *a]",
    "tp=1+" * 1000,
    ",".join(["tp=1"] * 1000),
]
"""Tokens that stress the parsers rather than the grammar."""
KEYS = ["tp", "pp", "cp", "dp", "ep", "expt_tp", "role", "name", "bogus", ""]
FLAGS = [
    "--json",
    "--allow-idle",
    "--order=tp-pp-dp",
    "--order=bad",
    "--strict",
    "--rank=0",
    "--rank=5",
    "--rank=16777215",
    "--rank=-1",
    "--rank=x",
    "--rank-offset=3",
    "--ranks-per-node=8",
    "--ranks-per-node=0",
    "--bogus",
    "--rank=" + "9" * 5000,
    "--rank-offset=" + "9" * 4400,
    "--ranks-per-node=" + "9" * 4000,
    "--rank=\u0662",
]


def stress(rng: random.Random) -> str:
    """A stress token alone, inside grammar, or as a JSON / YAML value."""
    token = rng.choice(STRESS)
    key = rng.choice(["tp", "dp", "ep", "name", "role"])
    return rng.choice(
        [
            token,
            f"{key}={token}",
            f"tp=2,{key}={token}+tp=1",
            f'[{{"{key}": {token}}}]',
            f'[{{"{key}": "{token}"}}]',
            f"- {{{key}: {token}}}",
            f"{key}: {token}",
            f"- tp: 2\n  {key}: {token}\n",
        ]
    )


def text(rng: random.Random) -> str:
    if rng.random() < 0.15:
        return stress(rng)
    if rng.random() < 0.8:
        return "".join(rng.choice(TOKENS) for _ in range(rng.randint(0, 30)))
    return "".join(chr(rng.randint(0, 0x2FF)) for _ in range(rng.randint(0, 40)))


def value(rng: random.Random) -> Any:
    return rng.choice(
        [
            lambda: rng.randint(-3, 2**40),
            lambda: rng.choice([True, None, 2.5, float("nan"), "2", [1], 10**5000, -(10**4400), 2**24 + 1]),
            lambda: text(rng),
            lambda: rng.choice(["train", "prefill", "decode"]),
            lambda: rng.choice([1, 2, 4, 8]),
        ]
    )()


def spec(rng: random.Random) -> Any:
    kind = rng.random()
    if kind < 0.6:
        return text(rng)
    if kind < 0.75:
        return f"tp={rng.choice([1, 2, 4096, 2**24])},pp={rng.choice([1, 2, 4096])},dp={rng.choice([1, 2, 4096])}"
    if kind < 0.95:
        return [
            rng.choice(
                [
                    lambda: {rng.choice(KEYS): value(rng) for _ in range(rng.randint(0, 5))},
                    lambda: text(rng),
                    lambda: None,
                    lambda: 3,
                ]
            )()
            for _ in range(rng.randint(0, 4))
        ]
    return rng.choice([None, 3, b"tp=2", {"tp": 2}])


def world(rng: random.Random) -> Any:
    return rng.choice(
        [lambda: rng.randint(-2, 4096), lambda: rng.choice([2**24, 2**24 + 1, 2**40, None, "8", 2.0, 10**5000])]
    )()


def argument(rng: random.Random, good: list[Any]) -> Any:
    """A good value of a build_shards argument, or anything else."""
    bad = [None, True, 0, -1, 2.5, float("nan"), float("inf"), 1e20, 10**5000, "abc", "", [5], {}, b"x", text(rng)]
    return rng.choice(good) if rng.random() < 0.7 else rng.choice(bad)


def build_call(rng: random.Random) -> tuple[Any, str]:
    """build_shards with random arguments, outside any torch world: a typed error, whatever they are."""
    kwargs = {
        "timeout": argument(rng, [None, 1, 0.5, 300]),
        "strategy": argument(rng, ["local", "world"]),
        "order": argument(rng, ["tp-cp-dp-pp", "tp-pp-dp"]),
        "rank_offset": argument(rng, [0, 1]),
        "allow_idle": argument(rng, [False, True]),
        "groups": argument(rng, [None, ["tp"], ("tp", "dp"), "pp"]),
        "backend": argument(rng, [None, "dtensor"]),
    }
    w, s = world(rng), spec(rng)
    return (lambda: build_shards(w, s, **kwargs)), shown((w, s, kwargs))


def one_input(rng: random.Random, folder: Path) -> tuple[str, Any, str]:
    """One input: of the spec (4 targets) half the time, else of refit (``benchmarks.manifest_inputs``)."""
    if rng.random() < 0.5:
        return refit_input(rng, folder, cli_share=0.3)
    target = rng.randrange(4)
    if target == 3:
        call, described = build_call(rng)
        return "build_shards", call, described
    if target == 0:
        s = spec(rng)
        return "parse_shards", lambda: parse_shards(s), shown(s)
    if target == 1:
        w, s, off = world(rng), spec(rng), rng.choice([0, 0, 1, 7, -1, 2**24])
        order = rng.choice(["tp-cp-dp-pp", "tp-cp-pp-dp", "tp-dp-pp", "tp-pp-dp", "bad", None])
        idle = rng.random() < 0.5
        return (
            "plan_layout",
            lambda: plan_layout(w, s, order=order, rank_offset=off, allow_idle=idle),
            shown((w, s, order, off, idle)),
        )
    number = world(rng)
    w = ("9" * 5000 if isinstance(number, int) and number > 2**40 else str(number)) if rng.random() < 0.9 else text(rng)
    s = spec(rng)
    s = s if isinstance(s, str) else text(rng)
    args = ["plan", f"--world={w}", f"--shards={s}", *rng.sample(FLAGS, rng.randint(0, 4))]
    return "plan_cli", lambda: main(args), shown(args)


SPEC_TARGETS = ("build_shards", "parse_shards", "plan_layout", "plan_cli")
"""Targets held to the time and memory budget; refit's read files (and plan_document_cli's documents) of
up to 100 KB, or plan refits, which may cost more."""
MAX_SECONDS = 0.1
MAX_BYTES = 100 * 2**20


class Worst:
    """Per target: inputs, and the costliest input by time, memory and message length."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}
        self.top: dict[tuple[str, str], tuple[float, str]] = {}

    def add(self, kind: str, index: int, described: str, measures: dict[str, float]) -> None:
        self.counts[kind] = self.counts.get(kind, 0) + 1
        for what, amount in measures.items():
            if amount > self.top.get((kind, what), (-1.0, ""))[0]:
                self.top[kind, what] = (amount, f"input {index}: {described[:200]}")

    def most(self, kind: str, what: str) -> float:
        return self.top[kind, what][0]

    def over_budget(self) -> bool:
        return any(
            self.most(kind, "seconds") > MAX_SECONDS or self.most(kind, "bytes") > MAX_BYTES
            for kind in self.counts
            if kind in SPEC_TARGETS
        )

    def report(self) -> None:
        print("| target | inputs | max CPU time / input | max allocated / input | longest message |")
        print("|---|---:|---:|---:|---:|")
        for kind in sorted(self.counts):
            print(
                f"| {kind} | {self.counts[kind]:,} | {self.most(kind, 'seconds') * 1000:.1f} ms | "
                f"{self.most(kind, 'bytes') / 2**20:.2f} MiB | {self.most(kind, 'message'):.0f} B |"
            )
        for kind in sorted(self.counts):
            print(f"slowest {kind}: {self.top[kind, 'seconds'][1]}\nlargest {kind}: {self.top[kind, 'bytes'][1]}")


def run(n: int, seed: int) -> int:
    rng = random.Random(seed)
    worst, bad = Worst(), 0
    started = time.monotonic()
    warnings.simplefilter("ignore")
    parse_shards("- {tp: 2}")  # import PyYAML once, outside the measurements
    with contextlib.suppress(ImportError):
        import torch.distributed  # noqa: F401  # likewise torch, which build_shards imports on use
    with tempfile.TemporaryDirectory() as folder:
        for i in range(n):
            kind, call, described = one_input(rng, Path(folder))
            cost = measure_input(call, cli=kind.endswith("cli"))
            if cost.problem is not None:
                bad += 1
                print(f"input {i} ({kind}): {cost.problem}", file=sys.stderr)
            measures = {"seconds": cost.seconds, "bytes": cost.peak_bytes, "message": cost.message_bytes}
            worst.add(kind, i, described, measures)
    print(f"{n} inputs, seed {seed}, {time.monotonic() - started:.0f} s wall; bad: {bad}")
    worst.report()
    return 1 if bad or worst.over_budget() else 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=100_000)
    parser.add_argument("--seed", type=int, default=0)
    options = parser.parse_args()
    sys.exit(run(options.n, options.seed))
