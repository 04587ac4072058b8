"""A Python model completing its own configuration at load (Triton's auto-complete).

Both kinds of ``model.py`` may fill in what their configuration leaves out, once per version,
before the configuration is validated and anything is built:

* gpuserve's ``Model`` (a :class:`~gpuserve.backends.python.PythonModel`) through the
  classmethod ``complete_config(config) -> ModelConfig``, which returns the configuration to
  serve with (``config.model_copy(update={...})``);
* Triton's ``TritonPythonModel`` through ``auto_complete_config(auto_complete_model_config)``
  (:mod:`gpuserve.backends.triton_python.auto_complete`).

The same rules hold for both, Triton's: the hook may set ``max_batch_size`` (never below a
value the configuration sets), add inputs and outputs (one the configuration already declares
keeps its datatype and shape), turn on dynamic batching and set
``model_transaction_policy.decoupled`` (never flipping a value the configuration sets).
Nothing else may change. The completed configuration then goes through the full validation
of a ``config.yaml``, and must declare its inputs and outputs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gpuserve.config import ModelConfig, TensorSpec, parse_model_config
from gpuserve.errors import ConfigError

#: The fields a model's completion may change.
COMPLETABLE = frozenset(
    {"max_batch_size", "inputs", "outputs", "dynamic_batching", "model_transaction_policy"}
)


def _describe(spec: TensorSpec) -> str:
    return f"{spec.datatype} {spec.shape}" + (" optional" if spec.optional else "")


def check_completion(before: ModelConfig, after: Any, where: Path, hook: str) -> ModelConfig:
    """Check what a model's ``hook`` made of its configuration and validate the result.

    Args:
        before: The configuration the hook was given.
        after: What it returned (should be a :class:`ModelConfig`).
        where: The ``model.py`` (named in every error).
        hook: The hook's name, for the errors (``Model.complete_config``).

    Returns:
        The completed configuration, validated as a ``config.yaml`` is.

    Raises:
        ConfigError: it returned something else than a ModelConfig, changed a field it may
            not change, changed a declared tensor or lowered a configured ``max_batch_size``,
            left inputs or outputs empty, or the result is invalid; names the field and both
            values.
    """
    if not isinstance(after, ModelConfig):
        raise ConfigError(
            f"{where}: {hook} must return the ModelConfig (config.model_copy(update=...)), "
            f"got {type(after).__name__}"
        )
    old = before.model_dump()
    new = after.model_dump()
    changed = sorted(key for key in old if key not in COMPLETABLE and old[key] != new[key])
    if changed:
        raise ConfigError(
            f"{where}: {hook} may only change {', '.join(sorted(COMPLETABLE))}; it changed "
            f"{', '.join(changed)} (from {old[changed[0]]!r} to {new[changed[0]]!r})"
        )
    if "max_batch_size" in before.model_fields_set and after.max_batch_size < before.max_batch_size:
        raise ConfigError(
            f"{where}: {hook} set max_batch_size {after.max_batch_size}, below the configured "
            f"max_batch_size {before.max_batch_size}"
        )
    if before.model_transaction_policy.decoupled and not after.model_transaction_policy.decoupled:
        raise ConfigError(
            f"{where}: {hook} turned model_transaction_policy.decoupled off; the "
            "configuration sets it to true"
        )
    for label in ("inputs", "outputs"):
        made = {spec.name: spec for spec in getattr(after, label)}
        for spec in getattr(before, label):
            other = made.get(spec.name)
            if other is None:
                raise ConfigError(
                    f"{where}: {hook} dropped {label[:-1]} {spec.name!r}, which the "
                    "configuration declares"
                )
            if other != spec:
                raise ConfigError(
                    f"{where}: {hook} changed {label[:-1]} {spec.name!r}: the configuration "
                    f"declares {_describe(spec)}, the model gives {_describe(other)}"
                )
    data = after.model_dump(exclude_unset=True)
    for key in COMPLETABLE:
        if new[key] != old[key]:
            data[key] = new[key]
    return validate_completed(data, before.name or where.parent.parent.name, where, hook)


def validate_completed(data: dict[str, Any], name: str, where: Path, hook: str) -> ModelConfig:
    """Validate a completed configuration (``config.yaml``'s fields) of model ``name``.

    Raises:
        ConfigError: invalid, or without inputs or outputs (the hook should have added
            them); names ``where`` and the field.
    """
    config = parse_model_config(data, where, name)
    missing = [label for label in ("inputs", "outputs") if not getattr(config, label)]
    if missing:
        raise ConfigError(
            f"{where}: model '{name}' has no {' and no '.join(missing)} after {hook}: "
            f"declare them in the model's configuration or add them in {hook}"
        )
    return config


def require_declared(config: ModelConfig, version_path: Path) -> None:
    """Refuse a configuration without inputs or outputs when nothing may fill them in (the
    server runs with ``--disable-auto-complete-config``).

    Raises:
        ConfigError: names the model and what it lacks.
    """
    missing = [label for label in ("inputs", "outputs") if not getattr(config, label)]
    if missing:
        raise ConfigError(
            f"{version_path.parent}: model '{config.name}' declares no "
            f"{' and no '.join(missing)}, and auto-complete is off on this server "
            "(--disable-auto-complete-config): declare them in its configuration"
        )
