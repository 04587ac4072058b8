"""Triton's model configuration (``config.pbtxt``, or its JSON form in a load request) mapped
onto gpuserve's :class:`~gpuserve.config.ModelConfig`.

Served as Triton means it: ``name``, ``platform``/``backend`` (``onnxruntime_onnx`` /
``onnxruntime`` -> ``onnx``, ``pytorch_libtorch`` / ``pytorch`` -> ``torch`` with a TorchScript
``model.pt``, ``python`` -> ``python`` with Triton's Python backend API), ``max_batch_size``
(0 or omitted: no batching, as in Triton), ``input``/``output`` (``data_type``, ``dims``,
``optional``, ``reshape``), ``dynamic_batching`` (preferred sizes, delay,
priority levels, default queue policy), ``instance_group`` (count, kind, gpus),
``version_policy``, ``parameters`` (``string_value``), ``default_model_filename`` (the
backend's own file name), ``optimization.cuda.graphs`` and the pinned-memory switches (gpuserve
pins host buffers anyway). ``model_warmup`` maps onto the ``model_warmup`` section (run on
every instance before the version serves, see :mod:`gpuserve.config.warmup`).
``platform: "ensemble"`` with ``ensemble_scheduling`` maps onto the ``ensemble`` section
(:mod:`gpuserve.repository.triton.ensemble`).

Everything else gets a :class:`~gpuserve.errors.ConfigError` that names the file and the
field (
``response_cache``, ...). The mapped fields then go through the same validation as a
``config.yaml``, so a bad value is reported with the file, the field and the value.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from gpuserve.config import ModelConfig, parse_model_config
from gpuserve.config.reshape import reshape_problem
from gpuserve.datatypes import TRITON_DATATYPES
from gpuserve.errors import ConfigError
from gpuserve.repository.triton.pbtxt import Message, Value, read_pbtxt
from gpuserve.repository.triton.ensemble import ensemble_section
from gpuserve.repository.triton.sequence import sequence_batching

logger = logging.getLogger(__name__)

#: Triton's config file name.
TRITON_CONFIG_FILENAME = "config.pbtxt"

#: Triton platform or backend -> gpuserve backend.
PLATFORMS = {
    "onnxruntime_onnx": "onnx",
    "onnxruntime": "onnx",
    "pytorch_libtorch": "torch",
    "pytorch": "torch",
    "python": "python",
    "ensemble": "ensemble",
}
#: The model file of each backend in a version folder (Triton's default names).
MODEL_FILENAMES = {"onnx": "model.onnx", "torch": "model.pt", "python": "model.py"}

_KINDS = {"KIND_AUTO": "auto", "KIND_GPU": "gpu", "KIND_CPU": "cpu"}

_LATER = "not supported by gpuserve yet"
#: Top-level fields gpuserve refuses, with what the user is told.
_REFUSED = {
    "response_cache": "not supported by gpuserve (no response cache)",
    "batch_input": "not supported by gpuserve (ragged batch inputs)",
    "batch_output": "not supported by gpuserve (ragged batch outputs)",
    "model_operations": "not supported by gpuserve (custom operation libraries)",
    "model_repository_agents": "not supported by gpuserve (repository agents)",
    "cc_model_filenames": "not supported by gpuserve (per-GPU model files)",
    "metric_tags": "not supported by gpuserve",
    "runtime": "not supported by gpuserve (custom backend libraries)",
    "auto_complete_config": "not supported by gpuserve",
}
_TOP = {
    "name",
    "platform",
    "backend",
    "max_batch_size",
    "input",
    "output",
    "dynamic_batching",
    "instance_group",
    "version_policy",
    "parameters",
    "model_warmup",
    "default_model_filename",
    "optimization",
    "model_transaction_policy",
    "sequence_batching",
    "ensemble_scheduling",
}


class _Mapper:
    """Maps one config tree; every refusal names ``path`` and the dotted field."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def fail(self, field: str, problem: str, given: Any = None) -> ConfigError:
        tail = "" if given is None else f" (given: {given!r})"
        return ConfigError(f"{self.path}: field '{field}': {problem}{tail}")

    def one(self, msg: Message, key: str, where: str) -> Value | None:
        values = msg.get(key, [])
        if len(values) > 1:
            raise self.fail(f"{where}{key}", "set more than once", values)
        return values[0] if values else None

    def sub(self, msg: Message, key: str, where: str) -> Message | None:
        value = self.one(msg, key, where)
        if value is not None and not isinstance(value, dict):
            raise self.fail(f"{where}{key}", "expected a message { ... }", value)
        return value

    def subs(self, msg: Message, key: str, where: str) -> list[Message]:
        values = msg.get(key, [])
        for value in values:
            if not isinstance(value, dict):
                raise self.fail(f"{where}{key}", "expected a message { ... }", value)
        return [v for v in values if isinstance(v, dict)]

    def integer(self, msg: Message, key: str, where: str, default: int = 0) -> int:
        value = self.one(msg, key, where)
        if value is None:
            return default
        if isinstance(value, str) and value.lstrip("-").isdigit():  # int64 in JSON
            return int(value)
        if not isinstance(value, int) or isinstance(value, bool):
            raise self.fail(f"{where}{key}", "expected an integer", value)
        return value

    def ints(self, msg: Message, key: str, where: str) -> list[int]:
        out = []
        for value in msg.get(key, []):
            if isinstance(value, str) and value.lstrip("-").isdigit():
                value = int(value)
            if not isinstance(value, int) or isinstance(value, bool):
                raise self.fail(f"{where}{key}", "expected integers", value)
            out.append(value)
        return out

    def text(self, msg: Message, key: str, where: str) -> str | None:
        value = self.one(msg, key, where)
        if value is not None and not isinstance(value, str):
            raise self.fail(f"{where}{key}", "expected a string", value)
        return value

    def flag(self, msg: Message, key: str, where: str) -> bool:
        value = self.one(msg, key, where)
        if value is None:
            return False
        if not isinstance(value, bool):
            raise self.fail(f"{where}{key}", "expected true or false", value)
        return value

    def only(self, msg: Message, allowed: set[str], where: str, why: str = "") -> None:
        for key in msg:
            if key not in allowed:
                raise self.fail(f"{where}{key}", why or "not supported by gpuserve")

    # -- sections ----------------------------------------------------------------------------

    def model(self, tree: Message) -> dict[str, Any]:
        for key in tree:
            if key in _REFUSED:
                raise self.fail(key, _REFUSED[key])
            if key not in _TOP:
                raise self.fail(key, "not a ModelConfig field gpuserve knows")
        out: dict[str, Any] = {"backend": self.backend(tree)}
        name = self.text(tree, "name", "")
        if name:
            out["name"] = name
        out["max_batch_size"] = self.integer(tree, "max_batch_size", "")
        out["inputs"] = [
            self.tensor(t, f"input[{i}].") for i, t in enumerate(tree.get("input", []))
        ]
        out["outputs"] = [
            self.tensor(t, f"output[{i}].", output=True)
            for i, t in enumerate(tree.get("output", []))
        ]
        for kind in ("input", "output"):  # Triton's reshape rules, named by pbtxt field
            for i, spec in enumerate(out[f"{kind}s"]):
                batching = out["max_batch_size"] > 0
                problem = reshape_problem(spec["shape"], spec.get("reshape"), batching)
                if problem is not None:
                    raise self.fail(f"{kind}[{i}].reshape", problem, spec.get("reshape"))
        sequence = self.sub(tree, "sequence_batching", "")
        if sequence is not None:  # stateful models (repository/triton_sequence.py)
            out["sequence_batching"] = sequence_batching(self, sequence)
        batching = self.sub(tree, "dynamic_batching", "")
        if batching is not None:
            out["dynamic_batching"] = self.dynamic_batching(batching)
        groups = self.subs(tree, "instance_group", "")
        if groups:
            out["instance_group"] = [
                self.instance_group(g, f"instance_group[{i}].") for i, g in enumerate(groups)
            ]
        policy = self.sub(tree, "version_policy", "")
        if policy is not None:
            out["version_policy"] = self.version_policy(policy)
        parameters = self.parameters(tree.get("parameters", []))
        if parameters:
            out["parameters"] = parameters
        optimization = self.sub(tree, "optimization", "")
        if optimization is not None:
            out["optimization"] = self.optimization(optimization)
        transaction = self.sub(tree, "model_transaction_policy", "")
        if transaction is not None:
            self.only(transaction, {"decoupled"}, "model_transaction_policy.")
            if self.flag(transaction, "decoupled", "model_transaction_policy."):
                out["model_transaction_policy"] = {"decoupled": True}
        scheduling = self.sub(tree, "ensemble_scheduling", "")
        if scheduling is not None:
            out["ensemble"] = ensemble_section(self, scheduling, out["backend"])
        filename = self.text(tree, "default_model_filename", "")
        expected = MODEL_FILENAMES.get(out["backend"])
        if filename and filename != expected:
            raise self.fail(
                "default_model_filename",
                f"gpuserve's backend '{out['backend']}' loads {expected}; rename the file",
                filename,
            )
        warmups = self.subs(tree, "model_warmup", "")
        if warmups:
            out["model_warmup"] = [
                self.warmup(sample, f"model_warmup[{i}].") for i, sample in enumerate(warmups)
            ]
        return out

    def backend(self, tree: Message) -> str:
        platform = self.text(tree, "platform", "")
        backend = self.text(tree, "backend", "")
        names = [n for n in (platform, backend) if n]
        if not names:
            raise self.fail(
                "platform", f"set platform or backend (one of {', '.join(sorted(PLATFORMS))})"
            )
        mapped = {PLATFORMS.get(n) for n in names}
        for field, value in (("platform", platform), ("backend", backend)):
            if value and value not in PLATFORMS:
                raise self.fail(
                    field,
                    f"not served by gpuserve (supported: {', '.join(sorted(PLATFORMS))})",
                    value,
                )
        if len(mapped) > 1:
            raise self.fail("backend", f"disagrees with platform {platform!r}", backend)
        return mapped.pop() or "python"

    def datatype(self, msg: Message, where: str) -> str:
        value = self.text(msg, "data_type", where)
        if value not in TRITON_DATATYPES:
            raise self.fail(
                f"{where}data_type",
                f"expected one of {', '.join(TRITON_DATATYPES)} "
                "(TYPE_BF16 has no numpy equivalent)",
                value,
            )
        return TRITON_DATATYPES[value]

    def tensor(self, msg: Value, where: str, output: bool = False) -> dict[str, Any]:
        if not isinstance(msg, dict):
            raise self.fail(where.rstrip("."), "expected a message { ... }", msg)
        allowed = {"name", "data_type", "dims", "reshape", "format"}
        allowed |= {"label_filename"} if output else {"optional"}
        self.only(msg, allowed, where)
        dims = self.ints(msg, "dims", where)
        for dim in dims:
            if dim < -1 or dim == 0:
                raise self.fail(f"{where}dims", "each dim must be a positive integer or -1", dims)
        reshape = self.sub(msg, "reshape", where)
        if reshape is not None:
            self.only(reshape, {"shape"}, f"{where}reshape.")
        fmt = self.text(msg, "format", where)
        if fmt not in (None, "FORMAT_NONE", "FORMAT_NCHW", "FORMAT_NHWC") or (fmt and output):
            raise self.fail(
                f"{where}format", "expected FORMAT_NONE, FORMAT_NCHW or FORMAT_NHWC", fmt
            )
        spec: dict[str, Any] = {
            "name": self.text(msg, "name", where) or "",
            "datatype": self.datatype(msg, where),
            "shape": dims,
        }
        if reshape is not None:  # checked against dims in model() (Triton's rules)
            spec["reshape"] = self.ints(reshape, "shape", f"{where}reshape.")
        if not output and self.flag(msg, "optional", where):
            spec["optional"] = True
        if fmt in ("FORMAT_NCHW", "FORMAT_NHWC"):
            spec["format"] = fmt
        labels = self.text(msg, "label_filename", where) if output else None
        if labels:  # the classification extension's labels, a file in the model folder
            spec["label_filename"] = labels
        return spec

    def dynamic_batching(self, msg: Message) -> dict[str, Any]:
        where = "dynamic_batching."
        self.only(
            msg,
            {
                "preferred_batch_size",
                "max_queue_delay_microseconds",
                "preserve_ordering",
                "priority_levels",
                "default_priority_level",
                "default_queue_policy",
            },
            where,
        )
        out: dict[str, Any] = {
            "preferred_batch_sizes": self.ints(msg, "preferred_batch_size", where),
            "max_queue_delay_us": self.integer(msg, "max_queue_delay_microseconds", where),
        }
        levels = self.integer(msg, "priority_levels", where)
        if levels:
            out["priority_levels"] = levels
        default_level = self.integer(msg, "default_priority_level", where)
        if default_level:
            out["default_priority_level"] = default_level
        policy = self.sub(msg, "default_queue_policy", where)
        if policy is not None:
            where += "default_queue_policy."
            self.only(
                policy,
                {
                    "timeout_action",
                    "default_timeout_microseconds",
                    "allow_timeout_override",
                    "max_queue_size",
                },
                where,
            )
            action = self.text(policy, "timeout_action", where)
            if action not in (None, "REJECT"):
                raise self.fail(
                    f"{where}timeout_action", "only REJECT (gpuserve never runs late)", action
                )
            out["default_timeout_us"] = self.integer(policy, "default_timeout_microseconds", where)
            size = self.integer(policy, "max_queue_size", where)
            if size:  # Triton's 0 (unbounded) keeps gpuserve's bounded default
                out["max_queue_size"] = size
        return out

    def instance_group(self, msg: Message, where: str) -> dict[str, Any]:
        self.only(msg, {"name", "kind", "count", "gpus"}, where)
        kind = self.text(msg, "kind", where) or "KIND_AUTO"
        if kind not in _KINDS:
            raise self.fail(f"{where}kind", f"expected one of {', '.join(_KINDS)}", kind)
        return {
            "count": self.integer(msg, "count", where, default=1) or 1,
            "kind": _KINDS[kind],
            "gpus": self.ints(msg, "gpus", where),
        }

    def version_policy(self, msg: Message) -> dict[str, Any]:
        where = "version_policy."
        self.only(msg, {"latest", "all", "specific"}, where)
        latest = self.sub(msg, "latest", where)
        specific = self.sub(msg, "specific", where)
        out: dict[str, Any] = {}
        if latest is not None:
            out["latest"] = {"num_versions": self.integer(latest, "num_versions", where, 1)}
        if "all" in msg:
            out["all"] = {}
        if specific is not None:
            out["specific"] = {"versions": self.ints(specific, "versions", f"{where}specific.")}
        return out

    def parameters(self, entries: list[Value]) -> dict[str, str]:
        out: dict[str, str] = {}
        for entry in entries:
            if not isinstance(entry, dict):
                raise self.fail("parameters", "expected key/value entries", entry)
            key = self.text(entry, "key", "parameters.")
            value = self.sub(entry, "value", "parameters.")
            if key is None or value is None:
                raise self.fail("parameters", "each entry needs key and value", entry)
            where = f"parameters[{key}]."
            self.only(value, {"string_value"}, where)
            out[key] = self.text(value, "string_value", where) or ""
        return out

    def optimization(self, msg: Message) -> dict[str, Any]:
        where = "optimization."
        self.only(msg, {"cuda", "input_pinned_memory", "output_pinned_memory"}, where)
        out: dict[str, Any] = {}
        cuda = self.sub(msg, "cuda", where)
        if cuda is not None:
            self.only(cuda, {"graphs", "busy_wait_events", "output_copy_stream"}, f"{where}cuda.")
            out["cuda_graphs"] = self.flag(cuda, "graphs", f"{where}cuda.")
        return out

    def warmup(self, sample: Message, where: str) -> dict[str, Any]:
        """One ``ModelWarmup`` as a ``model_warmup`` entry of gpuserve's config (the same
        field names; ``data_type`` as the V2 name; a set ``zero_data``/``random_data`` chooses
        it whatever its value, as in Triton)."""
        self.only(sample, {"name", "batch_size", "inputs", "count"}, where)
        inputs: dict[str, Any] = {}
        for entry in self.subs(sample, "inputs", where):
            key = self.text(entry, "key", f"{where}inputs.")
            value = self.sub(entry, "value", f"{where}inputs.")
            if not key or value is None:
                raise self.fail(f"{where}inputs", "each entry needs key and value", entry)
            at = f"{where}inputs[{key}]."
            fields = {"data_type", "dims", "zero_data", "random_data", "input_data_file"}
            self.only(value, fields, at)
            spec: dict[str, Any] = {
                "data_type": self.datatype(value, at),
                "dims": self.ints(value, "dims", at),
            }
            for flag in ("zero_data", "random_data"):
                if flag in value:
                    self.flag(value, flag, at)  # a bool, whichever
                    spec[flag] = True
            data_file = self.text(value, "input_data_file", at)
            if data_file is not None:
                spec["input_data_file"] = data_file
            inputs[key] = spec
        return {
            "name": self.text(sample, "name", where) or "",
            "batch_size": self.integer(sample, "batch_size", where),
            "inputs": inputs,
            "count": self.integer(sample, "count", where),
        }


def _from_json(value: Any) -> Value:
    """A JSON value of Triton's ModelConfig (``json_format`` names, lowerCamel or snake_case)
    as a field tree; map fields (``parameters``) become key/value entries as in text format."""
    if isinstance(value, dict):
        msg: Message = {}
        for key, item in value.items():
            name = "".join(f"_{c.lower()}" if c.isupper() else c for c in key)
            if name in ("parameters", "input_map", "output_map") and isinstance(item, dict):
                msg[name] = [{"key": [k], "value": [_from_json(v)]} for k, v in item.items()]
                continue
            if name == "inputs" and isinstance(item, dict):  # model_warmup's map
                msg[name] = [{"key": [k], "value": [_from_json(v)]} for k, v in item.items()]
                continue
            items = item if isinstance(item, list) else [item]
            msg[name] = [_from_json(v) for v in items]
        return msg
    if isinstance(value, (str, int, float, bool)):
        return value
    raise TypeError(f"unexpected JSON value {value!r}")


#: Fields only Triton's schema has at the top level (gpuserve's are ``inputs``/``outputs``...;
#: ``model_warmup`` is in both).
_TRITON_ONLY = {
    "input",
    "output",
    "platform",
    "default_model_filename",
    "ensemble_scheduling",
} | set(_REFUSED)


def is_triton_config(data: dict[str, Any]) -> bool:
    """Whether a load request's configuration is in Triton's JSON schema rather than
    gpuserve's: it has a field only Triton's has (``input``, ``output``, ``platform``, ...,
    or their lowerCamel JSON names), or an instance group with a ``KIND_*`` kind."""
    keys = {"".join(f"_{c.lower()}" if c.isupper() else c for c in k) for k in data}
    if keys & _TRITON_ONLY:
        return True
    groups = data.get("instance_group") or data.get("instanceGroup") or []
    return isinstance(groups, list) and any(
        isinstance(g, dict) and str(g.get("kind", "")).startswith("KIND_") for g in groups
    )


def triton_config(tree: Message, path: Path, folder_name: str) -> ModelConfig:
    """gpuserve's configuration for a Triton ``ModelConfig`` field tree.

    Raises:
        ConfigError: a field gpuserve cannot serve, or an invalid value; names ``path``,
            the field and the value.
    """
    return parse_model_config(_Mapper(path).model(tree), path, folder_name)


def triton_config_from_json(data: dict[str, Any], path: Path, folder_name: str) -> ModelConfig:
    """gpuserve's configuration for Triton's ModelConfig as JSON (a load request's override).

    Raises:
        ConfigError: as :func:`triton_config`.
    """
    tree = _from_json(data)
    assert isinstance(tree, dict)
    return triton_config(tree, path, folder_name)


def load_triton_config(path: Path) -> ModelConfig:
    """Read ``<repository>/<model>/config.pbtxt``.

    Raises:
        ConfigError: unreadable, not text format, or a field gpuserve cannot serve.
    """
    return triton_config(read_pbtxt(path), path, path.parent.name)
