"""Manifests from documents: a JSON or YAML file, a mapping in the file form, or a preset name.

The file form is in ``docs/refit.md`` ("The manifest"): a ``tensors`` list, or a ``config`` (the fields of
``TransformerConfig``) from which one is generated.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ..errors import ManifestError
from ..plan.arguments import did_you_mean, shown
from ..plan.loading import load_document, read_text, shown_path
from .families import HF_PREFIX, hf_model_of
from .manifest import SCALED, Manifest, TensorSpec, check_conversion, check_dtype, tensor_label
from .models import PRESET_CONFIGS, PRESETS, TransformerConfig, manifest_from_config, preset

TENSOR_KEYS = ("name", "shape", "dtype", "tp_dim", "blocks", "unit", "layer", "stage", "expert", "to_dtype", "scale")
MANIFEST_KEYS = (
    "name",
    "layers",
    "first_stage_layers",
    "last_stage_layers",
    "experts",
    "dtype",
    "to_dtype",
    "scale",
    "tensors",
    "config",
)


def manifest_from_dict(data: Mapping[str, Any], source: str = "the manifest") -> Manifest:
    """Build a manifest from its file form: a ``tensors`` list, or a ``config`` to generate one.

    A top-level ``dtype`` is the default of tensors that give none; a top-level ``to_dtype`` (and ``scale``)
    the destination dtype of the tensors that give none, as ``Manifest.converted`` sets it: every floating tensor
    for a cast, the linear layers' weights for fp8.

    Args:
        data: the document (see ``docs/refit.md``, "The manifest").
        source: what it is, for messages (``manifest 'm.yaml'``).

    Raises:
        ManifestError: naming the source, the bad key, tensor or value, and what is expected.
    """
    if not isinstance(data, Mapping):
        raise ManifestError(f"{source} must be a mapping with 'tensors' (or 'config'); got {type(data).__name__}")
    try:
        return _from_mapping(data)
    except ManifestError as error:
        raise ManifestError(f"{source}: {error}") from None


def _from_mapping(data: Mapping[str, Any]) -> Manifest:
    unknown = [key for key in data if key not in MANIFEST_KEYS]
    if unknown and ("model_type" in data or "architectures" in data):  # every HF config.json has them
        raise ManifestError(f"this looks like a Hugging Face config.json: pass it as {HF_PREFIX}PATH")
    if unknown:
        raise ManifestError(f"unknown key {shown(unknown[0])}; allowed keys are {', '.join(MANIFEST_KEYS)}")
    name = data.get("name", "model")
    if "config" in data:
        if "tensors" in data:
            raise ManifestError("give either 'tensors' or 'config', not both")
        manifest = manifest_from_config(TransformerConfig.from_dict(data["config"]), name=name)
        if "to_dtype" not in data and "scale" not in data:
            return manifest
        return manifest.converted(data.get("to_dtype"), data.get("scale"))  # type: ignore[arg-type]
    entries = data.get("tensors")
    if isinstance(entries, (str, bytes)) or not isinstance(entries, Sequence):
        raise ManifestError(
            f"tensors={shown(entries)}: expected a list of tensor entries (name, shape, ...), or give a config"
        )
    defaults: dict[str, Any] = {"dtype": check_dtype("dtype", data["dtype"]) if "dtype" in data else "bfloat16"}
    if "to_dtype" in data or "scale" in data:
        check_conversion(data.get("to_dtype"), data.get("scale"))
        defaults.update(to_dtype=data.get("to_dtype"), scale=data.get("scale"))
    tensors = tuple(_tensor(position, entry, defaults) for position, entry in enumerate(entries))
    return Manifest(
        tensors,
        layers=data.get("layers", 0),
        first_stage_layers=data.get("first_stage_layers"),
        last_stage_layers=data.get("last_stage_layers"),
        experts=data.get("experts", 0),
        name=name,
    )


def _tensor(position: int, entry: object, defaults: Mapping[str, Any]) -> TensorSpec:
    """One entry of ``tensors``; its checks are TensorSpec's, once it has a name. ``defaults``: the dtype, and the
    model-wide conversion (to_dtype, scale) when the manifest gives one, for the tensors it converts
    (``TensorSpec.converts_by_default``) that give no to_dtype of their own."""
    if not isinstance(entry, Mapping):
        raise ManifestError(f"tensor entry {position} must be a mapping (name, shape, ...), got {shown(entry)}")
    if "name" not in entry or "shape" not in entry:
        raise ManifestError(f"tensor entry {position} needs a name and a shape")
    name = entry["name"]
    if not isinstance(name, str) or not name:
        raise ManifestError(f"tensor entry {position}: name={shown(name)}: expected a non-empty string")
    bad = [key for key in entry if key not in TENSOR_KEYS]
    if bad:
        raise ManifestError(
            f"tensor {tensor_label(name)} has unknown key {shown(bad[0])}; allowed keys are {', '.join(TENSOR_KEYS)}"
        )
    fields = {"dtype": defaults["dtype"], **entry}
    if "to_dtype" in defaults and "to_dtype" not in entry:
        unconverted = TensorSpec(**{key: value for key, value in fields.items() if key != "scale"})
        if unconverted.converts_by_default(defaults["to_dtype"]):
            fields["to_dtype"] = defaults["to_dtype"]
    if (
        defaults.get("scale") is not None
        and "scale" not in entry
        and fields.get("to_dtype") == SCALED != fields["dtype"]
    ):
        fields["scale"] = defaults["scale"]
    return TensorSpec(**fields)


MAX_MANIFEST_BYTES = 64 << 20
"""A manifest of a trillion-parameter MoE model is a few MB; more is not a manifest."""
_SHAPE = "a manifest is a mapping with a tensors list (or a config)"
_FILE = "give a JSON or YAML file"


def _path(source: object, argument: str) -> Path:
    if not isinstance(source, (str, os.PathLike)):
        raise ManifestError(f"{argument}={shown(source)}: expected a manifest file's path")
    return Path(source)


def _from_text(text: str, path: Path) -> Manifest:
    label = f"manifest {shown_path(path)}"
    return manifest_from_dict(load_document(text, label, ManifestError, _SHAPE), label)


def load_manifest(source: str | Path) -> Manifest:
    """Read a manifest from a JSON or YAML file (format in ``docs/refit.md``, "The manifest").

    Args:
        source: the file's path.

    Raises:
        ManifestError: not a path, an unreadable file, a bad document, or bad content; the message names it.
    """
    path = _path(source, "source")
    return _from_text(read_text(path, "manifest", MAX_MANIFEST_BYTES, ManifestError, _FILE), path)


def model_manifest(model: str) -> Manifest:
    """``--model FILE|PRESET|hf:PATH``: a preset by name, a Hugging Face config's Megatron manifest
    (``families.manifest_from_hf_config``), else a JSON/YAML manifest file.

    Raises:
        ManifestError: neither a preset nor a readable manifest (the message lists the presets), or
            a bad manifest file.
    """
    if isinstance(model, str) and model in PRESET_CONFIGS:
        return preset(model)
    if isinstance(model, str) and model.startswith(HF_PREFIX):
        return hf_model_of(model).manifest
    path = _path(model, "model")
    try:
        text = read_text(path, "manifest", MAX_MANIFEST_BYTES, ManifestError, _FILE)
    except ManifestError as error:
        hint = "" if os.path.exists(path) else did_you_mean(str(model), PRESETS)
        raise ManifestError(f"{error}, or name a preset: {', '.join(PRESETS)}{hint}") from None
    return _from_text(text, path)


__all__ = [
    "MANIFEST_KEYS",
    "MAX_MANIFEST_BYTES",
    "TENSOR_KEYS",
    "load_manifest",
    "manifest_from_dict",
    "model_manifest",
]
