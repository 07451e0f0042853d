"""Reading a Hugging Face ``config.json`` into Megatron-Core's sizes of a model of a supported family.

Which keys each family's config gives its sizes under (some under two names, as transformers 4 and 5 save
them: ``EXPERT_KEYS``), what a config may say that has no weight map yet (biases outside q/k/v, dense layers
after the first MoE one), and the vocabulary Megatron pads: all of it is read here, once
(``parse_hf_config``). ``families`` turns what this reads into an ``HFModel`` (``manifest_from_hf_config``)
and builds its tensors and weight maps from Megatron-Core's sizes alone, never from a key of the config.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..errors import ManifestError
from ..plan.arguments import check_count, shown
from .manifest import ITEMSIZES, MAX_ELEMENTS
from .models import TransformerConfig

FAMILIES = ("llama", "qwen2", "qwen3", "qwen3_moe", "deepseek_v3")
"""The Hugging Face ``model_type``s with weight maps: Llama 3 (GQA), Qwen2 (qkv bias), Qwen3 (q/k norm),
Qwen3-MoE (experts and router), DeepSeek-V3 (multi-latent attention, shared experts, dense first layers)."""

MEGATRON_VOCAB_MULTIPLE = 128 * 8
"""Megatron pads its vocabulary to ``make_vocab_size_divisible_by`` (128) x tp; padding to tp=8's multiple
lets every tp up to 8 split it."""

EXPERT_KEYS = {
    "qwen3_moe": ("num_experts", "num_local_experts"),
    "deepseek_v3": ("n_routed_experts", "num_local_experts"),
}
"""Where each MoE family's config gives its routed experts per layer: transformers 4 saves Qwen3-MoE's as
``num_experts``, transformers 5 as ``num_local_experts``; DeepSeek-V3's is ``n_routed_experts``, which
transformers 5 also reads as ``num_local_experts``. Every key is read; one that cannot be is refused, never
taken for a dense model."""

_DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16", "fp32": "float32", "bf16": "bfloat16"}


def _key(config: Mapping[str, Any], name: str, default: Any = ManifestError) -> Any:
    """The size ``name`` of an HF config (every key read here is a whole number), checked under the user's own
    key (``hidden_size``, not the ``hidden`` it becomes); ``default`` when absent, else a ManifestError."""
    if name in config and config[name] is not None:
        return check_count(f"HF config {name}", config[name], minimum=0, maximum=MAX_ELEMENTS, error=ManifestError)
    if default is ManifestError:
        raise ManifestError(
            f"HF config ({config.get('model_type')}) has no {name}: is it a config.json of a causal LM?"
        )
    return default


def parse_hf_config(config: str | Path | Mapping[str, Any], vocab_multiple: int) -> tuple[str, TransformerConfig, int]:
    """A Hugging Face ``config.json``'s family (its ``model_type``), Megatron-Core's config of it (the vocabulary
    padded to a multiple of ``vocab_multiple``) and its own vocabulary size (unpadded).

    Raises:
        ManifestError: as ``families.manifest_from_hf_config``.
    """
    data = _read_config(config)
    family = data.get("model_type")
    if family not in FAMILIES:
        raise ManifestError(
            f"HF model_type {shown(family)} has no weight map: supported families are {', '.join(FAMILIES)}"
        )
    vocab = _key(data, "vocab_size")
    layers = _key(data, "num_hidden_layers")
    dtype = _DTYPES.get(str(data.get("torch_dtype") or data.get("dtype") or "float32").removeprefix("torch."))
    if dtype is None or dtype not in ITEMSIZES:
        raise ManifestError(
            f"HF config torch_dtype {shown(data.get('torch_dtype'))}: expected float32, bfloat16 or float16"
        )
    for key, unsupported in (("attention_bias", family != "qwen2"), ("mlp_bias", True)):
        if data.get(key) and unsupported:
            raise ManifestError(f"HF config {key}=true ({family}): biases outside q/k/v have no weight map yet")
    check = check_multiple(vocab_multiple)
    sizes: dict[str, Any] = {  # what every family's config says alike
        "layers": layers,
        "hidden": _key(data, "hidden_size"),
        "ffn": _key(data, "intermediate_size"),
        "heads": _key(data, "num_attention_heads"),
        "vocab": -(-vocab // check) * check,
        "tied_embeddings": bool(data.get("tie_word_embeddings", False)),
        "dtype": dtype,
    }
    make = _deepseek if family == "deepseek_v3" else _llama_like
    transformer = make(data, family, sizes)
    return family, transformer, vocab


def _llama_like(data: Mapping[str, Any], family: str, sizes: dict[str, Any]) -> TransformerConfig:
    """Llama 3, Qwen2, Qwen3 and Qwen3-MoE: GQA, qkv bias (Qwen2), q/k norms (Qwen3), experts (Qwen3-MoE)."""
    experts = _experts(data, family) if family == "qwen3_moe" else 0
    dense_layers = 0
    if experts:
        only = list(data.get("mlp_only_layers") or [])
        if _key(data, "decoder_sparse_step", 1) != 1 or only != list(range(len(only))):
            raise ManifestError(
                f"HF config ({family}): decoder_sparse_step={data.get('decoder_sparse_step')}, mlp_only_layers="
                f"{shown(only)}: only the first layers may be dense (mlp_only_layers = [0 .. k-1], sparse step 1)"
            )
        dense_layers = len(only)
    return TransformerConfig(
        **sizes,
        kv_heads=_key(data, "num_key_value_heads", None),
        head_dim=_key(data, "head_dim", None),
        experts=experts,
        moe_ffn=_key(data, "moe_intermediate_size") if experts else None,
        dense_layers=dense_layers,
        qkv_bias=family == "qwen2",
        qk_norm=family in ("qwen3", "qwen3_moe"),
    )


def _deepseek(data: Mapping[str, Any], family: str, sizes: dict[str, Any]) -> TransformerConfig:
    """DeepSeek-V3's config (``deepseek_v3``): MLA sizes, routed and shared experts, the first layers dense."""
    if _key(data, "moe_layer_freq", 1) != 1:
        raise ManifestError(
            f"HF config ({family}): moe_layer_freq={data.get('moe_layer_freq')}: only the first "
            f"first_k_dense_replace layers may be dense (moe_layer_freq 1)"
        )
    experts = _experts(data, family)
    return TransformerConfig(
        **sizes,
        experts=experts,
        moe_ffn=_key(data, "moe_intermediate_size") if experts else None,
        shared_experts=int(_key(data, "n_shared_experts", 0) or 0) if experts else 0,
        dense_layers=min(int(_key(data, "first_k_dense_replace", 0)), sizes["layers"]) if experts else 0,
        q_lora_rank=_key(data, "q_lora_rank", None),
        kv_lora_rank=_key(data, "kv_lora_rank"),
        qk_head_dim=_key(data, "qk_nope_head_dim"),
        qk_pos_emb_head_dim=_key(data, "qk_rope_head_dim"),
        v_head_dim=_key(data, "v_head_dim"),
    )


def _experts(data: Mapping[str, Any], family: str) -> int:
    """The routed experts per MoE layer of a ``family`` config, from every key transformers saves it under
    (``EXPERT_KEYS``); 0 is a model whose layers are all dense.

    Raises:
        ManifestError: no key gives the count, one gives no non-negative integer, or two give different ones.
    """
    keys = EXPERT_KEYS[family]
    given = {key: data[key] for key in keys if data.get(key) is not None}
    if not given:
        raise ManifestError(
            f"HF config ({family}) has no expert count: expected {' or '.join(keys)} (the routed experts per MoE "
            f"layer); pass the model's own config.json, as transformers saves it"
        )
    for key, value in given.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ManifestError(
                f"HF config ({family}) {key}={shown(value)}: expected the routed experts per MoE layer, an integer >= 0"
            )
    if len(set(given.values())) > 1:
        both = ", ".join(f"{key}={value}" for key, value in given.items())
        raise ManifestError(f"HF config ({family}) gives two expert counts, {both}: keep one of them")
    return int(next(iter(given.values())))


def check_multiple(value: object) -> int:
    """``vocab_multiple``, checked: a positive integer (Megatron pads the vocabulary to a multiple of it)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ManifestError(f"vocab_multiple={shown(value)}: expected a positive integer, e.g. 1024")
    return value


def _read_config(config: str | Path | Mapping[str, Any]) -> Mapping[str, Any]:
    if isinstance(config, Mapping):
        return config
    if not isinstance(config, (str, Path)):
        raise ManifestError(f"config={shown(config)}: expected the path of a config.json or its contents")
    path = Path(config)
    if path.is_dir():
        path = path / "config.json"
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise ManifestError(f"cannot read HF config {path}: {error}") from None
    if not isinstance(data, Mapping):
        raise ManifestError(f"HF config {path}: expected a JSON object")
    return data


__all__ = ["EXPERT_KEYS", "FAMILIES", "MEGATRON_VOCAB_MULTIPLE", "check_multiple", "parse_hf_config"]
