"""The trainer job of the vLLM tests, and the models both sides hold.

Models are made from a config with weights drawn from a seed (``layout_workers.reference_model``) and saved as
a checkpoint folder: the engine starts on B's; the trainer, a 2-rank gloo job of its own (Megatron tp=2),
holds A: A's weights packed as Megatron-Core holds them (``layout_workers.megatron_globals``), cut into its
rank's shard (``refit_check.cut``), by Megatron's global names, as ``shardcore_megatron.refit.model_tensors``
gives them from a live model; ``megatron_trainer_job`` sends from such a live model itself.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from shardcore import ShardcoreError
from shardcore.engine.live.refit_check import cut
from shardcore.plan.layout import plan_layout
from shardcore.refit import manifest_from_hf_config
from shardcore_vllm import RefitSetup, Trainer
from tests.engine.layout_workers import megatron_globals, reference_model

TRAINER_SPEC = "tp=2"
BASE = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "vocab_size": 1000,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "torch_dtype": "float32",
}
FAMILIES: dict[str, dict[str, Any]] = {
    "qwen2": {"model_type": "qwen2"},
    "llama": {"model_type": "llama"},
    "qwen3": {"model_type": "qwen3"},
    "qwen2-tied": {"model_type": "qwen2", "tie_word_embeddings": True},
    "qwen3-moe": {
        "model_type": "qwen3_moe",
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 64,
        "norm_topk_prob": True,
    },
}
PROMPTS = [[3, 17, 42, 9, 77, 5, 61, 20], [11, 2, 500, 7], [(7 * i + 3) % 997 for i in range(150)]]
"""Token prompts; the last is longer than one KV block (128 tokens), so a stale prefix cache would show."""
NEW_TOKENS = 12


def config_of(family: str) -> dict[str, Any]:
    """The family's HF config (``num_experts`` for shardcore beside transformers 5's own key)."""
    return {**BASE, **FAMILIES[family]}


def save_model(config: dict[str, Any], seed: int, folder: Path) -> Path:
    """A checkpoint folder of ``config`` with weights drawn from ``seed``."""
    model = reference_model(config, seed)
    model.save_pretrained(folder)
    return folder


def hf_tokens(folder: Path, prompts: list[list[int]] = PROMPTS) -> list[list[int]]:
    """transformers' greedy tokens of the checkpoint in ``folder``: the argmax of each step's logits, past any
    end-of-sequence id (as vLLM with ``ignore_eos``; ``generate``'s ``min_new_tokens`` would mask that id)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            for _ in range(NEW_TOKENS):
                ids = torch.cat([ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
            out.append(ids[0, len(prompt) :].tolist())
    return out


def shard_sources(config: dict[str, Any], folder: Path, setup: RefitSetup, rank: int) -> dict[str, torch.Tensor]:
    """This trainer rank's Megatron shard of the checkpoint in ``folder``, by Megatron's global names."""
    from safetensors.torch import load_file

    model = manifest_from_hf_config(config)
    state = {}
    for path in sorted(folder.glob("*.safetensors")):
        state.update(load_file(path))
    full = megatron_globals(state, model)
    layout = plan_layout(setup.trainer_ranks + setup.engine_ranks(), f"{setup.trainer_spec} + {setup.engine_spec}")
    shard = layout.shards[0]
    manifest = model.manifest
    return {t.name: cut(full[t.name], t, shard, rank, manifest) for t in manifest if t.name in full}


def trainer_job(
    rank: int,
    world: int,
    setup: dict[str, Any],
    config: dict[str, Any],
    folders: list[str],
    rejoin: dict[str, Any] | None = None,
) -> Any:
    """Join the refit group, then send each folder's weights as one update (version = its position + 1).

    Returns per update this rank's bytes sent and seconds, or ``{"error": "TypeName: message", "seconds"}``
    for a shardcore error (and whether the trainer's own world still answers an all-reduce then). With
    ``rejoin`` (``{"setup": RefitSetup's dict, "report": path}``), after such an error the same job writes the
    error to ``report.<rank>``, joins the group of ``rejoin["setup"]`` (a restarted engine) and sends it the
    first folder's weights as one full update (``"rejoined"``: bytes sent and seconds)."""
    terms = RefitSetup(**setup)
    started = time.monotonic()
    trainer: Trainer | None = None
    try:
        trainer = Trainer(terms, rank)
        sources = {folder: shard_sources(config, Path(folder), terms, rank) for folder in set(folders)}
        sent = [_sent(trainer.send(sources[folder], version=version)) for version, folder in enumerate(folders, 1)]
        trainer.close()
        return {"sent": sent}
    except ShardcoreError as error:
        total = torch.ones(1)
        torch.distributed.all_reduce(total)
        out = {
            "error": f"{type(error).__name__}: {error}",
            "seconds": time.monotonic() - started,
            "world": float(total.item()),
        }
    if rejoin is None:
        return out
    if trainer is not None:
        trainer.close()
    Path(f"{rejoin['report']}.{rank}").write_text(out["error"])
    again = RefitSetup(**rejoin["setup"])
    fresh = Trainer(again, rank)
    out["rejoined"] = _sent(fresh.send(shard_sources(config, Path(folders[0]), again, rank), version=len(folders) + 1))
    fresh.close()
    return out


def _sent(stats: list[Any]) -> tuple[int, float]:
    """One update's bytes sent and seconds on this rank."""
    return sum(s.bytes_sent for s in stats), sum(s.seconds for s in stats)


def megatron_gpt(config: dict[str, Any], spec: str) -> Any:
    """This rank's live Megatron-Core ``GPTModel`` of the HF ``config`` (a dense Qwen2 or Llama: RMSNorm, SwiGLU,
    GQA, rope, the qkv bias where the config has one, the vocabulary padded as shardcore's manifest pads it),
    over shardcore's ProcessGroupCollection of ``spec`` in the running world. Its forward pass is not run
    (Megatron's attention needs CUDA): it is the trainer's model whose tensors are sent."""
    from plugins.megatron.tests.megatron_recipe import quiet
    from shardcore import build_shards

    c = manifest_from_hf_config(config).config
    shard = build_shards(torch.distributed.get_world_size(), spec, backend="megatron")[0]
    with quiet():
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.transformer.transformer_config import TransformerConfig

        megatron_config = TransformerConfig(
            num_layers=c.layers,
            hidden_size=c.hidden,
            ffn_hidden_size=c.ffn,
            num_attention_heads=c.heads,
            num_query_groups=c.kv_heads,
            kv_channels=c.head_dim,
            normalization="RMSNorm",
            layernorm_epsilon=config["rms_norm_eps"],
            gated_linear_unit=True,
            add_bias_linear=False,
            add_qkv_bias=c.qkv_bias,
            hidden_dropout=0.0,
            attention_dropout=0.0,
            use_cpu_initialization=True,
            tensor_model_parallel_size=shard.spec.tp,
            params_dtype=torch.float32,
        )
        return GPTModel(
            megatron_config,
            get_gpt_layer_local_spec(normalization="RMSNorm"),
            vocab_size=c.vocab,
            max_sequence_length=config["max_position_embeddings"],
            share_embeddings_and_output_weights=c.tied_embeddings,
            pg_collection=shard.handle,
            position_embedding_type="rope",
        ).eval()


def megatron_trainer_job(
    rank: int, world: int, setup: dict[str, Any], config: dict[str, Any], folders: list[str]
) -> Any:
    """The trainer as an RL job runs it: a live Megatron-Core model (``megatron_gpt``) whose parameters are set
    to each folder's weights in turn (a training step's result), each sent as one update from
    ``shardcore_megatron.refit.model_tensors(model)``.

    Returns the names ``model_tensors`` gives and this rank's shard of the checkpoint lacks or adds (none
    expected), and each update's bytes sent."""
    from shardcore_megatron.refit import model_tensors

    terms = RefitSetup(**setup)
    model = megatron_gpt(config, terms.trainer_spec)
    trainer = Trainer(terms, rank)
    sent, differ = [], set()
    for version, folder in enumerate(folders, start=1):
        shard = shard_sources(config, Path(folder), terms, rank)
        live = model_tensors(model)
        differ |= set(live) ^ set(shard)
        with torch.no_grad():
            for name in live.keys() & shard.keys():
                live[name].copy_(shard[name])
        sent.append(_sent(trainer.send(model_tensors(model), version=version)))
    trainer.close()
    return {"differ": sorted(differ), "sent": sent}


def trainer_api_job(rank: int, world: int, init: dict[str, Any], config: dict[str, Any], folder: str, url: str) -> Any:
    """The trainer written against vLLM's trainer-side API: ``WeightTransferTrainerFactory.trainer_init`` with
    the ``shardcore`` init info, vLLM's HTTP routes as the client, one ``send_weights``."""
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    import shardcore_vllm
    from shardcore_vllm import HTTPClient, ShardcoreTrainerInitInfo, ShardSource

    shardcore_vllm.register()
    info = ShardcoreTrainerInitInfo(rank=rank, **init)
    sources = shard_sources(config, Path(folder), info, rank)
    engine = WeightTransferTrainerFactory.trainer_init(info, client=HTTPClient(url), source=ShardSource(sources))
    engine.send_weights(version=7)
    engine.shutdown()
    return {"sender": engine.is_sender}
