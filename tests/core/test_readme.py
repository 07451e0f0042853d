"""The documentation's blocks that need no torch run as written (``tests/readme.py`` says how); every block
runs somewhere in CI, is shown as output or data, or says why it cannot run; every relative link resolves."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.readme import ENVS, ROOT, Block, blocks, blocks_for, documents, every_block, run_block

BLOCKS = every_block()
_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
_HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$")


def test_every_block_runs_in_ci_is_shown_or_says_why_not() -> None:
    assert len(BLOCKS) >= 40  # README.md's, docs/'s and the plugins'
    problems = [f"{block.name}: {block.problem}" for block in BLOCKS if block.problem is not None]
    assert not problems, "\n".join(problems)


def test_every_page_is_covered() -> None:
    """README.md, every page under docs/ and every plugin's README (each with at least one program)."""
    pages = documents()
    assert ROOT / "README.md" in pages and ROOT / "docs" / "index.md" in pages
    assert {path.parent.name for path in pages if path.parent.parent == ROOT / "plugins"} >= {
        "dtensor",
        "megatron",
        "hyperparallel",
    }
    for page in pages:
        assert any(block.language in ("python", "bash", "sh") for block in blocks(page)), f"{page}: no example"


def test_the_runner_reads_indented_fences_and_refuses_blocks_that_neither_run_nor_say_why(tmp_path: Path) -> None:
    """An indented fence inside a list item is read (without its indent) and run; an untagged fence, a block
    in another language, a '# not run' without a reason and an unknown env are each a problem, named."""
    page = tmp_path / "page.md"
    page.write_text(
        "# A page\n\n"
        "- a list item:\n\n"
        "  ```bash\n"
        "  shardcore plan --world 4 --shards 'tp=2+tp=2' --json > plan.json && grep -q world_size plan.json\n"
        "  ```\n"
        "- and its output:\n\n"
        "    ```text\n    4 ranks\n    ```\n\n"
        "```\nshardcore plan --world 4\n```\n\n"
        "```rust\nfn main() {}\n```\n\n"
        "```python\n# not run: no\nprint(1)\n```\n\n"
        "```python\n# runs in the nowhere env\nprint(1)\n```\n\n"
        "```python\n# runs in the vllm env\nimport vllm\n```\n\n"
        "```bash\nshardcore plan --world 4 --shards tp=4 [--json]\n```\n\n"
        "~~~python\nprint('tilde')\n~~~\n"
        "```python\nprint('never closed')\n",
        encoding="utf-8",
    )
    found = blocks(page)
    assert [block.line for block in found] == [5, 10, 14, 18, 22, 27, 32, 37, 41, 44]
    indented, output, untagged, rust, no_reason, nowhere, vllm, brackets, tilde, unclosed = found
    assert indented.language == "bash" and indented.code.startswith("shardcore plan ") and indented.env == "core"
    run_block(indented, tmp_path)  # runs, as written, without the list item's indent
    assert output.problem is None and output.env is None and output.code == "4 ranks\n"
    assert untagged.problem is not None and "no tag" in untagged.problem
    assert rust.problem is not None and "'rust'" in rust.problem
    assert no_reason.problem is not None and "reason" in no_reason.problem and no_reason.env is None
    assert nowhere.problem is not None and "'nowhere'" in nowhere.problem
    assert vllm.problem is None and vllm.env == "vllm" and "vllm" in ENVS
    assert brackets.problem is not None and "brackets" in brackets.problem
    assert tilde.problem is None and tilde.env == "core"
    assert unclosed.problem == "its fence is never closed"
    for bad in (untagged, no_reason):
        with pytest.raises(AssertionError, match="does not run"):
            run_block(bad, tmp_path)


def test_blocks_are_split_between_envs() -> None:
    """Each runnable block runs in exactly one env; the vLLM and Megatron ones only in their own."""
    envs = {block.name: block.env for block in BLOCKS if block.env is not None}
    assert set(envs.values()) <= {"core", "dtensor", *ENVS}
    assert {"core", "dtensor", "megatron"} <= set(envs.values())
    for env in ("core", "dtensor", *ENVS):
        assert all(block.env == env for block in blocks_for(env))


def _prose(page: Path) -> list[str]:
    """The lines of ``page`` outside its fenced blocks (a block's ``line`` is its opening fence's)."""
    inside = {block.line + offset for block in blocks(page) for offset in range(block.code.count("\n") + 2)}
    lines = page.read_text(encoding="utf-8").split("\n")
    return [line for number, line in enumerate(lines, start=1) if number not in inside]


def _anchors(page: Path) -> set[str]:
    """GitHub's heading anchors of ``page`` (lowercased, punctuation dropped, spaces as hyphens, repeats numbered)."""
    seen: dict[str, int] = {}
    for line in _prose(page):
        heading = _HEADING.match(line)
        if heading is None:
            continue
        slug = re.sub(r"[^\w\- ]", "", heading.group(1).lower().replace("`", "")).replace(" ", "-")
        seen[slug] = seen.get(slug, -1) + 1
    return {slug if count == 0 else f"{slug}-{count}" for slug, counts in seen.items() for count in range(counts + 1)}


def test_every_relative_link_resolves() -> None:
    """Every link of README.md, docs/ and the plugins' READMEs to a file of this repository names a file that
    exists, and a heading it has where it names one (``page.md#heading``)."""
    broken = []
    for page in documents():
        for target in _LINK.findall("\n".join(_prose(page))):  # links inside code are code
            if re.match(r"^[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            if not file.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and file.suffix == ".md" and anchor not in _anchors(file):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


@pytest.mark.parametrize("block", blocks_for("core"), ids=lambda block: block.name)
def test_block_runs_without_torch(block: Block, tmp_path: Path) -> None:
    run_block(block, tmp_path)


def test_ci_runs_the_readmes_test_command() -> None:
    """The README's "run every test" command is what CI runs (``.ci/run``), so the two cannot drift apart."""
    commands = [
        line.strip()
        for block in blocks(ROOT / "README.md")
        for line in block.code.split("\n")
        if "tox" in line and not line.lstrip().startswith("#")
    ]
    assert commands == ["python3 -m tox -p 2"]
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text(encoding="utf-8").split("\n")]
    assert commands[0] in ci
