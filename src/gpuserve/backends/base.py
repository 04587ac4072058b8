"""The backend contract: what an execution backend must provide to run batches.

An engine ``Instance`` (one copy of a model on one device) owns one :class:`Backend` object and
calls it from its own execution thread, never concurrently, in this order::

    load(context)                       once, before any batch
    warmup()                            once, after load
    for each batch:
        prepared = preprocess(inputs)   CPU work (tokenise, stack, pin, convert)
        raw      = forward(prepared)    device work
        outputs  = postprocess(raw)     back to numpy on the CPU
    unload()                            once, at the end

``inputs`` maps each declared input name to a numpy array whose first dimension is the batch
(the rows of every request in the batch, concatenated in order). ``postprocess`` must return
every declared output, each with the same number of rows as the inputs; the engine checks this
and splits the rows back to their requests. A backend knows nothing of queues or protocols.

A backend may also declare an admission step (:meth:`Backend.admission`): per request, before
batching, on the server's admission threads, it measures the request and may cut its inputs.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from gpuserve.backends.row_context import RowContext
from gpuserve.config import ModelConfig
from gpuserve.errors import BackendError, ConfigError

if TYPE_CHECKING:
    from gpuserve.backends.causal_lm.backend import GenerationModel

# int8 (dynamic quantisation) keeps float32 activations.
_PRECISION_TO_TORCH = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16", "int8": "float32"}


@dataclass(slots=True)
class LoadContext:
    """What a backend is told at load.

    Attributes:
        config: The model's validated configuration.
        version_path: The version folder (``<repository>/<model>/<version>``).
        version: The version number.
        device: Torch device string, ``"cpu"`` or ``"cuda:N"``.
        instance_index: Index of this instance among the model's instances.
        parameters: ``config.parameters``, for convenience.
        caller: Calls another model of the repository in-process (business-logic scripting,
            see :meth:`infer`); None outside a server.
    """

    config: ModelConfig
    version_path: Path
    version: int
    device: str = "cpu"
    instance_index: int = 0
    parameters: dict[str, Any] = field(default_factory=dict)
    caller: Any = None

    def infer(
        self,
        model: str,
        inputs: dict[str, np.ndarray],
        *,
        version: str | None = None,
        outputs: list[str] | None = None,
        timeout_s: float | None = None,
    ) -> dict[str, np.ndarray]:
        """Run ``model`` of the repository on ``inputs`` and wait for its outputs (from the
        model's own hooks, on its instance thread; the request batches with the callee's
        other traffic). See :mod:`gpuserve.engine.calls`.

        Args:
            model: The callee's name (not this model: that would wait on itself).
            inputs: Input name -> numpy array, batch dimension first when the callee batches.
            version: Its version, None for its default one.
            outputs: Outputs to return, None for all.
            timeout_s: Longest wait, seconds (default 30).

        Returns:
            Output name -> numpy array.

        Raises:
            GpuserveError: the callee's error (400 bad inputs, 404/503 not served, ...), or
                RequestTimeoutError when no answer came in ``timeout_s``.
        """
        if self.caller is None:
            raise BackendError("context.infer needs a server (no model caller was given)")
        response = self.caller(model, inputs, version=version, outputs=outputs, timeout_s=timeout_s)
        outputs_: dict[str, np.ndarray] = response.outputs
        return outputs_

    @property
    def precision(self) -> str:
        """``fp32``, ``fp16`` or ``bf16`` (from config)."""
        return self.config.precision

    @property
    def torch_dtype(self) -> Any:
        """The ``torch.dtype`` for the configured precision."""
        import torch

        return getattr(torch, _PRECISION_TO_TORCH[self.config.precision])


class RowErrors(dict):  # type: ignore[type-arg]
    """Outputs of a batch in which some rows failed while the rest succeeded.

    A model returns it from ``postprocess`` (or ``forward`` with the default postprocess) in
    place of a plain output dict: the mapping holds the outputs, ``errors`` maps a row index of
    the batch to the error of that row (a message, or a gpuserve error such as
    ``InvalidInputError`` to choose the status). Each request that owns a failed row gets that
    error; every other request of the batch gets its outputs as usual.
    """

    def __init__(self, outputs: dict[str, Any], errors: dict[int, Any]) -> None:
        super().__init__(outputs)
        self.errors = dict(errors)


@dataclass(frozen=True, slots=True)
class Admitted:
    """What a model's admission step made of one request (see :meth:`Backend.admission`).

    Attributes:
        lengths: Per row, its length in the model's unit (tokens for text models, special
            tokens included, after the model's truncation): one entry per batch row.
        inputs: Inputs to queue instead of the request's (same names, datatypes and shapes;
            e.g. texts cut before tokenisation), or None to keep them.
    """

    lengths: tuple[int, ...]
    inputs: dict[str, np.ndarray] | None = None


#: A model's admission step: the request's inputs (name -> array, batch dimension first)
#: -> :class:`Admitted`. Raises ``InvalidInputError`` (400, naming the input) for bad input.
AdmissionStep = Callable[[dict[str, np.ndarray]], Admitted]


#: A model's token counter: texts -> tokens of each (special tokens included, after truncation).
TokenCounter = Callable[[Sequence[str]], list[int]]


@dataclass(frozen=True, slots=True)
class Token:
    """One token of a tokenised text (TEI's ``/tokenize``).

    Attributes:
        id: The token id.
        text: The token's string in the vocabulary.
        special: A special token the tokenizer added (``[CLS]``, ``</s>``, ...).
        start / stop: Its characters in the text (``text[start:stop]``), or None for a
            special token.
    """

    id: int
    text: str
    special: bool
    start: int | None
    stop: int | None


#: A model's tokenizer: (texts, add_special_tokens) -> the tokens of each text, untruncated.
TextTokenizer = Callable[[Sequence[str], bool], list[list[Token]]]


@dataclass(frozen=True, slots=True)
class Capabilities:
    """What one loaded backend can do, declared once after load (:meth:`Backend.capabilities`).

    The engine reads this record once per version at load, when it picks the version's runner
    (:mod:`gpuserve.engine.runners`); nothing asks a backend again per request.

    Attributes:
        streams: :meth:`Backend.stream` runs one request as a stream of responses (decoupled).
        streams_batches: :meth:`Backend.stream_batch` runs several such requests in one call.
        reads_rows: ``preprocess_rows`` takes the batch's row contexts (each row's request
            id, sequence id and flags, parameters, cancellation: Triton Python models'
            ``request.correlation_id()``, ``flags()``, ``is_cancelled()``...; see
            :mod:`gpuserve.backends.row_context`).
        unpadded: Batches of variable-length rows run without padding (packed sequences):
            the batcher does not group by length and counts real tokens.
        takes_tensors: ``preprocess`` also takes ``torch.Tensor`` inputs (ensemble hand-off).
        gives_tensors: ``postprocess_tensors`` leaves outputs as device tensors.
        admission: The per-request admission step (:meth:`Backend.admission`), or None.
        count_tokens: Counts the tokens of texts as the model would (the OpenAI route's usage
            and token budgets), or None.
        tokenize: The model's tokenizer (TEI's ``/tokenize``; thread-safe), or None.
        generation: A generative model's loaded model, tokenizer and KV cache
            (:class:`~gpuserve.backends.causal_lm.backend.GenerationModel`): the version
            runs on the generation runner, whose engine loop runs on the instance thread.
    """

    streams: bool = False
    streams_batches: bool = False
    reads_rows: bool = False
    unpadded: bool = False
    takes_tensors: bool = False
    gives_tensors: bool = False
    admission: AdmissionStep | None = None
    count_tokens: TokenCounter | None = None
    tokenize: TextTokenizer | None = None
    generation: GenerationModel | None = None

    @classmethod
    def common(cls, each: Sequence[Capabilities]) -> Capabilities:
        """What every one of a version's instances can do (flags: all of them; hooks: the
        first instance's, since every instance runs the same model). No instance: nothing."""
        if not each:
            return cls()
        first = each[0]
        if len(each) == 1:
            return first
        return cls(
            streams=all(c.streams for c in each),
            streams_batches=all(c.streams_batches for c in each),
            reads_rows=all(c.reads_rows for c in each),
            unpadded=all(c.unpadded for c in each),
            takes_tensors=all(c.takes_tensors for c in each),
            gives_tensors=all(c.gives_tensors for c in each),
            admission=first.admission,
            count_tokens=first.count_tokens,
            tokenize=first.tokenize,
            generation=first.generation,
        )


class Backend(abc.ABC):
    """One loaded copy of a model, driven by one engine instance thread.

    Attributes:
        unpadded_batches: Whether this copy runs batches of variable-length rows without
            padding (packed sequences, e.g. the built-in BERT encoder on CUDA), read after
            load: the dynamic batcher then does not group rows by length and counts real
            tokens against ``max_batch_tokens``. Default False (batches are padded).
        takes_tensors: Whether ``preprocess`` also takes ``torch.Tensor`` inputs (on any
            device; it moves them to its own), handed on by an ensemble step. Default False:
            inputs are numpy arrays only.
        gives_tensors: Whether :meth:`postprocess_tensors` leaves outputs as tensors on the
            instance's device. Default False.
    """

    unpadded_batches: bool = False
    takes_tensors: bool = False
    gives_tensors: bool = False

    def admission(self) -> AdmissionStep | None:
        """The model's admission step, or None (the default) when it declares none.

        A step runs once per request at admission, before batching, in the server's bounded
        pool of admission threads (``admission_workers``), off the event loop: it measures
        the request (its rows' lengths, which the dynamic batcher groups by and bounds a
        batch's tokens with) and may replace its inputs (text models truncate before
        tokenising, so no request costs more than the model's limit). Asked after load,
        per request (return a stored callable: this must be cheap). The step is called from
        several threads at once and beside this instance's stages: it must be thread-safe
        and never touch what ``preprocess`` uses (a text model keeps its own tokenizer copy).
        """
        return None

    def capabilities(self) -> Capabilities:
        """What this loaded copy can do: asked once, after :meth:`load` (and ``warmup``).

        This default declares the class attributes above and :meth:`admission`; a backend
        that streams, counts tokens or reads row ids overrides it.
        """
        return Capabilities(
            unpadded=bool(self.unpadded_batches),
            takes_tensors=self.takes_tensors,
            gives_tensors=self.gives_tensors,
            admission=self.admission(),
        )

    def stream(self, inputs: dict[str, np.ndarray], sink: Any) -> None:
        """Decoupled execution of one request: its responses go to ``sink`` (a
        :class:`~gpuserve.backends.streaming.ResponseSink`). Only called when
        :meth:`capabilities` declares ``streams``.

        Raises:
            BackendError: this backend cannot run decoupled models (the default).
        """
        raise BackendError(f"backend {type(self).__name__} cannot run decoupled models")

    def stream_batch(self, calls: Sequence[Any]) -> None:
        """Decoupled execution of several requests in one call (a list of
        :class:`~gpuserve.backends.streaming.StreamCall`). Only called when
        :meth:`capabilities` declares ``streams_batches``; this default runs them one by one."""
        for call in calls:
            self.stream(call.inputs, call.sink)

    @classmethod
    def complete_config(
        cls, config: ModelConfig, version_path: Path, *, auto_complete: bool = True
    ) -> ModelConfig:
        """Complete ``config`` from the model file of one version, or check it against it.

        The model manager calls this once per version, off the event loop and before any
        instance is built; the config it returns is the one that version is served with (the
        protocol validates requests against it, ``/v2/models/{m}/config`` shows it). A
        backend whose model files declare their tensors (ONNX, ``torch.export``) fills in
        omitted ``inputs``/``outputs`` and refuses declarations that disagree with the
        model. This default fills in nothing: it only requires both to be declared.

        Args:
            config: The validated ``config.yaml`` of the model.
            version_path: The version folder (``<repository>/<model>/<version>``).
            auto_complete: False when the server runs with ``--disable-auto-complete-config``
                (Triton's flag): the model manager has then already refused omitted inputs
                or outputs, and a backend only checks the config against the model file (a
                Python model's own completion hook does not run).

        Returns:
            The config to serve this version with (``config`` itself when nothing changes).

        Raises:
            ConfigError: the config cannot be completed, or disagrees with the model file;
                the message names the config's value and the model's.
        """
        missing = [label for label in ("inputs", "outputs") if not getattr(config, label)]
        if missing:
            raise ConfigError(
                f"{version_path.parent / 'config.yaml'}: {' and '.join(missing)} omitted, but "
                f"backend '{config.backend}' cannot read them from {version_path.name}/: "
                "declare them in config.yaml"
            )
        return config

    @abc.abstractmethod
    def load(self, context: LoadContext) -> None:
        """Load weights onto ``context.device``.

        Raises:
            Exception: any failure; the version is then reported as failed to load.
        """

    def warmup(self) -> None:  # noqa: B027 - optional hook
        """Run once after load so the first request pays no lazy-initialisation cost."""

    @abc.abstractmethod
    def preprocess(self, inputs: dict[str, np.ndarray]) -> Any:
        """CPU stage: turn batched numpy inputs into whatever ``forward`` takes."""

    def preprocess_rows(self, inputs: dict[str, np.ndarray], rows: Sequence[RowContext]) -> Any:
        """CPU stage of a backend that declares ``Capabilities.reads_rows``: as
        :meth:`preprocess`, given also the batch's row contexts (one per row, in row order).
        Without the capability the engine calls :meth:`preprocess`."""
        return self.preprocess(inputs)

    @abc.abstractmethod
    def forward(self, prepared: Any) -> Any:
        """Device stage: run the model on one prepared batch."""

    @abc.abstractmethod
    def postprocess(self, raw: Any) -> dict[str, np.ndarray]:
        """CPU stage: return output name -> numpy array, batch dimension first."""

    def postprocess_tensors(self, raw: Any) -> dict[str, Any]:
        """CPU stage of a batch in which a request takes outputs as device tensors (an
        ensemble step feeding a step on the same device): like :meth:`postprocess`, but a
        backend that ``gives_tensors`` returns ``torch.Tensor`` outputs on its device, in the
        declared datatypes; the engine converts them for the requests that need host arrays
        (:mod:`gpuserve.backends.tensors`). This default returns :meth:`postprocess`'s."""
        return self.postprocess(raw)

    def unload(self) -> None:  # noqa: B027 - optional hook
        """Release weights and device memory."""
