"""``gpuserve bench --input-lines``: reading a file of one request per line, sizing requests
in tokens, and tokens/s in the window statistics (pure code, no server)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from gpuserve.bench.inputs import ModelInfo, TensorInfo
from gpuserve.bench.lines import read_input_lines
from gpuserve.bench.raw_target import RawHttpTarget
from gpuserve.bench.stats import Recorder, summarize
from gpuserve.bench.tokens import count_tokens, count_words, tokenizer_counter
from gpuserve.cli.main import main
from tests.fixtures.hf_models import minilm_dir


def text_model(batching: bool = True) -> ModelInfo:
    shape = [-1, 1] if batching else [1]
    return ModelInfo(
        "text_embedding",
        None,
        [TensorInfo("TEXT", "BYTES", shape)],
        [TensorInfo("EMBEDDING", "FP32", [-1, 384])],
        batching,
    )


def numeric_model() -> ModelInfo:
    return ModelInfo(
        "double4",
        None,
        [TensorInfo("INPUT0", "FP32", [-1, 4])],
        [TensorInfo("OUTPUT0", "FP32", [-1, 4])],
        True,
    )


def write(tmp_path, lines: list[str]):
    path = tmp_path / "inputs.txt"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_text_lines_become_one_bytes_request_each_and_skip_empty_lines(tmp_path):
    path = write(tmp_path, ["A short sentence.", "", "Ünïcödé and a longer one, with commas."])
    lines = read_input_lines(path, text_model())
    assert lines.format == "text"
    assert len(lines.samples) == 2
    first = lines.samples[0]["TEXT"]
    assert first.shape == (1, 1) and first.dtype == object
    assert first[0, 0] == b"A short sentence."
    assert lines.samples[1]["TEXT"][0, 0].decode() == "Ünïcödé and a longer one, with commas."
    assert lines.texts == [["A short sentence."], ["Ünïcödé and a longer one, with commas."]]


def test_text_lines_fill_every_row_of_a_batch(tmp_path):
    lines = read_input_lines(write(tmp_path, ["one", "two"]), text_model(), batch_size=3)
    assert lines.samples[1]["TEXT"].shape == (3, 1)
    assert lines.texts[1] == ["two", "two", "two"]


def test_json_lines_are_v2_bodies_read_into_tensors(tmp_path):
    bodies = [
        {"inputs": [{"name": "TEXT", "shape": [2, 1], "datatype": "BYTES", "data": ["a b", "c"]}]},
        {"inputs": [{"name": "TEXT", "shape": [1, 1], "data": [["nested"]]}]},
    ]
    lines = read_input_lines(write(tmp_path, [json.dumps(b) for b in bodies]), text_model())
    assert lines.format == "json"
    assert lines.samples[0]["TEXT"].tolist() == [[b"a b"], [b"c"]]
    assert lines.samples[1]["TEXT"].tolist() == [[b"nested"]]
    assert lines.texts == [["a b", "c"], ["nested"]]


def test_json_lines_for_a_numeric_model_carry_no_texts(tmp_path):
    body = {
        "inputs": [{"name": "INPUT0", "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3, 4]}]
    }
    lines = read_input_lines(write(tmp_path, [json.dumps(body)]), numeric_model())
    np.testing.assert_array_equal(lines.samples[0]["INPUT0"], [[1, 2, 3, 4]])
    assert lines.samples[0]["INPUT0"].dtype == np.float32
    assert lines.texts == [[]]


def test_a_text_line_among_json_lines_makes_the_file_text(tmp_path):
    path = write(tmp_path, ['{"inputs": []}', "plain text"])
    assert read_input_lines(path, text_model()).format == "text"


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('{"inputs": [{"name": "IDS", "data": [1]}]}', "inputs.txt:1: input 'IDS' is not declared"),
        ('{"outputs": []}', "inputs.txt:1: expected a V2 infer body"),
        ('{"inputs": [{"name": "TEXT"}]}', "needs 'name' and 'data'"),
        (
            '{"inputs": [{"name": "TEXT", "datatype": "INT64", "data": [1]}]}',
            "has datatype INT64, the model declares BYTES",
        ),
        ('{"inputs": [{"name": "TEXT", "shape": [2, 2], "data": ["x"]}]}', "do not fit shape"),
    ],
)
def test_bad_json_lines_name_the_line_and_the_problem(tmp_path, line, message):
    with pytest.raises(ValueError, match=message):
        read_input_lines(write(tmp_path, [line]), text_model(), fmt="json")


def test_text_lines_need_a_model_with_one_bytes_input(tmp_path):
    with pytest.raises(ValueError, match=r"double4 declares: INPUT0 \(FP32\)"):
        read_input_lines(write(tmp_path, ["some text"]), numeric_model())


def test_an_empty_file_and_an_unknown_format_are_refused(tmp_path):
    with pytest.raises(ValueError, match="no requests"):
        read_input_lines(write(tmp_path, ["", "  "]), text_model())
    with pytest.raises(ValueError, match="--input-format must be one of"):
        read_input_lines(write(tmp_path, ["x"]), text_model(), fmt="csv")


def test_words_are_a_labelled_approximation():
    counts = count_words([["one two three"], ["four", "five six"], []])
    assert counts.per_sample == [3, 3, 0]
    assert counts.unit == "words" and counts.label == "words/s (approx. tokens)"


def test_a_tokenizer_folder_counts_exactly_with_special_tokens_and_its_truncation():
    count = tokenizer_counter(minilm_dir())
    assert count("Hello world.") == 5  # [CLS] hello world . [SEP]
    assert count("word " * 1000) == 256  # sentence_bert_config.json max_seq_length
    assert tokenizer_counter(minilm_dir(), max_seq_len=10)("word " * 1000) == 10


def test_count_tokens_with_a_path_sums_the_texts_of_each_request():
    counts = count_tokens([["Hello world."], ["Hello world.", "Hi."]], str(minilm_dir()), "", "m")
    assert counts is not None
    assert counts.per_sample == [5, 5 + 4]
    assert counts.source == "tokenizer" and counts.label == "tokens/s"


def test_requests_without_texts_are_not_sized_and_a_bad_path_is_refused(tmp_path):
    assert count_tokens([[], []], "words", "", "m") is None
    with pytest.raises(ValueError, match=r"no tokenizer\.json"):
        count_tokens([["x"]], str(tmp_path), "", "m")


def test_auto_falls_back_to_words_when_the_server_has_no_embeddings_api():
    # nothing listens on port 9 (discard): /v1/models is unreachable
    counts = count_tokens([["a b c"]], "auto", "http://127.0.0.1:9", "m")
    assert counts is not None and counts.source == "words" and counts.per_sample == [3]


def test_window_tokens_per_second_count_successes_only():
    rec = Recorder()
    rec.add(0.1, 0.01, "200", -1, -1, tokens=10)
    rec.add(0.2, 0.01, "200", -1, -1, tokens=30)
    rec.add(0.3, 0.01, "503", -1, -1, tokens=1000)
    window = summarize(rec, 0, 3, duration_s=2.0)
    assert window.tokens_per_s == pytest.approx(20.0)
    assert window.mean_tokens == pytest.approx(20.0)
    unsized = Recorder()
    unsized.add(0.1, 0.01, "200", -1, -1)
    assert summarize(unsized, 0, 1, 1.0).tokens_per_s is None


def test_raw_target_encodes_each_body_once_and_checks_the_token_list():
    target = RawHttpTarget("http://127.0.0.1:7997/embeddings", [b"{}", b'{"a":1}'], tokens=[1, 2])
    assert target.samples == 2 and target.sample_tokens == [1, 2]
    assert target.requests[1].startswith(b"POST /embeddings HTTP/1.1\r\n")
    assert target.requests[1].endswith(b'\r\n\r\n{"a":1}')
    with pytest.raises(ValueError, match="2 token counts for 1 bodies"):
        RawHttpTarget("http://127.0.0.1:1/x", [b"{}"], tokens=[1, 2])


def test_cli_refuses_two_input_sources_and_a_missing_file(tmp_path, capsys):
    data = tmp_path / "data.json"
    data.write_text('{"data": []}')
    assert main(["bench", "--input-data", str(data), "--input-lines", str(data)]) == 2
    assert "give --input-data or --input-lines, not both" in capsys.readouterr().err
    assert main(["bench", "--input-lines", str(tmp_path / "absent.txt")]) == 2
    assert "absent.txt: no such file" in capsys.readouterr().err
