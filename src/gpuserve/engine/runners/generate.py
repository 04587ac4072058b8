"""The generation runner: generative models, continuous batching over a paged KV cache.

The runner of a version whose backend declares a
:class:`~gpuserve.backends.causal_lm.backend.GenerationModel` (``generate:`` in its config, or
``huggingface.task: text-generation``). Each instance runs one
:class:`~gpuserve.engine.generate.engine.GenerationEngine` loop on its own thread (the thread
that loaded the model); the runner admits sequences, sends each to the least busy engine and
hands the engine's deltas back on the event loop.

Two ways in:

* :meth:`GenerateRunner.generate`: a typed
  :class:`~gpuserve.engine.generate.messages.GenerationRequest` (token ids and sampling
  values), answered by a :class:`~gpuserve.engine.generate.streams.GenerationStream` of
  deltas (the OpenAI and generate APIs, through the service);
* the :class:`~gpuserve.engine.runners.base.VersionRunner` contract, for V2 infer, gRPC
  streams, Triton's generate extension and BLS: the tensors of Triton's vLLM backend
  (:mod:`gpuserve.engine.generate.tensors`), a decoupled model.

Admission refuses at once what can never run: an empty prompt, a prompt plus ``max_tokens``
past the context length (400 naming both numbers and the limit), and sequences past
``max_running + max_waiting`` (429).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import Callable
from pathlib import Path

from gpuserve.backends.base import Capabilities
from gpuserve.backends.causal_lm.backend import GenerationModel
from gpuserve.backends.causal_lm.params import SamplingParams
from gpuserve.config import ModelConfig
from gpuserve.config.generate import GenerateConfig
from gpuserve.engine.admission import AdmissionPool
from gpuserve.engine.generate.defaults import sampling_defaults, sampling_limits
from gpuserve.engine.generate.engine import DeltaSink, GenerationEngine
from gpuserve.engine.generate.messages import (
    GenerationDelta,
    GenerationInput,
    GenerationRequest,
)
from gpuserve.engine.generate.stats import GenerationStats
from gpuserve.engine.generate.streams import GenerationStream, TensorStream
from gpuserve.engine.generate.tensors import tensor_request
from gpuserve.engine.instance import Instance
from gpuserve.engine.request import InferenceRequest, InferenceResponse
from gpuserve.engine.runners.base import ResponseStream, VersionRunner
from gpuserve.engine.stats import RequestStats
from gpuserve.errors import InvalidInputError, OverloadedError, UnavailableError

#: How a sequence's finish reason is counted in the request series (None: success).
_REASONS: dict[str, str | None] = {
    "stop": None,
    "length": None,
    "abort": "cancelled",
    "timeout": "timeout",
    "error": "backend",
}


class GenerateRunner(VersionRunner):
    """Runs the sequences of one generative model version (module docstring).

    Args:
        config: The version's configuration (with its ``generate`` section).
        version: Its version number as a string.
        capabilities: What its instances declared (``generation`` set).
        admission_pool: Unused (no admission step); kept for the common signature.
        clock: Monotonic clock, seconds.

    Attributes:
        model: The first instance's loaded model (tokenizer, chat template, context length).
        settings: The ``generate`` section.
        defaults: Sampling values of a request that names none.
        limits: Caps on ``n``, stop strings and ``top_logprobs``.
    """

    kind = "generate"

    def __init__(
        self,
        config: ModelConfig,
        version: str,
        capabilities: Capabilities,
        admission_pool: AdmissionPool | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(config, version, capabilities, admission_pool, clock)
        assert capabilities.generation is not None
        self.model: GenerationModel = capabilities.generation
        self.settings: GenerateConfig = config.generate or GenerateConfig()
        self.defaults = sampling_defaults(self.settings)
        self.limits = sampling_limits(self.settings)
        self._instances: list[Instance] = []
        self._engines: list[GenerationEngine] = []
        self._load: list[int] = []  # sequences on each engine
        self._loop: asyncio.AbstractEventLoop | None = None
        self.accepting = False
        self._in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._ids = itertools.count(1)

    def attach(self, instances: list[Instance], loop: asyncio.AbstractEventLoop) -> None:
        """Start one engine loop on each started instance's thread; accept requests."""
        self._instances = instances
        self._loop = loop
        settings = self.settings
        for instance in instances:
            generation = instance.capabilities.generation
            assert generation is not None
            engine = GenerationEngine(
                generation,
                settings.max_running,
                settings.max_tokens_per_step,
                settings.prefix_caching,
                self._publish,
                self.clock,
                settings.decode_slowdown_limit,
            )
            self._engines.append(engine)
            self._load.append(0)
            instance.run_loop(engine.run)
        self.accepting = True

    # -- the typed entry -------------------------------------------------------------------

    @property
    def context_length(self) -> int:
        """Longest sequence, prompt and output, tokens."""
        return self.model.context_length

    @property
    def stats_of_engines(self) -> list[GenerationStats]:
        """Each engine's statistics (metrics)."""
        return [engine.stats for engine in self._engines]

    def check(self, prompt_tokens: int, params: SamplingParams) -> None:
        """Refuse what can never run (see the module docstring).

        Raises:
            InvalidInputError: empty prompt, or prompt + max_tokens past the context.
        """
        if prompt_tokens == 0:
            raise InvalidInputError("the prompt is empty: it needs at least one token")
        limit = self.context_length
        if prompt_tokens + params.max_tokens > limit:
            raise InvalidInputError(
                f"the prompt has {prompt_tokens} tokens and max_tokens is "
                f"{params.max_tokens}: {prompt_tokens + params.max_tokens} tokens, past the "
                f"context length of model '{self.name}' ({limit} tokens); shorten the prompt "
                "or lower max_tokens"
            )

    def generate(self, request: GenerationRequest) -> GenerationStream:
        """Admit one sequence; its deltas come from the returned stream.

        Raises:
            InvalidInputError: see :meth:`check`.
            OverloadedError: ``max_running + max_waiting`` sequences are already admitted.
            UnavailableError: the version is unloading.
        """
        self.check(len(request.prompt_ids), request.params)
        if not self.accepting or not self._engines:
            raise self._counted(
                UnavailableError(f"model '{self.name}' version {self.version} is unloading")
            )
        capacity = self.settings.max_running + self.settings.max_waiting
        if self._in_flight >= capacity:
            raise self._counted(
                OverloadedError(
                    f"model '{self.name}' has {self._in_flight} sequences admitted, its limit "
                    f"(generate.max_running + generate.max_waiting = {capacity}); retry later"
                )
            )
        index = min(range(len(self._engines)), key=self._load.__getitem__)
        engine = self._engines[index]
        admitted = self.clock()
        request.arrival_s = request.arrival_s or admitted
        seq_id: list[int] = []

        def end(reason: str) -> None:
            self._load[index] -= 1
            self._ended(reason, admitted)

        stream = GenerationStream(lambda: engine.cancel(seq_id[0]), end)
        self._in_flight += 1
        self._idle.clear()
        self._load[index] += 1
        seq_id.append(engine.submit(request, stream))
        return stream

    def open_generation(self, request: InferenceRequest) -> GenerationStream:
        """Admit a request decoded by a typed API (``request.generation`` set): render the
        chat, tokenise, check and submit it. The stream's ``prompt_text`` is the prompt as
        text (for ``echo``).

        Raises:
            InvalidInputError: no ``generation``; a chat for a model without a chat
                template; a token id outside the vocabulary; see :meth:`check`.
            OverloadedError, UnavailableError: as :meth:`generate`.
        """
        asked = request.generation
        try:
            if asked is None:
                raise InvalidInputError(f"model '{self.name}' needs a generation request")
            prompt_text, prompt_ids = self._prompt(asked)
        except InvalidInputError as err:
            raise self._counted(err) from None
        deadline = None
        if request.timeout_us:
            deadline = self.clock() + request.timeout_us / 1e6
        stream = self.generate(
            GenerationRequest(
                request.id or "",
                prompt_ids,
                asked.params,
                deadline_s=deadline,
                bulk=request.lane == "bulk",
            )
        )
        stream.prompt_text = prompt_text
        return stream

    def _prompt(self, asked: GenerationInput) -> tuple[str, list[int]]:
        """The prompt's text and token ids."""
        model = self.model
        if asked.messages is not None:
            try:
                text = model.render_chat(asked.messages)
            except ValueError as err:
                raise InvalidInputError(f"model '{self.name}': {err}") from None
            except Exception as err:  # the template raised (jinja2): the messages' fault
                raise InvalidInputError(
                    f"model '{self.name}': its chat template refused the messages: {err}"
                ) from None
            return text, model.encode_chat(text)
        if isinstance(asked.prompt, list):
            vocab = model.vocab_size
            bad = next((t for t in asked.prompt if not 0 <= t < vocab), None)
            if bad is not None:
                raise InvalidInputError(
                    f"'prompt' holds token id {bad}, outside the vocabulary of model "
                    f"'{self.name}' (0 to {vocab - 1})"
                )
            return model.decode(asked.prompt), list(asked.prompt)
        text = asked.prompt or ""
        return text, model.encode(text)

    def _ended(self, reason: str, admitted: float) -> None:
        self._in_flight -= 1
        if not self._in_flight:
            self._idle.set()
        now = self.clock()
        self.stats.record_request(
            RequestStats(self.name, self.version, 1, 0.0, 0.0, now - admitted, _REASONS[reason])
        )

    def _counted(self, err: InvalidInputError | OverloadedError | UnavailableError) -> Exception:
        self._refused(err)
        return err

    def _publish(self, deltas: list[tuple[DeltaSink, GenerationDelta]]) -> None:
        """From an engine thread: hand one step's deltas to the event loop."""
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
            loop.call_soon_threadsafe(_deliver, deltas)

    # -- the VersionRunner contract (V2 tensors) -------------------------------------------

    @property
    def in_flight_requests(self) -> int:
        """Sequences admitted and not yet ended."""
        return self._in_flight

    @property
    def queued(self) -> int:
        """Sequences waiting for a slot in the running batch."""
        return sum(engine.stats.waiting for engine in self._engines)

    @property
    def instances(self) -> list[Instance]:
        """The version's instances."""
        return self._instances

    @property
    def healthy(self) -> bool:
        """Whether an engine can run sequences."""
        return bool(self._engines)

    def start_trace(self, batches: int, directory: Path) -> None:
        """Not supported for generative models (the engine has no batches to profile)."""

    def _open(self, request: InferenceRequest) -> ResponseStream:
        """The V2 stream of a request with the vLLM backend's tensors."""
        return self._tensor_stream(request, unary=False)

    def _tensor_stream(self, request: InferenceRequest, unary: bool) -> TensorStream:
        try:
            parsed = tensor_request(request, self.model, self.defaults, self.limits, self.clock)
        except InvalidInputError as err:
            raise self._counted(err) from None
        parsed.request.bulk = request.lane == "bulk"
        stream = self.generate(parsed.request)
        return TensorStream(
            stream,
            self.name,
            self.version,
            request.id,
            parsed.streaming and not unary,
            parsed.prefix,
            parsed.request.arrival_s,
            self.clock,
        )

    def _queue(self, request: InferenceRequest) -> asyncio.Future[InferenceResponse]:
        """The one response of a unary call: the whole text at the end."""
        return asyncio.ensure_future(self._collect(self._tensor_stream(request, unary=True)))

    async def _collect(self, stream: ResponseStream) -> InferenceResponse:
        try:
            async for item in stream:
                if item.error is not None:
                    raise item.error
                if item.final and item.response is not None:
                    return item.response
        finally:
            stream.cancel()  # a no-op after the final item
        raise UnavailableError(f"model '{self.name}': the generation was stopped")

    async def close(self, drain_timeout_s: float = 30.0) -> None:
        """Refuse new sequences, let running ones end (up to the timeout), then stop the
        engines (what is left ends with ``abort``) and the instances."""
        self.accepting = False
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._idle.wait(), drain_timeout_s)
        for engine in self._engines:
            engine.stop()
        loop = asyncio.get_running_loop()
        for instance in self._instances:
            await loop.run_in_executor(None, instance.stop)
        await asyncio.sleep(0)  # deliver the engines' last deltas


def _deliver(deltas: list[tuple[DeltaSink, GenerationDelta]]) -> None:
    for sink, delta in deltas:
        sink.deliver(delta)


__all__ = ["GenerateRunner"]
