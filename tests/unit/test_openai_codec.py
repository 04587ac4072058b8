"""The OpenAI embeddings wire without sockets: body validation (each refusal names its
``param``), chunks decoded into engine requests against a configuration, answers in float and
base64, the model list, and the error table of the HTTP adapter."""

from __future__ import annotations

import base64

import numpy as np
import orjson
import pytest

from gpuserve.config import EmbeddingConfig, ModelConfig, TensorSpec
from gpuserve.errors import (
    BackendError,
    InvalidInputError,
    ModelNotFoundError,
    ModelNotReadyError,
    OverloadedError,
    UnauthenticatedError,
)
from gpuserve.protocol.limits import RequestLimits
from gpuserve.protocol.openai_codec import (
    MAX_INPUTS,
    EmbeddingsBody,
    TooManyInputsError,
    encode_embeddings,
    encode_model,
    encode_model_list,
    load_body,
    parse_embeddings,
)
from gpuserve.server.http.openai_errors import OpenAIHttpError, error_answer
from gpuserve.service.apis.embeddings import EmbeddingInputError, EmbeddingModelView, EmbeddingResult


def text_config(max_batch_size: int = 4, **embedding) -> ModelConfig:
    return ModelConfig(
        name="emb",
        max_batch_size=max_batch_size,
        inputs=[TensorSpec(name="TEXT", datatype="BYTES", shape=[1])],
        outputs=[TensorSpec(name="EMBEDDING", datatype="FP32", shape=[8])],
        embedding=EmbeddingConfig(**embedding),
    )


def ids_config() -> ModelConfig:
    return ModelConfig(
        name="ids",
        max_batch_size=4,
        inputs=[
            TensorSpec(name="TEXT", datatype="BYTES", shape=[1], optional=True),
            TensorSpec(name="IDS", datatype="INT32", shape=[-1], optional=True),
        ],
        outputs=[TensorSpec(name="EMBEDDING", datatype="FP32", shape=[8])],
        embedding=EmbeddingConfig(token_ids_input="IDS"),
    )


def parse(**document) -> EmbeddingsBody:
    return parse_embeddings({"model": "emb", **document})


# -- bodies --------------------------------------------------------------------------------


def test_input_forms():
    assert parse(input="one").texts == ["one"]
    assert parse(input=["a", "b"]).texts == ["a", "b"]
    body = parse(input=[1, 2, 3])
    assert (body.texts, body.token_ids, body.rows) == (None, [[1, 2, 3]], 1)
    assert parse(input=[[1], [2, 3]]).token_ids == [[1], [2, 3]]


def test_defaults_and_options():
    body = parse(input="x", unknown_key={"ignored": True})
    assert (body.encoding_format, body.dimensions, body.user) == ("float", None, None)
    body = parse(input="x", encoding_format="base64", dimensions=64, user="u1")
    assert (body.encoding_format, body.dimensions, body.user) == ("base64", 64, "u1")
    assert parse(input="x", encoding_format=None).encoding_format == "float"


@pytest.mark.parametrize(
    ("document", "param", "match"),
    [
        ({"input": "x"}, "model", "'model' must be a non-empty string"),
        ({"model": "", "input": "x"}, "model", "non-empty string"),
        ({"model": "emb"}, "input", "'input' is required"),
        ({"model": "emb", "input": []}, "input", "'input' is empty"),
        ({"model": "emb", "input": ""}, "input", r"input\[0\] is an empty string"),
        ({"model": "emb", "input": ["a", ""]}, "input", r"input\[1\] is an empty string"),
        ({"model": "emb", "input": {"a": 1}}, "input", "must be a string, a list"),
        ({"model": "emb", "input": None}, "input", "token-id arrays, got null$"),
        ({"model": "emb", "input": ["a", 1]}, "input", r"input\[1\] must be a string like"),
        ({"model": "emb", "input": [1, "a"]}, "input", r"input\[1\] must be an integer"),
        ({"model": "emb", "input": [True]}, "input", r"input\[0\] must be a string, an int"),
        ({"model": "emb", "input": [1.5]}, "input", r"input\[0\] must be a string, an int"),
        ({"model": "emb", "input": [[1], []]}, "input", r"input\[1\] is an empty token"),
        ({"model": "emb", "input": [[1, "2"]]}, "input", "only integer token ids"),
        ({"model": "emb", "input": [[1, -2]]}, "input", "token ids must be >= 0"),
        ({"model": "emb", "input": [-1]}, "input", "token ids must be >= 0"),
        ({"model": "emb", "input": "x", "encoding_format": "hex"}, "encoding_format", "float"),
        ({"model": "emb", "input": "x", "dimensions": 0}, "dimensions", "positive integer"),
        ({"model": "emb", "input": "x", "dimensions": True}, "dimensions", "positive integer"),
        ({"model": "emb", "input": "x", "dimensions": "8"}, "dimensions", "positive integer"),
        ({"model": "emb", "input": "x", "user": 3}, "user", "'user' must be a string"),
    ],
)
def test_invalid_bodies_name_their_field(document, param, match):
    with pytest.raises(EmbeddingInputError, match=match) as caught:
        parse_embeddings(document)
    assert caught.value.param == param
    assert error_answer(caught.value).status == 400


def test_more_inputs_than_allowed_is_too_large():
    parse(input=["x"] * MAX_INPUTS)
    with pytest.raises(TooManyInputsError) as caught:
        parse(input=["x"] * (MAX_INPUTS + 1))
    answer = error_answer(caught.value)
    assert (answer.status, answer.code, answer.param) == (413, "request_too_large", "input")


def test_the_servers_cap_is_the_one_check_and_a_lower_model_cap_wins():
    limits = RequestLimits(1000, 1000, max_inputs_per_call=5)
    parse_embeddings({"model": "m", "input": ["x"] * 5}, limits)
    with pytest.raises(TooManyInputsError, match=r"'input' has 6 items, more than the 5 .*"):
        parse_embeddings({"model": "m", "input": ["x"] * 6}, limits)
    cap = ("ce", "rerank.max_documents", 3)
    limits.check_inputs("documents", 3, cap)
    with pytest.raises(TooManyInputsError, match=r"more than the 3 model 'ce' takes .*"):
        limits.check_inputs("documents", 4, cap)
    limits.check_inputs("documents", 5, ("ce", "rerank.max_documents", None))  # the server's
    with pytest.raises(TooManyInputsError, match=r"max_inputs_per_call") as caught:
        limits.check_inputs("documents", 6, ("ce", "rerank.max_documents", 50))  # not higher
    assert (caught.value.count, caught.value.limit, caught.value.param) == (6, 5, "documents")


def test_a_text_over_the_byte_limit_is_refused_with_its_index():
    limits = RequestLimits(max_tensor_elements=1000, max_bytes_element_bytes=8)
    parse_embeddings({"model": "m", "input": ["12345678", "ab"]}, limits)
    with pytest.raises(EmbeddingInputError, match=r"input\[1\] is more than .* 8 bytes"):
        parse_embeddings({"model": "m", "input": ["ok", "éééé é"]}, limits)  # 11 bytes


@pytest.mark.parametrize(("raw", "match"), [(b"{", "not valid JSON"), (b"[1]", "JSON object")])
def test_bodies_that_are_not_json_objects(raw, match):
    with pytest.raises(EmbeddingInputError, match=match):
        load_body(raw)
    assert load_body(bytearray(b'{"model": "m"}')) == {"model": "m"}


# -- chunks --------------------------------------------------------------------------------


def test_a_chunk_of_texts_is_a_bytes_tensor_in_the_given_row_order():
    body = parse(input=["zero", "one", "two"], user="alice")
    wire = body.wire([2, 0])
    assert wire.request_id() == "alice"  # the canary split is by user
    request = wire.decode(text_config(), "emb", "3")
    assert (request.model_name, request.model_version) == ("emb", "3")
    assert request.requested_outputs == ["EMBEDDING"]
    text = request.inputs["TEXT"]
    assert text.shape == (2, 1) and text.dtype == object
    assert text[:, 0].tolist() == [b"two", b"zero"]


def test_a_model_without_batching_gets_one_row_without_a_batch_dimension():
    request = parse(input=["only"]).wire([0]).decode(text_config(0), "emb", None)
    assert request.inputs["TEXT"].shape == (1,)


def test_a_chunk_of_token_ids_has_the_declared_integer_type():
    body = parse(input=[[1, 2], [3], [4, 5]])
    request = body.wire([0, 2]).decode(ids_config(), "ids", None)
    ids = request.inputs["IDS"]
    assert ids.dtype == np.int32 and ids.tolist() == [[1, 2], [4, 5]]
    with pytest.raises(EmbeddingInputError, match="takes text, not token ids") as caught:
        body.wire([1]).decode(text_config(), "emb", None)
    assert caught.value.param == "input"
    assert str(caught.value).endswith(
        "(LangChain's OpenAIEmbeddings: set check_embedding_ctx_length=False)"
    )
    too_big = parse(input=[[2**31]])
    with pytest.raises(InvalidInputError, match=r"out of range|INT32"):
        too_big.wire([0]).decode(ids_config(), "ids", None)


def test_a_token_only_model_refuses_text():
    config = ModelConfig(
        name="t",
        inputs=[TensorSpec(name="IDS", datatype="INT64", shape=[-1])],
        outputs=[TensorSpec(name="EMBEDDING", datatype="FP32", shape=[8])],
        embedding=EmbeddingConfig(text_input=None, token_ids_input="IDS"),
    )
    with pytest.raises(EmbeddingInputError, match="takes token ids, not text"):
        parse(input="x").wire([0]).decode(config, "t", None)


def test_dimensions_are_checked_against_the_routed_configuration():
    body = parse(input="x", dimensions=4)
    with pytest.raises(EmbeddingInputError, match="does not support 'dimensions'") as caught:
        body.wire([0]).decode(text_config(), "emb", None)
    assert caught.value.param == "dimensions"
    body.wire([0]).decode(text_config(dimensions=[4, 2]), "emb", None)
    parse(input="x", dimensions=8).wire([0]).decode(text_config(dimensions=[4]), "emb", None)
    with pytest.raises(EmbeddingInputError, match=r"supports dimensions \[2, 4, 8\], got 3"):
        parse(input="x", dimensions=3).wire([0]).decode(text_config(dimensions=[4, 2]), "emb", None)


def test_a_configuration_serving_no_embeddings_is_refused():
    config = ModelConfig(
        name="plain",
        inputs=[TensorSpec(name="X", datatype="FP32", shape=[2])],
        outputs=[TensorSpec(name="Y", datatype="FP32", shape=[2])],
    )
    with pytest.raises(EmbeddingInputError, match="does not serve embeddings") as caught:
        parse(input="x").wire([0]).decode(config, "plain", None)
    assert caught.value.param == "model"


# -- answers -------------------------------------------------------------------------------


def result(values: np.ndarray, tokens: int = 7) -> EmbeddingResult:
    return EmbeddingResult("emb", "1", values, tokens, 1, "TEXT", 0.0, 0.0)


def test_float_answer():
    values = np.array([[0.1, -0.25], [1.0, 3.4028235e38]], dtype=np.float32)
    answer = orjson.loads(encode_embeddings(result(values), "float"))
    assert answer["object"] == "list" and answer["model"] == "emb"
    assert answer["usage"] == {"prompt_tokens": 7, "total_tokens": 7}
    assert [item["index"] for item in answer["data"]] == [0, 1]
    assert all(item["object"] == "embedding" for item in answer["data"])
    got = np.array([item["embedding"] for item in answer["data"]], dtype=np.float32)
    np.testing.assert_array_equal(got, values)  # float32 values round-trip exactly


def test_base64_answer_is_little_endian_float32():
    values = np.arange(6, dtype=np.float32).reshape(2, 3) / 7
    answer = orjson.loads(encode_embeddings(result(values), "base64"))
    for item, row in zip(answer["data"], values, strict=True):
        raw = base64.b64decode(item["embedding"])
        assert len(raw) == 12
        np.testing.assert_array_equal(np.frombuffer(raw, dtype="<f4"), row)


def test_model_objects():
    view = EmbeddingModelView("emb", 1_700_000_000)
    assert orjson.loads(encode_model(view)) == {
        "id": "emb",
        "object": "model",
        "created": 1_700_000_000,
        "owned_by": "gpuserve",
    }
    assert orjson.loads(encode_model_list([view])) == {
        "object": "list",
        "data": [orjson.loads(encode_model(view))],
    }
    assert orjson.loads(encode_model_list([])) == {"object": "list", "data": []}


# -- the error table -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("error", "status", "kind", "code", "header"),
    [
        (EmbeddingInputError("bad", "input"), 400, "invalid_request_error", None, None),
        (UnauthenticatedError("who"), 401, "invalid_request_error", "invalid_api_key", None),
        (ModelNotFoundError("no"), 404, "invalid_request_error", "model_not_found", None),
        (OverloadedError("full", 2.4), 429, "rate_limit_error", "rate_limit_exceeded", "2"),
        (BackendError("boom"), 500, "server_error", None, None),
        (ModelNotReadyError("loading"), 503, "server_error", "not_ready", None),
        (OpenAIHttpError(405, "use POST", "method_not_allowed"), 405, "invalid_request_error",
         "method_not_allowed", None),
        (OpenAIHttpError(404, "Invalid URL"), 404, "invalid_request_error", None, None),
        (RuntimeError("a bug"), 500, "server_error", None, None),
    ],
)  # fmt: skip
def test_error_answers(error, status, kind, code, header):
    answer = error_answer(error)
    assert (answer.status, answer.type, answer.code) == (status, kind, code)
    body = orjson.loads(answer.body())["error"]
    assert set(body) == {"message", "type", "param", "code"}
    if isinstance(error, RuntimeError):
        assert body["message"] == "internal server error"  # never the bug's text
    headers = dict(answer.headers)
    if header is not None:
        assert headers[b"retry-after"] == header.encode()
    if status == 401:
        assert headers[b"www-authenticate"] == b"Bearer"
    assert orjson.loads(answer.body("redacted"))["error"]["message"] == "redacted"
