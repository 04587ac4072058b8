"""Generation through typed APIs (OpenAI's completions and chat): admission of each choice by
the inference service, then the generation runner's stream of deltas.

A call with ``n`` choices (or several prompts) is one admission per sequence, each through
:meth:`InferenceService.admit_loaded <gpuserve.service.inference.InferenceService.admit_loaded>`
like any request (load on demand, canary routing, counting, refusals), decoded by the front
end's :class:`~gpuserve.service.inference.WireRequest` into a request whose ``generation``
holds the prompt and sampling values. If one sequence is refused, those already admitted are
cancelled and the call fails with that refusal: a call is served whole or not at all.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from gpuserve.engine.generate.messages import GenerationDelta
from gpuserve.engine.generate.streams import GenerationStream
from gpuserve.engine.request import InferenceResponse, RequestTiming, RequestTrace
from gpuserve.engine.runners.generate import GenerateRunner
from gpuserve.errors import InvalidInputError, RequestTimeoutError
from gpuserve.service.inference import InferenceService, WireRequest


@dataclass(slots=True)
class GenerationCall:
    """The admitted sequences of one call.

    Attributes:
        model: The model name.
        version: The version that serves them.
        streams: One stream per sequence, in the call's choice order.
        created: Unix time of admission, seconds (OpenAI's ``created``).
        model_context: Context length of the model, tokens.
    """

    model: str
    version: str
    streams: list[GenerationStream]
    created: int
    model_context: int

    def cancel(self) -> None:
        """Stop every sequence still generating (the client went away)."""
        for stream in self.streams:
            stream.cancel()


class GenerationService:
    """Opens generation calls over the inference service (module docstring).

    Args:
        service: The inference service.
    """

    def __init__(self, service: InferenceService) -> None:
        self.service = service

    async def open(
        self,
        model: str,
        wires: Sequence[WireRequest],
        is_cancelled: Callable[[], bool] | None = None,
        traceparent: str | None = None,
    ) -> GenerationCall:
        """Admit one sequence per wire request and start them.

        Raises:
            GpuserveError: the first refusal (unknown model: 404; a model that does not
                generate, a bad value: 400; too many sequences: 429; unloading: 503);
                already counted.
        """
        streams: list[GenerationStream] = []
        version = ""
        context = 0
        try:
            for wire in wires:
                admission = await self.service.admit_loaded(
                    model, None, wire, is_cancelled, traceparent
                )
                runner = admission.runner
                if not isinstance(runner, GenerateRunner):  # decode refuses it first
                    raise InvalidInputError(f"model '{model}' does not generate text")
                trace = admission.request.trace
                try:
                    stream = runner.open_generation(admission.request)
                except BaseException as err:
                    if trace is not None:
                        trace.end(err)
                    raise
                if trace is not None:
                    stream.listeners.append(_ender(trace, model, admission.version, wire))
                streams.append(stream)
                version, context = admission.version, runner.context_length
        except BaseException:
            for stream in streams:
                stream.cancel()
            raise
        return GenerationCall(model, version, streams, int(time.time()), context)

    def models(self) -> list[str]:
        """Names of the models whose default version generates text, sorted."""
        names = []
        for name, model in self.service.manager.models.items():
            mv = model.route.default
            if mv is not None and mv.config.generates:
                names.append(name)
        return sorted(names)


def _ender(
    trace: RequestTrace, model: str, version: str, wire: WireRequest
) -> Callable[[GenerationStream, GenerationDelta | None], None]:
    """Ends a sequence's trace when its stream ends: a response whose timing is its time to
    first token (waiting and prefill) and its decode; the error; None when cancelled."""
    request_id = wire.request_id()

    def end(stream: GenerationStream, final: GenerationDelta | None) -> None:
        if final is None or final.finish_reason == "abort":
            trace.end(None)
            return
        if final.error is not None:
            trace.end(final.error)
            return
        if final.finish_reason == "timeout":
            trace.end(RequestTimeoutError("the generation passed its deadline"))
            return
        now = time.monotonic()
        first = stream.first_token_s or now
        timing = RequestTiming(
            queue_s=first - stream.opened_s,
            compute_s=now - first,
            total_s=now - stream.opened_s,
            batch_size=1,
            tokens=(final.prompt_tokens, final.completion_tokens),
        )
        trace.end(InferenceResponse(model, version, request_id, {}, timing, 1))

    return end


__all__ = ["GenerationCall", "GenerationService"]
