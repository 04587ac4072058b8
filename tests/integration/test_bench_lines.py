"""``gpuserve bench --input-lines`` against real servers: varied texts, tokens/s.

The fixture server's ``echo_bytes`` takes text lines; a server holding the default
repository's ``text_embedding`` counts the tokens itself (``--tokens auto`` -> its
``/v1/embeddings`` usage), which must agree with the model's tokenizer.
"""

from __future__ import annotations

import csv
import json
import shutil

import pytest

from gpuserve.bench.benchmark import BenchConfig, run_benchmark
from gpuserve.bench.loadgen import LoadSettings
from gpuserve.bench.tokens import tokenizer_counter
from gpuserve.cli.main import main
from gpuserve.config import default_model_repository
from tests.fixtures.hf_models import minilm_dir
from tests.helpers import InProcessServer

FAST = LoadSettings(warmup_s=0.2, window_s=0.4, stable_windows=2, tolerance=0.9, max_windows=2)
TEXTS = [
    "Short.",
    "A sentence of middling length about model servers and batching.",
    " ".join(["Long documents pad every shorter row of the batch they share."] * 12),
]


@pytest.fixture()
def lines_file(tmp_path):
    path = tmp_path / "texts.txt"
    path.write_text("\n".join(TEXTS) + "\n", encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def embedding_server(tmp_path_factory):
    repository = tmp_path_factory.mktemp("repository")
    shutil.copytree(default_model_repository() / "text_embedding", repository / "text_embedding")
    running = InProcessServer(repository)
    yield running
    running.stop()


def test_text_lines_with_a_tokenizer_report_tokens_per_second(server, lines_file):
    config = BenchConfig(
        url=server.url,
        model="echo_bytes",
        input_lines=lines_file,
        tokens=str(minilm_dir()),
        levels=[2],
        settings=FAST,
    )
    result = run_benchmark(config)
    count = tokenizer_counter(minilm_dir())
    assert result.token_counts is not None
    assert result.token_counts.per_sample == [count(t) for t in TEXTS]
    [level] = result.levels
    s = level.summary
    assert s.ok > 5 and not s.errors
    assert s.mean_tokens is not None
    assert min(count(t) for t in TEXTS) <= s.mean_tokens <= max(count(t) for t in TEXTS)
    assert s.tokens_per_s == pytest.approx(s.throughput * s.mean_tokens, rel=1e-6)
    assert level.as_dict()["throughput_tokens_per_s"] == s.tokens_per_s


def test_the_cli_writes_tokens_per_second_and_says_how_it_counted(server, lines_file, tmp_path):
    out = tmp_path / "out"
    code = main(
        [
            "bench",
            "--url",
            server.url,
            "-m",
            "echo_bytes",
            "--input-lines",
            str(lines_file),
            "--tokens",
            "words",
            "--concurrency",
            "1",
            "--warmup-s",
            "0.2",
            "--window-s",
            "0.3",
            "--stable-windows",
            "2",
            "--max-windows",
            "2",
            "--tolerance-pct",
            "90",
            "--output-dir",
            str(out),
            "--no-plot",
            "--quiet",
        ]
    )
    assert code == 0
    document = json.loads((out / "bench.json").read_text())
    assert document["tokens"]["unit"] == "words"
    level = document["levels"][0]
    assert level["throughput_tokens_per_s"] > level["throughput_infer_per_s"]  # > 1 word each
    [row] = list(csv.DictReader((out / "bench.csv").open()))
    assert float(row["throughput_tokens_per_s"]) > 0


def test_json_lines_of_a_numeric_model_run_without_a_tokens_column(server, tmp_path):
    body = {
        "inputs": [{"name": "INPUT0", "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3, 4]}]
    }
    path = tmp_path / "bodies.jsonl"
    path.write_text(json.dumps(body) + "\n")
    config = BenchConfig(
        url=server.url, model="double4_fp32", input_lines=path, levels=[1], settings=FAST
    )
    result = run_benchmark(config)
    assert result.token_counts is None
    [level] = result.levels
    assert level.summary.ok > 0 and not level.summary.errors
    assert level.summary.tokens_per_s is None


def test_auto_takes_the_servers_own_token_counts(embedding_server, lines_file):
    # longer windows than FAST: a busy 2-core machine can take a second per embedding
    settings = LoadSettings(
        warmup_s=0.5, window_s=1.5, stable_windows=2, tolerance=0.9, max_windows=2
    )
    config = BenchConfig(
        url=embedding_server.url,
        model="text_embedding",
        input_lines=lines_file,
        levels=[1],
        settings=settings,
    )
    result = run_benchmark(config)
    counts = result.token_counts
    assert counts is not None and counts.source == "server"
    count = tokenizer_counter(minilm_dir())  # its folder: truncation at 256, as served
    assert counts.per_sample == [count(t) for t in TEXTS]
    [level] = result.levels
    assert level.summary.ok > 0 and not level.summary.errors
    assert level.summary.tokens_per_s is not None and level.summary.tokens_per_s > 0


def test_text_lines_go_over_grpc_too(server, lines_file):
    config = BenchConfig(
        url=server.url,
        model="echo_bytes",
        protocol="grpc",
        grpc_url=server.grpc_url,
        binary=True,
        input_lines=lines_file,
        tokens="words",
        levels=[2],
        settings=FAST,
    )
    result = run_benchmark(config)
    [level] = result.levels
    assert level.summary.ok > 0 and not level.summary.errors
    words = [len(t.split()) for t in TEXTS]
    assert result.token_counts is not None and result.token_counts.per_sample == words
    assert level.summary.mean_tokens is not None
    assert min(words) <= level.summary.mean_tokens <= max(words)
