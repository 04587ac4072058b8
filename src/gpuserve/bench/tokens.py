"""How many tokens each request carries, so that a run over varied inputs reports tokens/s.

Req/s alone says little when requests differ in length: a server that is fast on short
sentences and slow on long ones shows the same req/s as one that serves all alike. The bench
therefore sizes every request once, before the load starts, and adds up the sizes of the
requests that succeed in each window. ``--tokens`` chooses how:

* ``PATH`` (a ``tokenizer.json`` file, or a folder holding one, such as a
  sentence-transformers model folder): exact counts with that tokenizer, special tokens
  included; truncation is the folder's ``sentence_bert_config.json`` ``max_seq_length`` when
  present, else the file's own setting. ``--max-seq-len N`` overrides it.
* ``server``: the server counts them: one ``POST /v1/embeddings`` per distinct text before
  the run, reading ``usage.prompt_tokens`` (gpuserve gives the model's tokenizer count after
  truncation, i.e. exactly what the model embeds). Needs the OpenAI embeddings API for the
  model (``GET /v1/models`` lists it).
* ``words``: whitespace-separated words, labelled as an approximation (English prose runs at
  about 1.3 BERT tokens per word).
* ``auto`` (default): ``server`` when the server lists the model under ``/v1/models`` and the
  requests carry at most :data:`MAX_SERVER_TEXTS` distinct texts (the server embeds each one
  to count it: about 15 s for 1,000 sentences on 1 CPU core), else ``words``.

A request's size is the sum over the texts (BYTES elements) it carries; requests without
texts (numeric tensors) have no size, and the report then shows no tokens column.
"""

from __future__ import annotations

import json
import ssl
import urllib.error
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from gpuserve.bench.server_info import ServerError, auth_headers, get_json

TOKENS_CHOICES_HELP = "auto, server, words, or a tokenizer.json file / model folder"
#: ``auto`` asks the server only for files with at most this many distinct texts.
MAX_SERVER_TEXTS = 1000
_SERVER_WORKERS = 4


@dataclass(frozen=True, slots=True)
class TokenCounts:
    """Sizes of the run's requests.

    Attributes:
        per_sample: Tokens (or words) per request, in the order of the samples.
        source: ``tokenizer``, ``server`` or ``words``.
        unit: ``tokens``, or ``words`` for the approximation.
        detail: One line for the report: what counted them.
    """

    per_sample: list[int]
    source: str
    unit: str
    detail: str

    @property
    def label(self) -> str:
        """Column heading: ``tokens/s`` or ``words/s (approx. tokens)``."""
        return "tokens/s" if self.unit == "tokens" else "words/s (approx. tokens)"


def count_words(texts: list[list[str]]) -> TokenCounts:
    """Whitespace words per request."""
    return TokenCounts(
        [sum(len(t.split()) for t in group) for group in texts],
        "words",
        "words",
        "whitespace-separated words (an approximation of tokens)",
    )


def tokenizer_counter(path: Path, max_seq_len: int | None = None) -> Callable[[str], int]:
    """A function text -> tokens with the tokenizer at ``path`` (file or folder).

    Raises:
        ValueError: no ``tokenizer.json`` there, or it does not load.
    """
    from tokenizers import Tokenizer

    path = Path(path)
    file = path / "tokenizer.json" if path.is_dir() else path
    if not file.is_file():
        raise ValueError(f"--tokens {path}: no tokenizer.json there")
    try:
        tokenizer = Tokenizer.from_file(str(file))
    except Exception as err:  # the tokenizers library raises plain Exceptions
        raise ValueError(f"--tokens {file}: not a tokenizers file: {err}") from None
    tokenizer.no_padding()
    if max_seq_len is None and path.is_dir():
        config = path / "sentence_bert_config.json"
        if config.is_file():
            value = json.loads(config.read_text(encoding="utf-8")).get("max_seq_length")
            max_seq_len = int(value) if value is not None else None
    if max_seq_len is not None:
        tokenizer.enable_truncation(max_length=max_seq_len)

    def count(text: str) -> int:
        return len(tokenizer.encode(text).ids)

    return count


def server_counter(
    url: str, model: str, token: str | None = None, ca_file: str | Path | None = None
) -> Callable[[str], int]:
    """A function text -> ``usage.prompt_tokens`` of ``POST {url}/v1/embeddings``.

    Raises:
        ServerError: (when called) the server refused or did not answer.
    """
    context = ssl.create_default_context(cafile=str(ca_file)) if ca_file else None
    headers = {"Content-Type": "application/json", **auth_headers(token)}

    def count(text: str) -> int:
        body = json.dumps({"model": model, "input": text}).encode("utf-8")
        request = urllib.request.Request(f"{url}/v1/embeddings", body, headers, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=30, context=context) as response:
                return int(json.loads(response.read())["usage"]["prompt_tokens"])
        except urllib.error.HTTPError as err:
            detail = err.read()[:200].decode("utf-8", "replace")
            raise ServerError(f"POST {url}/v1/embeddings: HTTP {err.code}: {detail}") from None
        except (urllib.error.URLError, OSError, KeyError, ValueError, TypeError) as err:
            raise ServerError(f"POST {url}/v1/embeddings: no token count: {err}") from None

    return count


def server_lists(
    url: str, model: str, token: str | None = None, ca_file: str | Path | None = None
) -> bool:
    """Whether ``GET {url}/v1/models`` lists ``model`` (the OpenAI API serves it)."""
    try:
        listed = get_json(f"{url}/v1/models", timeout_s=5.0, token=token, ca_file=ca_file)
    except ServerError:
        return False
    data = listed.get("data") if isinstance(listed, dict) else None
    return isinstance(data, list) and any(
        isinstance(m, dict) and m.get("id") == model for m in data
    )


def _apply(texts: list[list[str]], count: Callable[[str], int], workers: int) -> list[int]:
    distinct = sorted({t for group in texts for t in group})
    with ThreadPoolExecutor(max_workers=workers) as pool:
        sizes = dict(zip(distinct, pool.map(count, distinct), strict=True))
    return [sum(sizes[t] for t in group) for group in texts]


def count_tokens(
    texts: list[list[str]],
    spec: str,
    url: str,
    model: str,
    token: str | None = None,
    ca_file: str | Path | None = None,
    max_seq_len: int | None = None,
) -> TokenCounts | None:
    """Size every request (see the module docstring); None when no request carries text.

    Args:
        texts: Per request, the texts it carries.
        spec: ``auto``, ``server``, ``words`` or a tokenizer path.
        url: Server base URL (for ``server`` / ``auto``).
        model: Model name, as ``/v1/models`` lists it.
        token / ca_file: As for every call to the server.
        max_seq_len: Truncation for a tokenizer path (None: see the module docstring).

    Raises:
        ValueError: a tokenizer path that does not load.
        ServerError: ``server`` was asked for and the server cannot count.
    """
    if not any(texts):
        return None
    distinct = len({t for group in texts for t in group})
    if spec == "words":
        return count_words(texts)
    if spec == "auto":
        if not server_lists(url, model, token, ca_file):
            return count_words(texts)
        if distinct > MAX_SERVER_TEXTS:
            words = count_words(texts)
            detail = (
                f"{words.detail}; {distinct} distinct texts are more than auto asks the server "
                f"to count ({MAX_SERVER_TEXTS}): pass --tokens server or a tokenizer for exact "
                "counts"
            )
            return TokenCounts(words.per_sample, words.source, words.unit, detail)
        spec = "server"
    if spec == "server":
        if not server_lists(url, model, token, ca_file):
            raise ServerError(
                f"--tokens server: {url}/v1/models does not list {model!r} (no OpenAI "
                "embeddings API for it); give a tokenizer path or --tokens words"
            )
        counts = _apply(texts, server_counter(url, model, token, ca_file), _SERVER_WORKERS)
        detail = f"the server's count (POST /v1/embeddings usage.prompt_tokens, {distinct} texts)"
        return TokenCounts(counts, "server", "tokens", detail)
    counter = tokenizer_counter(Path(spec), max_seq_len)
    truncation = f", truncated to {max_seq_len}" if max_seq_len else ""
    detail = f"tokenizer {spec}{truncation} (special tokens included)"
    return TokenCounts(_apply(texts, counter, 1), "tokenizer", "tokens", detail)
