"""Backend ``python``: gpuserve's ``Model`` class, or Triton's ``TritonPythonModel``.

Which one runs is decided by what ``<version>/model.py`` defines: a class ``Model`` runs on
:class:`~gpuserve.backends.python.PythonBackend`'s hooks; a class ``TritonPythonModel`` (and no
``Model``) runs with Triton's Python backend API:

* ``initialize(args)`` at load, with ``args`` as Triton gives it: ``model_config`` (Triton's
  ModelConfig as a JSON string), ``model_instance_kind`` (``CPU``/``GPU``),
  ``model_instance_device_id``, ``model_instance_name``, ``model_repository`` (the model's
  folder), ``model_version`` and ``model_name``;
* ``execute(requests)`` once per batch, with one :class:`~.utils.InferenceRequest` per
  request; it returns one :class:`~.utils.InferenceResponse` per request, in order. A response
  with an error fails only its request; an exception from ``execute`` fails the whole batch;
* ``finalize()`` at unload.

Batch boundaries: the engine hands a backend the batch's rows, not its requests, so a model
with ``max_batch_size > 0`` gets one ``InferenceRequest`` per row (shape ``[1, ...]``), which a
Triton model treats as it treats any request with its own batch dimension; the rows of its
responses go back to the requests that sent them. With ``max_batch_size: 0`` every request is
its own batch and ``execute`` gets it whole.

Decoupled models (``model_transaction_policy { decoupled: true }``) get their requests whole,
never split into rows: one request per ``execute``, or, with ``dynamic_batching`` and
``max_batch_size > 0``, the requests of a batch (``stream_batch``), each with its own
``get_response_sender()`` whose responses, final flag and ``is_cancelled()`` are that request's
alone (batched by the engine's dynamic batcher, see :mod:`gpuserve.engine.runners.streaming`).

Each request ``execute`` receives reads its row's context (:mod:`gpuserve.backends.row_context`),
whatever path the request came by: ``request_id()``, ``correlation_id()`` (the client's
``sequence_id``, an ``int`` or a ``str``; 0 without one, for sequence models and any other),
``flags()`` (``sequence_start`` / ``sequence_end``), ``parameters()`` and ``is_cancelled()``
(its client went away while the batch ran).
"""

from __future__ import annotations

import asyncio
import inspect
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from gpuserve.backends import call_scope
from gpuserve.backends.base import AdmissionStep, Backend, Capabilities, LoadContext, RowErrors
from gpuserve.backends.completion import check_completion, require_declared
from gpuserve.backends.loader import import_module_from_path
from gpuserve.backends.python import PythonBackend
from gpuserve.backends.row_context import NO_CONTEXT, RowContext
from gpuserve.backends.streaming import ResponseSink, StreamCall, sink_context
from gpuserve.backends.triton_python import utils as pb_utils
from gpuserve.backends.triton_python.auto_complete import auto_complete as auto_complete_config
from gpuserve.backends.triton_python.auto_complete import hook_of
from gpuserve.config import ModelConfig
from gpuserve.config.reshape import uses_reshape
from gpuserve.config.triton import triton_model_config_dict
from gpuserve.datatypes import numpy_dtype
from gpuserve.errors import BackendError, ConfigError, InvalidInputError

#: The name Triton models import the utilities under.
UTILS_MODULE = "triton_python_backend_utils"

_INVALID = {pb_utils.TritonError.INVALID_ARG, pb_utils.TritonError.NOT_FOUND}


def register_utils() -> None:
    """Make ``import triton_python_backend_utils`` find :mod:`.utils` (once per process; a
    module already registered under that name is left alone)."""
    sys.modules.setdefault(UTILS_MODULE, pb_utils)


def model_args(context: LoadContext) -> dict[str, str]:
    """The ``args`` of ``TritonPythonModel.initialize`` for one instance."""
    config = context.config
    name = config.name or ""
    device_kind, _, device_id = context.device.partition(":")
    triton_config = triton_model_config_dict(name, "python", config)
    if config.model_transaction_policy.decoupled:  # pb_utils.using_decoupled_... reads it
        triton_config["model_transaction_policy"] = {"decoupled": True}
    return {
        "model_config": json.dumps(triton_config),
        "model_instance_kind": "GPU" if device_kind == "cuda" else "CPU",
        "model_instance_device_id": device_id or "0",
        "model_instance_name": f"{name}_{context.instance_index}",
        "model_repository": str(context.version_path.parent),
        "model_version": str(context.version),
        "model_name": name,
    }


def triton_error(error: BaseException) -> BaseException:
    """A model's error as gpuserve reports it: a ``TritonError`` with code ``INVALID_ARG`` or
    ``NOT_FOUND`` fails as bad input (400), any other as a model failure (500)."""
    if isinstance(error, pb_utils.TritonError):
        if error.code() in _INVALID:
            return InvalidInputError(error.message())
        return BackendError(error.message())
    return error


class _ErrorMapping:
    """A :class:`ResponseSink` that maps Triton errors (see :func:`triton_error`)."""

    def __init__(self, sink: ResponseSink) -> None:
        self._sink = sink
        self.request_id = sink.request_id
        self.parameters = sink.parameters

    def send(
        self,
        outputs: dict[str, np.ndarray] | None,
        *,
        final: bool = False,
        error: BaseException | None = None,
    ) -> bool:
        return self._sink.send(
            outputs, final=final, error=None if error is None else triton_error(error)
        )

    def is_cancelled(self) -> bool:
        return self._sink.is_cancelled()


@dataclass(slots=True)
class _Executed:
    """What ``execute`` returned for one batch."""

    requests: int
    responses: list[Any]


def _request(
    tensors: list[pb_utils.Tensor], name: str, context: RowContext
) -> pb_utils.InferenceRequest:
    """The ``InferenceRequest`` ``execute`` receives for a row (or a request) of
    ``context``."""
    request = pb_utils.InferenceRequest(
        tensors,
        model_name=name,
        request_id=context.request_id,
        correlation_id=context.correlation_id,
        parameters=dict(context.parameters),
        flags=context.flags,
    )
    request._probe = context.probe  # type: ignore[attr-defined]  # is_cancelled()
    return request


class TritonPythonRunner(Backend):
    """Runs a ``TritonPythonModel`` class (see the module docstring).

    Args:
        cls: The user's ``TritonPythonModel`` class.
    """

    def __init__(self, cls: type) -> None:
        self.cls = cls
        self.model: Any = None
        self.batched = False
        self.inputs: list[str] = []
        self.outputs: list[tuple[str, np.dtype]] = []
        self.shapes: list[tuple[str, tuple[int, ...]]] = []
        self.name = ""
        self.caller: Any = None

    def load(self, context: LoadContext) -> None:
        config = context.config
        self.batched = config.max_batch_size > 0
        self.inputs = [t.name for t in config.inputs]
        self.outputs = [(t.name, numpy_dtype(t.datatype)) for t in config.outputs]
        # the shape each declared output must have in a response (an output with a reshape
        # is checked when the engine reshapes it)
        self.shapes = [(t.name, tuple(t.shape)) for t in config.outputs if not uses_reshape(t)]
        if config.sequence_batching is not None:  # implicit state comes back as outputs
            states = config.sequence_batching.states
            self.outputs += [(s.output_name, numpy_dtype(s.datatype)) for s in states]
        self.name = config.name or ""
        self.caller = context.caller
        self.model = self.cls()
        initialize = getattr(self.model, "initialize", None)
        if initialize is not None:
            initialize(model_args(context))

    def preprocess(self, inputs: dict[str, np.ndarray]) -> list[pb_utils.InferenceRequest]:
        """As :meth:`preprocess_rows` with no row contexts (a warm-up sample)."""
        return self.preprocess_rows(inputs, ())

    def preprocess_rows(
        self, inputs: dict[str, np.ndarray], rows: Sequence[RowContext]
    ) -> list[pb_utils.InferenceRequest]:
        """One request per batch row (batching model) or one for the whole arrays, each
        with its row's context (module docstring)."""
        if not self.batched:
            tensors = [pb_utils.Tensor(name, array) for name, array in inputs.items()]
            return [_request(tensors, self.name, rows[0] if rows else NO_CONTEXT)]
        count = next(iter(inputs.values())).shape[0] if inputs else 0
        return [
            _request(
                [pb_utils.Tensor(name, array[row : row + 1]) for name, array in inputs.items()],
                self.name,
                rows[row] if row < len(rows) else NO_CONTEXT,
            )
            for row in range(count)
        ]

    def forward(self, prepared: list[pb_utils.InferenceRequest]) -> _Executed:
        with call_scope.with_caller(self.caller):  # InferenceRequest.exec() calls other models
            responses = self.model.execute(prepared)
            if inspect.iscoroutine(responses):  # ``async def execute`` (``await async_exec``)
                responses = asyncio.run(responses)
        if not isinstance(responses, (list, tuple)) or len(responses) != len(prepared):
            got = len(responses) if isinstance(responses, (list, tuple)) else type(responses)
            raise BackendError(
                f"TritonPythonModel.execute must return a list of one InferenceResponse per "
                f"request: got {got} for {len(prepared)} request(s)"
            )
        return _Executed(len(prepared), list(responses))

    def postprocess(self, raw: _Executed) -> dict[str, np.ndarray]:
        """The responses' outputs stacked per output; a response with an error (or a missing
        output) fails the request owning that row."""
        errors: dict[int, Any] = {}
        per_row: list[dict[str, np.ndarray]] = []
        for index, response in enumerate(raw.responses):
            arrays, problem = self._outputs_of(response)
            if problem is not None:
                errors[index] = problem
            per_row.append(arrays)
        outputs: dict[str, np.ndarray] = {}
        declared = dict(self.shapes)
        for name, dtype in self.outputs:
            good = [row[name] for index, row in enumerate(per_row) if index not in errors]
            # a failed row's place holds zeros of the declared shape (-1: one element)
            blank = tuple(1 if d == -1 else d for d in declared.get(name, ()))
            if not self.batched:
                outputs[name] = good[0] if good else np.zeros(blank, dtype=dtype)
                continue
            filler = np.zeros_like(good[0]) if good else np.zeros((1, *blank), dtype=dtype)
            rows = [filler if index in errors else row[name] for index, row in enumerate(per_row)]
            try:
                outputs[name] = np.concatenate(rows, axis=0)
            except ValueError as err:
                raise BackendError(
                    f"output '{name}': the responses' shapes cannot be batched: {err}"
                ) from None
        return RowErrors(outputs, errors) if errors else outputs

    def _outputs_of(self, response: Any) -> tuple[dict[str, np.ndarray], Any]:
        if not isinstance(response, pb_utils.InferenceResponse):
            return {}, f"execute returned a {type(response).__name__}, not an InferenceResponse"
        error = response.error()
        if error is not None:
            message = error.message() if hasattr(error, "message") else str(error)
            code = error.code() if hasattr(error, "code") else pb_utils.TritonError.INTERNAL
            return {}, InvalidInputError(message) if code in _INVALID else BackendError(message)
        arrays = {t.name(): t.as_numpy() for t in response.output_tensors()}
        missing = [name for name, _ in self.outputs if name not in arrays]
        if missing:
            return arrays, f"the response has no output(s) {missing}; it has {sorted(arrays)}"
        if self.batched:
            for name, _ in self.outputs:
                if arrays[name].ndim == 0:
                    arrays[name] = arrays[name].reshape(1)
        for name, declared in self.shapes:  # each response is its own request's
            shape = arrays[name].shape
            rest = shape[1:] if self.batched else shape
            if len(rest) != len(declared) or any(
                d != -1 and d != n for d, n in zip(declared, rest, strict=True)
            ):
                expected = [-1, *declared] if self.batched else list(declared)
                return arrays, (
                    f"the response has output '{name}' of shape {list(shape)}; its config "
                    f"declares {expected}"
                )
        return arrays, None

    def capabilities(self) -> Capabilities:
        """A ``TritonPythonModel`` streams (its response sender), runs several streams in one
        ``execute(requests)`` and reads its rows' contexts (``correlation_id()``...)."""
        return Capabilities(streams=True, streams_batches=True, reads_rows=True)

    def stream(self, inputs: dict[str, np.ndarray], sink: ResponseSink) -> None:
        """Decoupled execution: ``execute([request])`` with the request's response sender
        bound to ``sink``; ``execute`` returns None and the model sends the responses, from
        ``execute`` or its own threads (see :mod:`gpuserve.backends.streaming`)."""
        self.stream_batch([StreamCall(inputs, sink, sink_context(sink))])

    def stream_batch(self, calls: Sequence[StreamCall]) -> None:
        """Decoupled execution of several requests in one ``execute(requests)``: one
        ``InferenceRequest`` per call, in order, each with its call's context and its own
        response sender bound to its call's sink.

        Raises:
            BackendError: ``execute`` returned responses instead of None.
            Exception: what ``execute`` raised (the engine fails every request of the call).
        """
        requests = []
        for call in calls:
            sink = call.sink
            tensors = [pb_utils.Tensor(name, array) for name, array in call.inputs.items()]
            request = _request(tensors, self.name, call.context)
            request._sender = pb_utils.InferenceResponseSender(_ErrorMapping(sink))  # type: ignore[attr-defined]
            requests.append(request)
        with call_scope.with_caller(self.caller):  # a decoupled model may call other models too
            returned = self.model.execute(requests)
            if inspect.iscoroutine(returned):  # ``async def execute``
                returned = asyncio.run(returned)
        if returned is not None and not (isinstance(returned, (list, tuple)) and not returned):
            raise BackendError(
                "a decoupled TritonPythonModel.execute must return None and send its "
                "responses with request.get_response_sender(); it returned "
                f"{type(returned).__name__}"
            )

    def unload(self) -> None:
        finalize = getattr(self.model, "finalize", None)
        if finalize is not None:
            finalize()
        self.model = None


def _model_classes(path: Path, config: ModelConfig, version: int) -> tuple[Any, Any]:
    """``Model`` and ``TritonPythonModel`` of ``path`` (each None when it is not a class).

    Raises:
        ConfigError: no ``model.py``, or it fails to import.
    """
    if not path.is_file():
        raise ConfigError(
            f"{path}: backend 'python' needs a model.py defining class Model "
            "(or Triton's TritonPythonModel)"
        )
    register_utils()
    module = import_module_from_path(path, config.name or "model", version)
    cls = getattr(module, "Model", None)
    triton = getattr(module, "TritonPythonModel", None)
    return (cls if isinstance(cls, type) else None), (triton if isinstance(triton, type) else None)


class PythonModelBackend(Backend):
    """Backend ``python``: loads ``model.py`` once and runs its ``Model`` (gpuserve's hooks)
    or its ``TritonPythonModel`` (Triton's API)."""

    def __init__(self) -> None:
        self.impl: Backend | None = None

    @classmethod
    def complete_config(
        cls, config: ModelConfig, version_path: Path, *, auto_complete: bool = True
    ) -> ModelConfig:
        """The model completes its own configuration (:mod:`gpuserve.backends.completion`):
        a ``Model``'s ``complete_config`` classmethod, or a ``TritonPythonModel``'s
        ``auto_complete_config``; without one (or with ``auto_complete`` off) the
        configuration must declare inputs and outputs.

        Raises:
            ConfigError: no or a failing ``model.py``, a hook that breaks the completion
                rules, or inputs or outputs still missing.
        """
        path = version_path / "model.py"
        if auto_complete and path.is_file():
            version = int(version_path.name) if version_path.name.isdigit() else 0
            model, triton = _model_classes(path, config, version)
            if model is not None:
                hook = getattr(model, "complete_config", None)
                if hook is not None:
                    try:
                        done = hook(config)
                    except Exception as err:  # user code: a load failure with its cause
                        raise ConfigError(f"{path}: Model.complete_config failed: {err}") from err
                    return check_completion(config, done, path, "Model.complete_config")
            elif triton is not None and hook_of(triton) is not None:
                return auto_complete_config(triton, config, version_path)
        if not auto_complete:
            require_declared(config, version_path)
        missing = [label for label in ("inputs", "outputs") if not getattr(config, label)]
        if missing:
            raise ConfigError(
                f"{path}: model '{config.name}' declares no {' and no '.join(missing)}: backend "
                "'python' needs them in the configuration, or filled in by model.py "
                "(Model.complete_config, or TritonPythonModel.auto_complete_config)"
            )
        return config

    def load(self, context: LoadContext) -> None:
        path = context.version_path / "model.py"
        cls, triton = _model_classes(path, context.config, context.version)
        if cls is not None:
            inner = PythonBackend()
            inner.model = cls()
            inner.model.context = context
            inner.model.load(context)
            self.impl = inner
        elif triton is not None:
            runner = TritonPythonRunner(triton)
            runner.load(context)
            self.impl = runner
        else:
            raise ConfigError(
                f"{path}: no class named 'Model' (or Triton's 'TritonPythonModel') "
                "(backend 'python')"
            )

    def capabilities(self) -> Capabilities:
        """The wrapped implementation's: a ``Model``'s hooks, or a ``TritonPythonModel``'s
        (streams, batches of streams, row ids)."""
        return self._impl().capabilities()

    @property
    def model(self) -> Any:
        """The user's model object (a ``Model`` or a ``TritonPythonModel``), None when not
        loaded: as :attr:`PythonBackend.model`."""
        impl = self.impl
        return None if impl is None else getattr(impl, "model", None)

    def _impl(self) -> Backend:
        if self.impl is None:
            raise BackendError("the python backend is not loaded")
        return self.impl

    def admission(self) -> AdmissionStep | None:
        """The wrapped model's admission step (gpuserve's ``Model.admit``), or None."""
        impl = self.impl
        return None if impl is None else impl.admission()

    def warmup(self) -> None:
        self._impl().warmup()

    def preprocess(self, inputs: dict[str, np.ndarray]) -> Any:
        return self._impl().preprocess(inputs)

    def preprocess_rows(self, inputs: dict[str, np.ndarray], rows: Sequence[RowContext]) -> Any:
        return self._impl().preprocess_rows(inputs, rows)

    def forward(self, prepared: Any) -> Any:
        return self._impl().forward(prepared)

    def postprocess(self, raw: Any) -> dict[str, np.ndarray]:
        return self._impl().postprocess(raw)

    def stream(self, inputs: dict[str, np.ndarray], sink: ResponseSink) -> None:
        """Decoupled execution (see :mod:`gpuserve.backends.streaming`): the ``Model``'s
        ``generate`` generator, or the ``TritonPythonModel``'s ``execute`` with a response
        sender."""
        self._impl().stream(inputs, sink)

    def stream_batch(self, calls: Sequence[StreamCall]) -> None:
        """Decoupled execution of several requests in one call (see
        :mod:`gpuserve.backends.streaming`); one request per call for a ``Model``."""
        self._impl().stream_batch(calls)

    def unload(self) -> None:
        if self.impl is not None:
            self.impl.unload()
        self.impl = None
