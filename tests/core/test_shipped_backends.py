"""The shipped backends have one table, ``SHIPPED_BACKENDS``; every other place that must list them is checked
against it here: the plugin folders, tox's envs, and pyproject's mypy paths and first-party modules. The other
plugin folders integrate an inference engine (``ENGINE_PLUGINS``: shardcore as vLLM's weight-transfer backend),
not a backend of ``build_shards``; each has a tox env and is typed and sorted too."""

from __future__ import annotations

import configparser
import tomllib
from pathlib import Path

from shardcore.engine import SHIPPED_BACKENDS, install_hint

ROOT = Path(__file__).resolve().parents[2]
ENGINE_PLUGINS = ("vllm",)
"""Plugins that plug shardcore into an inference engine (``plugins/NAME``, module ``shardcore_NAME``)."""


def test_every_shipped_backend_has_its_plugin_folder_and_no_other_folder_is_one() -> None:
    folders = sorted(path.name for path in (ROOT / "plugins").iterdir() if (path / "pyproject.toml").is_file())
    assert folders == sorted((*SHIPPED_BACKENDS, *ENGINE_PLUGINS))


def test_tox_has_one_env_per_shipped_backend() -> None:
    tox = configparser.ConfigParser()
    tox.read(ROOT / "tox.ini")
    envs = [env.strip() for env in tox["tox"]["env_list"].split(",")]
    releases = [env for env in envs if env[-1].isdigit()]  # the newest releases: torch214, megatron019
    plugins = (*SHIPPED_BACKENDS, *ENGINE_PLUGINS)
    assert sorted(env for env in envs if env not in ("lint", "core", *releases)) == sorted(plugins)
    assert all(env.rstrip("0123456789") in ("torch", *SHIPPED_BACKENDS) for env in releases), releases
    for backend in plugins:
        assert f"{{tox_root}}/plugins/{backend}" in tox[f"testenv:{backend}"]["deps"], backend


def test_pyproject_types_and_sorts_every_shipped_plugin() -> None:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    mypy_files = pyproject["tool"]["mypy"]["files"]
    first_party = pyproject["tool"]["ruff"]["lint"]["isort"]["known-first-party"]
    for backend in (*SHIPPED_BACKENDS, *ENGINE_PLUGINS):
        assert f"plugins/{backend}/shardcore_{backend}" in mypy_files, backend
        assert f"shardcore_{backend}" in first_party, backend


def test_the_install_hint_names_every_shipped_backend() -> None:
    hint = install_hint()
    assert all(backend in hint for backend in SHIPPED_BACKENDS), hint
