"""The event-loop side of one generated sequence: its stream of deltas, and the V2 view of it.

:class:`GenerationStream` is what the generation runner gives a caller: ``async for delta in
stream`` yields :class:`~gpuserve.engine.generate.messages.GenerationDelta` objects as the
engine publishes them, the last one ``finished``; :meth:`GenerationStream.cancel` ends the
sequence (its KV blocks are freed at the engine's next step). :class:`TensorStream` wraps it
as a :class:`~gpuserve.engine.runners.base.ResponseStream` of V2 responses with the
``text_output`` tensor of Triton's vLLM backend.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable

import numpy as np

from gpuserve.engine.generate.engine import DeltaSink
from gpuserve.engine.generate.messages import GenerationDelta
from gpuserve.engine.request import InferenceResponse, RequestTiming
from gpuserve.engine.runners.base import ResponseStream, StreamedResponse

#: The output tensor of Triton's vLLM backend.
TEXT_OUTPUT = "text_output"


class GenerationStream(DeltaSink):
    """The deltas of one sequence, in order (module docstring).

    Args:
        cancel: Ends the sequence on the engine (called once, by :meth:`cancel`).
        on_end: Called once when the stream ends (finished, failed or cancelled), with the
            finish reason.
    """

    def __init__(self, cancel: Callable[[], None], on_end: Callable[[str], None]) -> None:
        self._cancel = cancel
        self._on_end = on_end
        self._items: deque[GenerationDelta] = deque()
        self._waiter: asyncio.Future[None] | None = None
        self._ended = False  # the final delta arrived, or the reader cancelled
        self._read_final = False
        #: Prompt tokens and generated tokens so far (usage), as the last delta said.
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.cached_tokens = 0
        #: The prompt as text (set by the runner for typed requests: ``echo``).
        self.prompt_text = ""
        #: Monotonic seconds: when it was opened, when its first token arrived (None before).
        self.opened_s = time.monotonic()
        self.first_token_s: float | None = None
        #: Called once with the stream and its finish reason (or the error) when it ends.
        self.listeners: list[Callable[[GenerationStream, GenerationDelta | None], None]] = []

    def deliver(self, delta: GenerationDelta) -> None:
        """A delta from the engine (on the event loop thread)."""
        if self._ended:
            return
        self.prompt_tokens = delta.prompt_tokens
        self.completion_tokens = delta.completion_tokens
        self.cached_tokens = delta.cached_tokens
        if self.first_token_s is None and delta.token_ids:
            self.first_token_s = time.monotonic()
        self._items.append(delta)
        if delta.finished:
            self._ended = True
            self._on_end(delta.finish_reason or "stop")
            self._tell(delta)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    @property
    def pending(self) -> bool:
        """Whether reading now returns at once (deltas are waiting, or the stream ended)."""
        return bool(self._items) or self._ended or self._read_final

    def __aiter__(self) -> GenerationStream:
        return self

    async def __anext__(self) -> GenerationDelta:
        while not self._items:
            if self._ended or self._read_final:
                raise StopAsyncIteration
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            except BaseException:  # the reader was cancelled: the client is gone
                self.cancel()
                raise
            finally:
                self._waiter = None
        delta = self._items.popleft()
        if delta.finished:
            self._read_final = True
        return delta

    def _tell(self, final: GenerationDelta | None) -> None:
        listeners, self.listeners = self.listeners, []
        for listener in listeners:
            listener(self, final)

    async def next_batch(self) -> list[GenerationDelta]:
        """Every delta available now (waiting for at least one); empty after the end. A
        reader slower than the engine gets several steps' deltas at once."""
        try:
            first = await self.__anext__()
        except StopAsyncIteration:
            return []
        taken = [first]
        while self._items and not first.finished:
            delta = self._items.popleft()
            taken.append(delta)
            if delta.finished:
                self._read_final = True
                break
        return taken

    def cancel(self) -> None:
        """Stop generating (client gone, deadline of the caller); a no-op after the end."""
        if self._ended:
            return
        self._ended = True
        self._read_final = True
        self._cancel()
        self._on_end("abort")
        self._tell(None)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)


class TensorStream(ResponseStream):
    """A sequence's deltas as V2 responses (Triton's vLLM backend's ``text_output``).

    Args:
        inner: The sequence's stream.
        model / version / request_id: Name the responses.
        streaming: One response per engine step (``stream: true``); else one response
            with the whole text at the end.
        prefix: Text put before the generated text (the prompt, unless
            ``exclude_input_in_output``; only on the first response).
        admitted_s: Admission time, monotonic seconds (queue time of the responses).
        clock: Monotonic clock, seconds.
    """

    def __init__(
        self,
        inner: GenerationStream,
        model: str,
        version: str,
        request_id: str | None,
        streaming: bool,
        prefix: str,
        admitted_s: float,
        clock: Callable[[], float],
    ) -> None:
        self.inner = inner
        self.model = model
        self.version = version
        self.request_id = request_id
        self.streaming = streaming
        self.prefix = prefix
        self.admitted_s = admitted_s
        self.clock = clock
        self._index = 0
        self._done = False

    async def __anext__(self) -> StreamedResponse:
        if self._done:
            raise StopAsyncIteration
        text: list[str] = [self.prefix] if self._index == 0 else []
        while True:
            deltas = await self.inner.next_batch()
            if not deltas:  # cancelled
                self._done = True
                raise StopAsyncIteration
            last = deltas[-1]
            if last.error is not None:
                self._done = True
                return StreamedResponse(None, True, last.error, self._index)
            text.extend(delta.text for delta in deltas)
            if self.streaming or last.finished:
                break
        self._done = last.finished
        response = InferenceResponse(
            model_name=self.model,
            model_version=self.version,
            id=self.request_id,
            outputs={TEXT_OUTPUT: np.array(["".join(text).encode()], dtype=np.object_)},
            timing=RequestTiming(queue_s=0.0, total_s=self.clock() - self.admitted_s),
            rows=1,
        )
        item = StreamedResponse(response, last.finished, None, self._index)
        self._index += 1
        return item

    def cancel(self, reason: str = "cancelled") -> None:
        self._done = True
        self.inner.cancel()


__all__ = ["TEXT_OUTPUT", "GenerationStream", "TensorStream"]
