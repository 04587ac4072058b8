"""The embeddings service without sockets: which configurations serve embeddings (the
``embedding:`` declaration, the automatic huggingface case, its checks), how a call is split,
how answers are put back in order and cut, where token counts come from and on which thread,
and what a refused chunk does to the rest of its call."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from gpuserve.backends.base import Capabilities
from gpuserve.backends.python import PythonBackend
from gpuserve.backends.triton_python.backend import PythonModelBackend
from gpuserve.config import (
    EmbeddingConfig,
    ModelConfig,
    ServerConfig,
    TensorSpec,
    default_model_repository,
    load_model_config,
)
from gpuserve.engine.request import InferenceResponse
from gpuserve.engine.runners.batching import ModelScheduler
from gpuserve.errors import BackendError, ConfigError, ModelNotFoundError, OverloadedError
from gpuserve.metrics import ServerMetrics
from gpuserve.protocol.openai_codec import EmbeddingsBody
from gpuserve.repository.manager import Model, ModelManager, ModelVersion, Route, VersionState
from gpuserve.service.apis import embeddings as emb
from gpuserve.service.apis.embeddings import (
    EmbeddingSpec,
    EmbeddingsService,
    embedding_spec,
    model_counter,
    split_rows,
)
from gpuserve.service.inference import InferenceService


def tensors(**embedding) -> ModelConfig:
    return ModelConfig(
        name="m",
        max_batch_size=2,
        inputs=[TensorSpec(name="TEXT", datatype="BYTES", shape=[1])],
        outputs=[TensorSpec(name="EMBEDDING", datatype="FP32", shape=[4])],
        embedding=EmbeddingConfig(**embedding) if embedding is not None else None,
    )


# -- which models ----------------------------------------------------------------------------


def test_the_default_text_embedding_model_opts_in():
    config = load_model_config(default_model_repository() / "text_embedding" / "config.yaml")
    spec = embedding_spec(config)
    assert spec == EmbeddingSpec("TEXT", None, "EMBEDDING", 384, (), True, "model")
    assert embedding_spec(config) is spec  # resolved once per configuration
    simple = load_model_config(default_model_repository() / "simple" / "config.yaml")
    assert embedding_spec(simple) is None


def test_huggingface_feature_extraction_is_automatic_and_can_opt_out():
    hf = ModelConfig(name="hf", backend="huggingface")  # tensors filled in at load
    assert embedding_spec(hf) == EmbeddingSpec("TEXT", None, "EMBEDDING", None, (), True, "model")
    completed = hf.model_copy(
        update={
            "inputs": [TensorSpec(name="SENTENCE", datatype="BYTES", shape=[1])],
            "outputs": [TensorSpec(name="EMBEDDING", datatype="FP32", shape=[16])],
        }
    )
    spec = embedding_spec(completed)
    assert spec is not None and (spec.text_input, spec.width) == ("SENTENCE", 16)
    off = ModelConfig(name="hf", backend="huggingface", embedding={"enabled": False})
    assert embedding_spec(off) is None
    classifier = ModelConfig(
        name="c", backend="huggingface", huggingface={"task": "sequence-classification"}
    )
    assert embedding_spec(classifier) is None


@pytest.mark.parametrize(
    ("embedding", "match"),
    [
        ({"text_input": "NOPE"}, "embedding.text_input 'NOPE' is not an input of model 'm'"),
        ({"output": "NOPE"}, "embedding.output 'NOPE' is not an output of model 'm'"),
        ({"dimensions": [2, 8]}, r"dimensions \[8\] exceed the width 4"),
        ({"token_ids_input": "TEXT", "text_input": None}, "must be INT64 or INT32"),
        ({"text_input": None, "token_ids_input": None}, "set text_input, token_ids_input"),
        ({"dimensions": [2, 2]}, "must not repeat"),
        ({"dimensions": [0]}, "must be >= 1"),
    ],
)
def test_declarations_that_do_not_fit_fail_at_load(embedding, match):
    with pytest.raises(ValueError, match=match):
        tensors(**embedding)


def test_other_inputs_must_be_optional():
    with pytest.raises(ValueError, match=r"inputs \['EXTRA'\] are required"):
        ModelConfig(
            name="m",
            inputs=[
                TensorSpec(name="TEXT", datatype="BYTES", shape=[1]),
                TensorSpec(name="EXTRA", datatype="FP32", shape=[1]),
            ],
            outputs=[TensorSpec(name="EMBEDDING", datatype="FP32", shape=[4])],
            embedding={},
        )


def test_a_completed_configuration_that_does_not_fit_is_a_config_error():
    hf = ModelConfig(
        name="hf",
        backend="huggingface",
        outputs=[TensorSpec(name="EMBEDDING", datatype="BYTES", shape=[1])],
    )
    with pytest.raises(ConfigError, match="model 'hf': embedding.output 'EMBEDDING' is BYTES"):
        embedding_spec(hf)


# -- splitting -----------------------------------------------------------------------------


def body(texts=None, ids=None) -> EmbeddingsBody:
    return EmbeddingsBody("m", texts, ids)


def test_a_call_within_one_batch_is_one_chunk_in_order():
    assert split_rows(body(["bbb", "a", "cc"]), 4) == [[0, 1, 2]]


def test_longer_calls_are_cut_in_near_equal_chunks_ordered_by_length():
    texts = ["x" * n for n in (5, 1, 9, 3, 7)]
    chunks = split_rows(body(texts), 2)
    assert [len(c) for c in chunks] == [2, 2, 1]
    assert [len(texts[i]) for chunk in chunks for i in chunk] == [1, 3, 5, 7, 9]
    assert [len(c) for c in split_rows(body(["x"] * 65), 64)] == [33, 32]
    assert [len(c) for c in split_rows(body(["x"] * 128), 64)] == [64, 64]
    assert split_rows(body(["a", "b"]), 0) == [[0], [1]]  # no batching: one row each


def test_token_id_rows_are_grouped_by_length():
    ids = [[1, 2], [3], [4, 5], [6], [7, 8], [9, 9]]
    chunks = split_rows(body(ids=ids), 2)
    assert sorted(map(sorted, chunks)) == [[0, 2], [1, 3], [4, 5]]
    assert all(len({len(ids[i]) for i in chunk}) == 1 for chunk in chunks)


# -- answers -------------------------------------------------------------------------------


def response(values) -> InferenceResponse:
    return InferenceResponse("m", "1", None, {"EMBEDDING": np.asarray(values, np.float32)})


SPEC = EmbeddingSpec("TEXT", None, "EMBEDDING", 4, (2,), True, "model")


def test_rows_come_back_in_input_order():
    chunks = [[2, 0], [1]]
    out = emb._assemble(chunks, [response([[2] * 4, [0] * 4]), response([[1] * 4])], SPEC, None)
    assert out.dtype == np.float32 and out.flags.c_contiguous
    assert out[:, 0].tolist() == [0, 1, 2]


def test_dimensions_cut_and_renormalise():
    values = [[3.0, 4.0, 1.0, 1.0]]
    cut = emb._assemble([[0]], [response(values)], SPEC, 2)
    np.testing.assert_allclose(cut, [[0.6, 0.8]])
    raw = EmbeddingSpec("TEXT", None, "EMBEDDING", 4, (2,), False, "model")
    assert emb._assemble([[0]], [response(values)], raw, 2).tolist() == [[3.0, 4.0]]
    assert emb._assemble([[0]], [response([[0.0] * 4])], SPEC, 2).tolist() == [[0.0, 0.0]]


def test_a_response_with_the_wrong_rows_is_a_backend_error():
    with pytest.raises(BackendError, match="2 embeddings for 1 inputs"):
        emb._assemble([[0]], [response([[1] * 4, [2] * 4])], SPEC, None)
    empty = InferenceResponse("m", "1", None, {})
    with pytest.raises(BackendError, match="no 'EMBEDDING'"):
        emb._assemble([[0]], [empty], SPEC, None)


# -- token counts --------------------------------------------------------------------------


@dataclass
class FakeInstance:
    """What the service reads of an instance: its backend (and capacity for the core)."""

    backend: object
    name: str = "fake"
    in_flight: int = 0
    capacity: int = 0  # never dispatches


class Counting:
    def __init__(self) -> None:
        self.threads: list[str] = []

    def count_tokens(self, texts: Sequence[str]) -> list[int]:
        self.threads.append(threading.current_thread().name)
        return [len(t.split()) for t in texts]

    def capabilities(self) -> Capabilities:
        """A text backend declares its own counter (as ``huggingface`` does)."""
        return Capabilities(count_tokens=self.count_tokens)


def python_backend(model) -> PythonBackend:
    """The ``python`` backend's ``Model`` implementation, holding the user's class."""
    backend = PythonBackend()
    backend.model = model
    return backend


def wrapping_backend(model) -> PythonModelBackend:
    """The ``python`` backend: an implementation (``impl``) holding the user's class."""
    backend = PythonModelBackend()
    backend.impl = python_backend(model)
    return backend


def scheduler_with(backend: object, max_batch_size: int = 2, queue: int = 8) -> ModelScheduler:
    config = tensors().model_copy(
        update={
            "max_batch_size": max_batch_size,
            "dynamic_batching": tensors().dynamic_batching.model_copy(
                update={"max_queue_size": queue}
            ),
        }
    )
    declare = getattr(backend, "capabilities", None)
    capabilities = declare() if callable(declare) else Capabilities()
    scheduler = ModelScheduler(config, "1", capabilities)
    scheduler.instances = [FakeInstance(backend)]
    return scheduler


def test_the_counter_is_the_backends_or_the_python_models():
    counting = Counting()
    assert model_counter(scheduler_with(counting)) == counting.count_tokens
    assert model_counter(scheduler_with(python_backend(counting))) == counting.count_tokens
    wrapped = wrapping_backend(counting)
    assert model_counter(scheduler_with(wrapped)) == counting.count_tokens
    assert model_counter(scheduler_with(object())) is None


def service_over(scheduler: ModelScheduler) -> InferenceService:
    config = scheduler.config
    manager = ModelManager(Path("/nonexistent"))
    mv = ModelVersion("m", 1, Path("/repo/m/1"), config, state=VersionState.READY)
    mv.runner = scheduler
    model = Model("m", config, path=Path("/repo/m"))
    model.versions = {1: mv}
    model.route = Route(mv)
    manager.models["m"] = model
    manager.initial_load_done = True
    metrics = ServerMetrics(manager, gpu=False, process=False)
    return InferenceService(manager, ServerConfig(model_repository=Path("/nonexistent")), metrics)


def test_short_calls_are_counted_inline_and_long_ones_in_the_pool():
    counting = Counting()
    scheduler = scheduler_with(counting)
    service = EmbeddingsService(service_over(scheduler))

    async def count(texts: list[str]) -> int:
        scheduler.attach(scheduler.instances, asyncio.get_running_loop())
        call = body(texts)
        admission = service.service.admit("m", None, call.wire([0]))
        counted = service._count(admission, call, SPEC)
        return counted if isinstance(counted, int) else sum(await counted)

    assert asyncio.run(count(["two words"])) == 2
    long = "word " * emb.INLINE_COUNT_CHARS
    assert asyncio.run(count([long])) == emb.INLINE_COUNT_CHARS
    assert counting.threads[0] == threading.current_thread().name
    assert counting.threads[1].startswith("gpuserve-tokens")


def test_token_ids_count_their_ids_and_none_counts_nothing():
    service = EmbeddingsService(service_over(scheduler_with(Counting())))
    call = body(ids=[[1, 2, 3], [4]])
    assert service._count(None, call, SPEC) == 4  # type: ignore[arg-type]
    off = EmbeddingSpec("TEXT", None, "EMBEDDING", 4, (), True, "none")
    assert service._count(None, body(["a b"]), off) == 0  # type: ignore[arg-type]


# -- a call --------------------------------------------------------------------------------


def unrouted(service: InferenceService, reason: str) -> float:
    assert service.metrics is not None
    value = service.metrics.registry.get_sample_value(
        "gpuserve_requests_total",
        {"model": "_unknown", "version": "_unknown", "outcome": "failure", "reason": reason},
    )
    return value or 0.0


def test_an_unknown_model_is_not_found_and_counted_once():
    inference = service_over(scheduler_with(Counting()))
    service = EmbeddingsService(inference)
    with pytest.raises(ModelNotFoundError, match=r"'nope' does not exist .*serving embeddings: m"):
        asyncio.run(service.embed(EmbeddingsBody("nope", ["x"], None)))
    assert unrouted(inference, "not_found") == 1


def test_a_refused_chunk_fails_the_call_and_drops_the_chunks_already_queued():
    scheduler = scheduler_with(Counting(), max_batch_size=1, queue=1)
    inference = service_over(scheduler)
    service = EmbeddingsService(inference)
    submitted = []
    submit = inference.submit

    def spy(admission):
        submitted.append(admission)
        return submit(admission)

    inference.submit = spy  # type: ignore[method-assign]

    async def call() -> None:
        scheduler.attach(scheduler.instances, asyncio.get_running_loop())
        await service.embed(EmbeddingsBody("m", ["a", "b"], None))  # two chunks, queue of 1

    with pytest.raises(OverloadedError):
        asyncio.run(call())
    assert len(submitted) == 2
    first = submitted[0].request
    assert first.is_cancelled is not None and first.is_cancelled()  # dropped when batched


# -- the built-in counters -----------------------------------------------------------------


def test_sentence_embedder_counts_what_it_embeds_from_any_thread():
    from gpuserve.models.sentence_embedding import SentenceEmbedder

    embedder = SentenceEmbedder.load()
    texts = ["Hello world.", "word " * 400, "GPU", "Ünïcödé 🚀 中文"]
    expected = embedder.tokenize(texts).attention_mask.sum(dim=1).tolist()
    assert expected[1] == embedder.max_seq_len
    counts: list[list[int]] = []
    threads = [
        threading.Thread(target=lambda: counts.append(embedder.count_tokens(texts)))
        for _ in range(4)
    ]
    for thread in threads:
        thread.start()
    for _ in range(4):  # the CPU stage's tokenizer keeps its padding meanwhile
        assert embedder.tokenize(texts).input_ids.shape == (4, embedder.max_seq_len)
    for thread in threads:
        thread.join()
    assert counts == [expected] * 4
