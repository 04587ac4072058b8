"""``pb_utils.ModelConfig``: the object Triton's ``auto_complete_config`` hook receives.

A ``TritonPythonModel`` may define a static method
``auto_complete_config(auto_complete_model_config)``; it is called once when a version
loads, before the configuration is validated, with this object built from the model's configuration as Triton's ModelConfig JSON (``as_dict()``:
``name``, ``max_batch_size``, ``input``/``output`` with ``data_type: TYPE_*`` and ``dims``,
...), and returns it. Only what Triton lets the hook change can be changed, through these
methods, each refusing what Triton refuses (with a ``ValueError`` whose text says which model,
tensor and value):

* :meth:`ModelConfig.set_max_batch_size`: not below a non-zero ``max_batch_size`` the
  configuration sets;
* :meth:`ModelConfig.set_dynamic_batching`: not when the model uses the sequence batcher or is
  an ensemble;
* :meth:`ModelConfig.add_input` / :meth:`ModelConfig.add_output`: a new tensor, or one the
  configuration declares with the same ``data_type`` and ``dims`` (a declared tensor without
  ``dims`` gets them);
* :meth:`ModelConfig.set_model_transaction_policy`: ``decoupled`` only, and never flipped
  once the configuration sets it.

What the backend then takes from the returned object is exactly those fields
(:mod:`gpuserve.backends.triton_python.auto_complete`).
"""

from __future__ import annotations

import copy
import json
from typing import Any

_INPUT_KEYS = ("name", "data_type", "dims", "optional")
_OUTPUT_KEYS = ("name", "data_type", "dims")


class ModelConfig:
    """A model's configuration as Triton's ModelConfig JSON, completed by the model.

    Args:
        model_config: The configuration as a JSON string (as Triton passes it) or a dict
            (copied).
    """

    def __init__(self, model_config: str | dict[str, Any]) -> None:
        data = json.loads(model_config) if isinstance(model_config, str) else model_config
        self._config: dict[str, Any] = copy.deepcopy(data)
        self._config.setdefault("max_batch_size", 0)
        self._config.setdefault("input", [])
        self._config.setdefault("output", [])

    @property
    def _name(self) -> str:
        return str(self._config.get("name", ""))

    def as_dict(self) -> dict[str, Any]:
        """The configuration as it stands (Triton's JSON field names); read it, change it only
        through the ``set_*``/``add_*`` methods."""
        return self._config

    def set_max_batch_size(self, max_batch_size: int) -> None:
        """Set ``max_batch_size`` (rows per batch; 0: the model does not batch).

        Raises:
            ValueError: the configuration sets a larger non-zero value.
        """
        configured = int(self._config.get("max_batch_size") or 0)
        if configured > max_batch_size:
            raise ValueError(
                f"configuration specified max_batch_size {configured}, but in "
                f"auto-complete-config function for model '{self._name}' specified "
                f"max_batch_size {max_batch_size}"
            )
        self._config["max_batch_size"] = max_batch_size

    def set_dynamic_batching(self) -> None:
        """Use the dynamic batcher (its defaults) unless the configuration sets one already.

        Raises:
            ValueError: the configuration uses ``sequence_batching`` or is an ensemble.
        """
        for other in ("sequence_batching", "ensemble_scheduling"):
            if other in self._config:
                raise ValueError(
                    f"Configuration specified scheduling_choice as '{other}', but "
                    f"auto-complete-config function for model '{self._name}' tries to set "
                    "scheduling_choice as 'dynamic_batching'"
                )
        self._config.setdefault("dynamic_batching", {})

    def add_input(self, input: dict[str, Any]) -> None:
        """Declare an input: ``name``, ``data_type`` (``TYPE_*``), ``dims`` (without the batch
        dimension) and optionally ``optional``.

        Raises:
            ValueError: another property, a missing one, or an input the configuration
                declares with another ``data_type``, ``dims`` or ``optional``.
        """
        self._add("input", input, _INPUT_KEYS)

    def add_output(self, output: dict[str, Any]) -> None:
        """Declare an output: ``name``, ``data_type`` (``TYPE_*``) and ``dims``.

        Raises:
            ValueError: as :meth:`add_input` (without ``optional``).
        """
        self._add("output", output, _OUTPUT_KEYS)

    def _add(self, kind: str, tensor: dict[str, Any], allowed: tuple[str, ...]) -> None:
        model = self._name
        label = tensor.get("name", "")
        extra = [key for key in tensor if key not in allowed]
        if extra:
            names = ", ".join(f"'{key}'" for key in allowed)
            raise ValueError(
                f"{kind} '{label}' in auto-complete-config function for model '{model}' "
                f"contains property other than {names}: {extra}"
            )
        for key in ("name", "data_type", "dims"):
            if key not in tensor:
                where = f"{kind} '{label}'" if "name" in tensor else kind
                raise ValueError(
                    f"{where} in auto-complete-config function for model '{model}' is "
                    f"missing '{key}' property."
                )
        for declared in self._config[kind]:
            if declared.get("name") != tensor["name"]:
                continue
            given_type = declared.get("data_type", "TYPE_INVALID")
            if given_type not in ("TYPE_INVALID", tensor["data_type"]):
                raise ValueError(
                    f"unable to load model '{model}', configuration expects datatype "
                    f"{given_type} for {kind} '{label}', model provides {tensor['data_type']}"
                )
            dims = list(declared.get("dims") or [])
            if dims and dims != list(tensor["dims"]):
                raise ValueError(
                    f"model '{model}', tensor '{label}': the model expects dims "
                    f"{list(tensor['dims'])} but the model configuration specifies dims {dims}"
                )
            if (
                "optional" in tensor
                and "optional" in declared
                and bool(declared["optional"]) != bool(tensor["optional"])
            ):
                raise ValueError(
                    f"model '{model}', tensor '{label}': the model expects optional "
                    f"{tensor['optional']} but the model configuration specifies optional "
                    f"{declared['optional']}"
                )
            declared["data_type"] = tensor["data_type"]
            declared["dims"] = list(tensor["dims"])
            if "optional" in tensor:
                declared["optional"] = bool(tensor["optional"])
            return
        self._config[kind].append({key: copy.deepcopy(value) for key, value in tensor.items()})

    def set_model_transaction_policy(self, transaction_policy_dict: dict[str, Any]) -> None:
        """Set ``model_transaction_policy``: ``{"decoupled": True}`` for a model that answers
        with a stream of responses.

        Raises:
            ValueError: a property other than ``decoupled``, or ``decoupled`` set otherwise by
                the configuration.
        """
        model = self._name
        extra = [key for key in transaction_policy_dict if key != "decoupled"]
        if extra:
            raise ValueError(
                "model transaction property in auto-complete-config function for model "
                f"'{model}' contains property other than 'decoupled': {extra}"
            )
        policy = self._config.setdefault("model_transaction_policy", {})
        if "decoupled" in transaction_policy_dict:
            wanted = bool(transaction_policy_dict["decoupled"])
            if "decoupled" in policy and bool(policy["decoupled"]) != wanted:
                raise ValueError(
                    "trying to change decoupled property in auto-complete-config for model "
                    f"'{model}', which is already set to '{bool(policy['decoupled'])}'."
                )
            policy["decoupled"] = wanted
