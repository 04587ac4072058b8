"""Running a ``TritonPythonModel``'s ``auto_complete_config`` and taking what it set.

The hook gets a :class:`~.model_config.ModelConfig` built from the model's configuration as
Triton's JSON (``dynamic_batching`` only where the configuration sets it, so
``set_dynamic_batching`` means something), returns it, and gpuserve takes from the returned
object ``max_batch_size``, ``input``/``output`` (``data_type``, ``dims``, ``optional``), a
``dynamic_batching`` it added and ``model_transaction_policy.decoupled``: the fields Triton
lets the hook set (:mod:`gpuserve.backends.completion`). The result is validated as a
``config.yaml`` is and must declare inputs and outputs.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from gpuserve.backends.completion import validate_completed
from gpuserve.backends.triton_python.model_config import ModelConfig as TritonModelConfig
from gpuserve.config import ModelConfig
from gpuserve.config.triton import triton_model_config_dict
from gpuserve.datatypes import TRITON_DATATYPES
from gpuserve.errors import ConfigError

HOOK = "auto_complete_config"


def hook_of(cls: type) -> Any:
    """``cls.auto_complete_config`` when the class defines it (a static method), else None."""
    return getattr(cls, HOOK, None)


def starting_point(config: ModelConfig) -> dict[str, Any]:
    """The configuration as the hook sees it (``as_dict()``): Triton's ModelConfig JSON."""
    name = config.name or ""
    data = triton_model_config_dict(name, "python", config)
    data["platform"] = ""  # Triton's Python models name a backend, no platform
    if "dynamic_batching" not in config.model_fields_set:
        data.pop("dynamic_batching", None)
    if config.model_transaction_policy.decoupled:
        data["model_transaction_policy"] = {"decoupled": True}
    return data


def _tensor(entry: Any, kind: str, index: int, where: Path, keep: dict[str, Any]) -> dict[str, Any]:
    """One ``input``/``output`` entry of the hook's result as a gpuserve tensor spec."""
    at = f"{kind}[{index}]"
    if not isinstance(entry, dict):
        raise ConfigError(f"{where}: {HOOK} left {at} as {entry!r}; expected a mapping")
    data_type = entry.get("data_type")
    if data_type not in TRITON_DATATYPES:
        raise ConfigError(
            f"{where}: {HOOK} gave {at} ({entry.get('name')!r}) data_type {data_type!r}; "
            f"expected one of {', '.join(TRITON_DATATYPES)}"
        )
    dims = entry.get("dims")
    if not isinstance(dims, list) or not all(isinstance(d, int) for d in dims):
        raise ConfigError(
            f"{where}: {HOOK} gave {at} ({entry.get('name')!r}) dims {dims!r}; expected a "
            "list of integers"
        )
    spec = dict(keep.get(entry.get("name", ""), {}))  # reshape, format, ... stay as declared
    spec.update(name=entry.get("name", ""), datatype=TRITON_DATATYPES[data_type], shape=dims)
    if kind == "input" and "optional" in entry:
        spec["optional"] = bool(entry["optional"])
    return spec


def completed_config(config: ModelConfig, result: dict[str, Any], where: Path) -> ModelConfig:
    """``config`` with the fields the hook may set taken from ``result`` (its ``as_dict()``).

    Raises:
        ConfigError: a field of the wrong type, or the completed configuration is invalid
            or still lacks inputs or outputs.
    """
    data = config.model_dump(exclude_unset=True)
    try:
        data["max_batch_size"] = int(result.get("max_batch_size") or 0)
    except (TypeError, ValueError):
        raise ConfigError(
            f"{where}: {HOOK} set max_batch_size {result.get('max_batch_size')!r}; expected "
            "an integer"
        ) from None
    for kind, label in (("input", "inputs"), ("output", "outputs")):
        keep = {spec.name: spec.model_dump(exclude_unset=True) for spec in getattr(config, label)}
        entries = result.get(kind) or []
        data[label] = [_tensor(e, kind, i, where, keep) for i, e in enumerate(entries)]
    if "dynamic_batching" in result and "dynamic_batching" not in config.model_fields_set:
        data["dynamic_batching"] = {}  # the dynamic batcher with its defaults
    policy = result.get("model_transaction_policy") or {}
    if policy.get("decoupled"):
        data["model_transaction_policy"] = {"decoupled": True}
    return validate_completed(data, config.name or where.parent.parent.name, where, HOOK)


def auto_complete(cls: type, config: ModelConfig, version_path: Path) -> ModelConfig:
    """Run ``cls.auto_complete_config`` on ``config`` (the model's, validated but possibly
    without inputs and outputs) and return the completed configuration.

    Raises:
        ConfigError: the hook raised (its message, as Triton reports it), returned something
            else than the object it was given, or left an invalid configuration.
    """
    where = version_path / "model.py"
    hook = hook_of(cls)
    given = TritonModelConfig(json.dumps(starting_point(config)))
    try:
        returned = hook(given)
    except Exception as err:  # user code: any failure is a load failure with its cause
        raise ConfigError(f"{where}: {HOOK} failed: {err}") from err
    if not isinstance(returned, TritonModelConfig):
        raise ConfigError(
            f"{where}: {HOOK} must return the pb_utils.ModelConfig it was given, got "
            f"{type(returned).__name__}"
        )
    return completed_config(config, returned.as_dict(), where)
