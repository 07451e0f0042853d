"""Manifests from documents: a JSON or YAML file, a mapping in the file form, or a preset name.

The file form is in the README ("Refit"): a ``tensors`` list, or a ``config`` (the fields of
``TransformerConfig``) from which one is generated.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..errors import ManifestError
from .manifest import CONVERTIBLE, SCALED, Manifest, TensorSpec, check_conversion
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
    the destination dtype of every floating tensor that gives none.

    Raises:
        ManifestError: naming the bad key, tensor or value.
    """
    if not isinstance(data, Mapping):
        raise ManifestError(f"{source} must be a mapping with 'tensors' (or 'config'); got {type(data).__name__}")
    unknown = [key for key in data if key not in MANIFEST_KEYS]
    if unknown:
        raise ManifestError(f"{source}: unknown key {unknown[0]!r}; allowed keys are {', '.join(MANIFEST_KEYS)}")
    if "config" in data:
        if "tensors" in data:
            raise ManifestError(f"{source}: give either 'tensors' or 'config', not both")
        config = data["config"]
        if not isinstance(config, Mapping):
            raise ManifestError(f"{source}: 'config' must be a mapping of transformer sizes")
        manifest = manifest_from_config(TransformerConfig.from_dict(config), name=str(data.get("name", "model")))
        if "to_dtype" not in data and "scale" not in data:
            return manifest
        try:
            return manifest.converted(data.get("to_dtype"), data.get("scale"))  # type: ignore[arg-type]
        except ManifestError as error:
            raise ManifestError(f"{source}: {error}") from None
    entries = data.get("tensors")
    if not isinstance(entries, list):
        raise ManifestError(f"{source}: 'tensors' must be a list of tensor entries (name, shape, ...)")
    default_dtype = data.get("dtype", "bfloat16")
    default_to, default_scale = data.get("to_dtype"), data.get("scale")
    if default_to is not None or default_scale is not None:
        try:
            check_conversion(default_to, default_scale)
        except ManifestError as error:
            raise ManifestError(f"{source}: {error}") from None
    tensors = []
    for position, entry in enumerate(entries):
        if not isinstance(entry, Mapping):
            raise ManifestError(f"{source}: tensor entry {position} must be a mapping, got {entry!r}")
        bad = [key for key in entry if key not in TENSOR_KEYS]
        if bad:
            raise ManifestError(
                f"{source}: tensor {entry.get('name', position)!r} has unknown key {bad[0]!r}; "
                f"allowed keys are {', '.join(TENSOR_KEYS)}"
            )
        if "name" not in entry or "shape" not in entry:
            raise ManifestError(f"{source}: tensor entry {position} needs a name and a shape")
        fields = {key: entry[key] for key in TENSOR_KEYS if key in entry}
        fields.setdefault("dtype", default_dtype)
        if default_to is not None and "to_dtype" not in fields and fields["dtype"] in CONVERTIBLE:
            fields["to_dtype"] = default_to
        if default_scale is not None and "scale" not in fields and fields.get("to_dtype") == SCALED != fields["dtype"]:
            fields["scale"] = default_scale
        for key in ("shape", "blocks"):
            if key in fields and isinstance(fields[key], list):
                fields[key] = tuple(fields[key])
        tensors.append(TensorSpec(**fields))
    return Manifest(
        tuple(tensors),
        layers=data.get("layers", 0),
        first_stage_layers=data.get("first_stage_layers"),
        last_stage_layers=data.get("last_stage_layers"),
        experts=data.get("experts", 0),
        name=str(data.get("name", "model")),
    )


MAX_MANIFEST_BYTES = 64 << 20
"""A manifest of a trillion-parameter MoE model is a few MB; more is not a manifest."""


def load_manifest(source: str | Path) -> Manifest:
    """Read a manifest from a JSON or YAML file (format in the README).

    Args:
        source: the file's path.

    Raises:
        ManifestError: unreadable file, bad document, or bad content; the message names it.
    """
    path = Path(source)
    try:
        with path.open("rb") as file:
            raw = file.read(MAX_MANIFEST_BYTES + 1)
        text = raw.decode("utf-8")
    except (OSError, ValueError) as error:
        raise ManifestError(f"cannot read manifest {str(path)!r}: {error}; give a JSON or YAML file") from None
    if len(raw) > MAX_MANIFEST_BYTES:
        raise ManifestError(f"manifest {str(path)!r} is over {MAX_MANIFEST_BYTES} bytes")
    label = f"manifest {str(path)!r}"
    try:
        document = json.loads(text)
    except RecursionError:
        raise ManifestError(f"{label} is nested too deeply") from None
    except ValueError as json_error:
        try:
            import yaml
        except ImportError:
            raise ManifestError(f"{label} is not valid JSON ({json_error}); for YAML install PyYAML") from None
        try:
            document = yaml.load(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
        except (yaml.YAMLError, RecursionError) as yaml_error:
            detail = " ".join(str(yaml_error).split())
            raise ManifestError(f"{label} is neither JSON nor YAML: {detail}") from None
    return manifest_from_dict(document, label)


def model_manifest(model: str) -> Manifest:
    """``--model FILE|PRESET``: a preset by name, else a JSON/YAML manifest file.

    Raises:
        ManifestError: neither a preset nor a readable manifest (the message lists the presets).
    """
    if model in PRESET_CONFIGS:
        return preset(model)
    try:
        return load_manifest(model)
    except ManifestError as error:
        raise ManifestError(f"{error} (or name a preset: {', '.join(PRESETS)})") from None


__all__ = [
    "MANIFEST_KEYS",
    "MAX_MANIFEST_BYTES",
    "TENSOR_KEYS",
    "load_manifest",
    "manifest_from_dict",
    "model_manifest",
]
