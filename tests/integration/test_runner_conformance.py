"""One contract, every runner: the same cases against each kind of :class:`VersionRunner`.

Every loaded version has exactly one runner (``src/gpuserve/engine/runners/``). Whatever the
runner, a client of ``POST /v2/models/conf/infer`` (or of a gRPC ``ModelStreamInfer`` stream,
for the cancellation cases) must see the same behaviour. Each kind
below is a repository (written into ``tmp_path``) whose model ``conf`` computes ``Y = 2 X``
(FP32, input ``X`` dims [4], ``max_batch_size: 8``, one CPU instance) served by a different
runner:

* ``batching``: a python model with ``dynamic_batching`` (BatchingRunner, dynamic batcher);
* ``sequence``: the same model with ``sequence_batching`` (``oldest``; BatchingRunner,
  sequence batcher); every request is a sequence of its own (the kind's :meth:`Kind.body`
  adds ``sequence_id`` / ``sequence_start`` / ``sequence_end``);
* ``streaming``: a decoupled python model (``model_transaction_policy: {decoupled: true}``)
  whose ``generate`` yields exactly one response (StreamingRunner, unary ``/infer``);
* ``ensemble``: an ensemble of one step over a dynamic-batching ``conf_step`` (EnsembleRunner;
  the step enters the step model's runner). The step declares ``Y`` with dims ``[-1]``, so
  what it returns is checked against the ensemble's own ``[4]`` by the ensemble.

Requests enter over HTTP (``POST /v2/models/conf/infer``) and, for the cases of one answer on
every path (section 8), also as a model's call to ``conf`` (business-logic scripting: the
test's thread calls through an :class:`~gpuserve.engine.calls.InProcessCaller`, as a model's
instance thread does): one mistake gets one status and one message, whichever the runner and
whichever the entry.

The model's markers (first element of a row, the second element a tag):

* ``-1``: its admission step (``admit``) refuses the request (400);
* ``-2``: it returns ``Y`` of shape [1, 3] instead of [1, 4] (the engine's output checks: 500);
* ``-3``: it touches ``started-<tag>`` in the kind's event folder and holds its instance until
  the test creates ``release-<tag>`` (the slow request, released by the test, never a sleep);
* ``-4``: it touches ``ran-<tag>`` (whether a request ran at all);
* ``-5`` (the decoupled kind's ``generate`` only): it sends one response, touches
  ``started-<tag>``, holds until ``release-<tag>``, then sends a second; ``after-<tag>`` is
  touched if it got past that second response (it was not told its client had gone), and
  ``closed-<tag>`` when the generator ends.

One server per kind (in-process, ``--model-control-mode explicit`` with every model loaded, so
that the drain case can unload and load ``conf`` again). Counts are read as differences (the
Prometheus counters never reset; the statistics do on a reload).

Section 9 runs the settings of the one execution path (an execution timeout, a token budget,
adaptive batching) against the kinds whose batches take them: a batching model and a
decoupled model that runs batches of streams (Triton Python models, one server per kind with
one model per setting).
"""

from __future__ import annotations

import concurrent.futures
import itertools
import textwrap
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from tests.helpers import InProcessServer, queue_state, wait_until

pytestmark = pytest.mark.timeout(120)

KINDS = ["batching", "sequence", "streaming", "ensemble"]

MODEL = "conf"
STEP = "conf_step"  # the ensemble's step model

REFUSAL = "input 'X': the admission step refuses the marker -1"

#: What gpuserve answers for a queue timeout (RequestTimeoutError, src/gpuserve/server/status.py:
#: 503 UNAVAILABLE; not Triton's 504/400) and for a request refused while unloading.
QUEUE_TIMEOUT_STATUS = 503

MODEL_CODE = '''
import os
import time

import numpy as np

from gpuserve.backends.base import Admitted
from gpuserve.backends.python import PythonModel
from gpuserve.errors import InvalidInputError

EVENTS = {events!r}


def _touch(name):
    with open(os.path.join(EVENTS, name), "w"):
        pass


def _hold(name, deadline_s=30.0):
    """Wait for the test's event file (a deadline, so a failed test never hangs here)."""
    path = os.path.join(EVENTS, name)
    end = time.monotonic() + deadline_s
    while not os.path.exists(path) and time.monotonic() < end:
        time.sleep(0.002)


def compute(x):
    for row in x:
        tag = int(row[1])
        if row[0] == -3:
            _touch(f"started-{{tag}}")
            _hold(f"release-{{tag}}")
        elif row[0] == -4:
            _touch(f"ran-{{tag}}")
    if (x[:, 0] == -2).any():
        return {{"Y": np.zeros((1, 3), dtype=np.float32)}}  # declared dims are [4]
    return {{"Y": x * 2}}


class Model(PythonModel):
    def admit(self, inputs):
        x = inputs["X"]
        if (x[:, 0] == -1).any():
            raise InvalidInputError("{refusal}")
        return Admitted(lengths=tuple(1 for _ in range(x.shape[0])))

    def forward(self, inputs):
        return compute(inputs["X"])

    def generate(self, inputs):  # decoupled kind only: exactly one response
        x = inputs["X"]
        if x[0, 0] != -5:
            yield compute(x)
            return
        tag = int(x[0, 1])
        try:
            yield {{"Y": x * 2}}
            _touch(f"started-{{tag}}")
            _hold(f"release-{{tag}}")
            yield {{"Y": x * 2}}  # a cancelled stream closes the generator here
            _touch(f"after-{{tag}}")
        finally:
            _touch(f"closed-{{tag}}")
'''

COMMON = """\
backend: python
max_batch_size: 8
inputs: [{name: X, datatype: FP32, shape: [4]}]
outputs: [{name: Y, datatype: FP32, shape: [4]}]
instance_group: [{count: 1, kind: cpu}]
"""

SCHEDULING = {
    "batching": "dynamic_batching: {max_queue_delay_us: 0}\n",
    "sequence": (
        "sequence_batching:\n"
        "  max_sequence_idle_us: 60000000\n"
        "  oldest: {max_candidate_sequences: 8, max_queue_delay_us: 0}\n"
    ),
    "streaming": "model_transaction_policy: {decoupled: true}\n",
}

ENSEMBLE_CONFIG = f"""\
backend: ensemble
max_batch_size: 8
inputs: [{{name: X, datatype: FP32, shape: [4]}}]
outputs: [{{name: Y, datatype: FP32, shape: [4]}}]
ensemble:
  steps:
    - {{model_name: {STEP}, input_map: {{X: X}}, output_map: {{Y: Y}}}}
"""


def write_python(
    root: Path, name: str, scheduling: str, events: Path, common: str = COMMON
) -> None:
    (root / name / "1").mkdir(parents=True)
    (root / name / "config.yaml").write_text(common + scheduling)
    code = MODEL_CODE.format(events=str(events), refusal=REFUSAL)
    (root / name / "1" / "model.py").write_text(textwrap.dedent(code).lstrip())


def write_repository(kind: str, root: Path, events: Path) -> None:
    """The kind's repository: ``conf`` computing ``Y = 2 X`` through the kind's runner."""
    if kind == "ensemble":
        # Y of any size: the ensemble's own output check, not the step's, sees a wrong one
        step_common = COMMON.replace(
            "{name: Y, datatype: FP32, shape: [4]}", "{name: Y, datatype: FP32, shape: [-1]}"
        )
        write_python(root, STEP, SCHEDULING["batching"], events, step_common)
        (root / MODEL).mkdir(parents=True)
        (root / MODEL / "1").mkdir()
        (root / MODEL / "config.yaml").write_text(ENSEMBLE_CONFIG)
    else:
        write_python(root, MODEL, SCHEDULING[kind], events)


_sequence_ids = itertools.count(7001)
_tags = itertools.count(1)


@dataclass
class Kind:
    """One runner kind behind its own server."""

    name: str
    server: InProcessServer
    events: Path
    http: httpx.Client

    @property
    def url(self) -> str:
        return self.server.url

    @property
    def runs_on(self) -> str:
        """The model whose instance runs the rows (the step model for the ensemble)."""
        return STEP if self.name == "ensemble" else MODEL

    def body(self, x: np.ndarray, **parameters: Any) -> dict:
        """The V2 request of rows ``x``; for the sequence kind a sequence of its own (a
        sequence-batching model refuses a request without ``sequence_id``)."""
        if self.name == "sequence":
            parameters = {
                "sequence_id": next(_sequence_ids),
                "sequence_start": True,
                "sequence_end": True,
                **parameters,
            }
        body: dict[str, Any] = {
            "inputs": [
                {
                    "name": "X",
                    "datatype": "FP32",
                    "shape": list(x.shape),
                    "data": x.ravel().tolist(),
                }
            ]
        }
        if parameters:
            body["parameters"] = parameters
        return body

    def infer(self, x: np.ndarray, timeout_s: float = 30.0, **parameters: Any) -> httpx.Response:
        return self.http.post(
            f"/v2/models/{MODEL}/infer", json=self.body(x, **parameters), timeout=timeout_s
        )

    def stream(self, x: np.ndarray) -> grpcclient.InferenceServerClient:
        """A gRPC ``ModelStreamInfer`` stream (tritonclient's) carrying one request of rows
        ``x`` (its responses are dropped); the caller cancels it with
        ``stop_stream(cancel_requests=True)`` and closes the client."""
        client = grpcclient.InferenceServerClient(self.server.grpc_url)
        client.start_stream(callback=lambda *_, **__: None)
        tensor = grpcclient.InferInput("X", list(x.shape), "FP32")
        tensor.set_data_from_numpy(x)
        sequence: dict[str, Any] = {}
        if self.name == "sequence":
            sequence = {
                "sequence_id": next(_sequence_ids),
                "sequence_start": True,
                "sequence_end": True,
            }
        client.async_stream_infer(MODEL, [tensor], **sequence)
        return client

    def call(self, x: np.ndarray, outputs: list[str] | None = None) -> tuple[int, str]:
        """``conf`` called as a model calls it (:class:`InProcessCaller`, from this thread);
        the HTTP status and message of its error, or ``(200, "")``."""
        from gpuserve.engine.calls import InProcessCaller
        from gpuserve.errors import GpuserveError
        from gpuserve.server.status import http_status

        loop = self.server.server._loop  # the server's event loop, where runners run
        caller = InProcessCaller(self.server.manager, loop, "conformance_test")
        parameters = self.body(x).get("parameters")  # a sequence of its own for the kind
        try:
            caller(MODEL, {"X": x}, outputs=outputs, parameters=parameters, timeout_s=30)
        except GpuserveError as err:
            return http_status(err), err.message
        return 200, ""

    def stats(self) -> dict:
        answer = self.http.get(f"/v2/models/{MODEL}/stats")
        assert answer.status_code == 200, answer.text
        return answer.json()["model_stats"][0]

    def event(self, name: str) -> Path:
        return self.events / name


def rows(*first: float, tag: int = 0) -> np.ndarray:
    """One row per value of ``first``: [value, tag, 3, 4]."""
    return np.array([[v, float(tag), 3.0, 4.0] for v in first], dtype=np.float32)


def error_of(answer: httpx.Response) -> str:
    try:
        return str(answer.json().get("error", answer.text))
    except ValueError:
        return answer.text


def y_of(answer: httpx.Response) -> np.ndarray:
    assert answer.status_code == 200, (answer.status_code, answer.text)
    out = next(o for o in answer.json()["outputs"] if o["name"] == "Y")
    return np.array(out["data"], dtype=np.float32).reshape(out["shape"])


def requests_total(url: str, outcome: str, reason: str = "", model: str = MODEL) -> float:
    """``gpuserve_requests_total`` of ``model`` version 1 for ``outcome``/``reason``."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", timeout=10).text
    lines = [line for line in text.splitlines() if line.startswith("gpuserve_requests_total")]
    wanted = {"model": model, "version": "1", "outcome": outcome, "reason": reason}
    total = 0.0
    for family in text_string_to_metric_families("\n".join(lines) + "\n"):
        for sample in family.samples:
            if sample.name == "gpuserve_requests_total" and sample.labels == wanted:
                total += sample.value
    return total


def failures(kind: Kind, reason: str) -> int:
    return int(kind.stats()["failure_reasons"].get(reason, 0))


@pytest.fixture(scope="module", params=KINDS)
def kind(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Kind]:
    name = str(request.param)
    base = tmp_path_factory.mktemp(f"conformance_{name}")
    events = base / "events"
    events.mkdir()
    write_repository(name, base / "repo", events)
    running = InProcessServer(base / "repo", model_control_mode="explicit", load_model=["*"])
    with httpx.Client(base_url=running.url, timeout=30.0) as http:
        try:
            yield Kind(name, running, events, http)
        finally:
            running.stop()


class Slow:
    """A request holding the kind's instance (marker -3) until :meth:`release`; sent on a
    thread, its answer in :attr:`answer`."""

    def __init__(self, kind: Kind, pool: concurrent.futures.ThreadPoolExecutor) -> None:
        self.kind = kind
        self.tag = next(_tags)
        self.answer = pool.submit(kind.infer, rows(-3.0, tag=self.tag))
        started = kind.event(f"started-{self.tag}")
        wait_until(
            lambda: started.exists() or self.answer.done(),
            10,
            f"{kind.name}: the slow request started on the instance",
        )
        assert not self.answer.done(), self.answer.result().text

    def release(self) -> None:
        self.kind.event(f"release-{self.tag}").touch()

    def result(self) -> httpx.Response:
        self.release()
        return self.answer.result(30)


@pytest.fixture()
def pool() -> Iterator[concurrent.futures.ThreadPoolExecutor]:
    with concurrent.futures.ThreadPoolExecutor(4) as threads:
        yield threads


# -- 1. admission --------------------------------------------------------------------------


def test_a_wrong_datatype_is_400_naming_the_input(kind: Kind):
    body: dict[str, Any] = {
        "inputs": [{"name": "X", "datatype": "INT32", "shape": [1, 4], "data": [1, 2, 3, 4]}]
    }
    if kind.name == "sequence":
        body["parameters"] = {
            "sequence_id": next(_sequence_ids),
            "sequence_start": True,
            "sequence_end": True,
        }
    answer = kind.http.post(f"/v2/models/{MODEL}/infer", json=body)
    assert answer.status_code == 400, answer.text
    error = error_of(answer)
    assert "'X'" in error and "INT32" in error, error
    np.testing.assert_array_equal(y_of(kind.infer(rows(1.0))), rows(1.0) * 2)


def test_the_models_admission_step_refuses_with_400_and_its_message(kind: Kind):
    # through the ensemble too: the step request enters conf_step's runner, which runs the
    # step model's admission step (the ensemble's message names the step around it)
    answer = kind.infer(rows(-1.0))
    error = error_of(answer)
    assert answer.status_code == 400, (answer.status_code, error)
    assert REFUSAL in error, error
    if kind.name == "ensemble":
        assert f"model '{STEP}'" in error, error
    np.testing.assert_array_equal(y_of(kind.infer(rows(5.0))), rows(5.0) * 2)


# -- 2. output checks ------------------------------------------------------------------------


def test_an_output_of_the_wrong_shape_is_500_naming_the_model_and_output(kind: Kind):
    # the ensemble checks its own outputs as every runner does (its step declares Y [-1])
    answer = kind.infer(rows(-2.0))
    error = error_of(answer)
    assert answer.status_code == 500, (answer.status_code, answer.text)
    assert error == "model 'conf' returned output 'Y' of shape [1, 3]; its config declares [-1, 4]"
    np.testing.assert_array_equal(y_of(kind.infer(rows(6.0))), rows(6.0) * 2)


# -- 3. cancel -------------------------------------------------------------------------------


def left_the_queue(kind: Kind, cancelled_before: float, what: str) -> None:
    """Wait (while the slow request still holds the instance) until the request whose client
    left is counted cancelled and nothing is queued on the model that runs its rows: it left
    the queue when its client went, not when its batch would have formed."""

    def gone() -> bool:
        counted = requests_total(kind.url, "failure", "cancelled") >= cancelled_before + 1
        return counted and queue_state(kind.url, kind.runs_on).queued == 0

    try:
        wait_until(gone, 10, what)
    except AssertionError:
        raise AssertionError(
            f"{kind.name}: {what}: cancelled "
            f"{requests_total(kind.url, 'failure', 'cancelled') - cancelled_before:g}, "
            f"{queue_state(kind.url, kind.runs_on)}"
        ) from None


def test_a_client_that_gives_up_while_queued_is_counted_cancelled_and_never_runs(
    kind: Kind, pool: concurrent.futures.ThreadPoolExecutor
):
    cancelled_before = failures(kind, "cancelled")
    metric_before = requests_total(kind.url, "failure", "cancelled")
    slow = Slow(kind, pool)
    tag = next(_tags)
    try:
        # queued behind the slow request; the client gives up and closes its connection
        with httpx.Client(base_url=kind.url) as impatient, pytest.raises(httpx.TimeoutException):
            impatient.post(
                f"/v2/models/{MODEL}/infer", json=kind.body(rows(-4.0, tag=tag)), timeout=0.5
            )
        left_the_queue(kind, metric_before, "the closed connection's request left the queue")
    finally:
        first = slow.result()
    assert first.status_code == 200, first.text
    np.testing.assert_array_equal(y_of(kind.infer(rows(7.0))), rows(7.0) * 2)
    assert failures(kind, "cancelled") == cancelled_before + 1
    assert requests_total(kind.url, "failure", "cancelled") == metric_before + 1
    assert not kind.event(f"ran-{tag}").exists(), "the abandoned request ran"


def test_a_cancelled_stream_takes_its_queued_request_out_at_once_and_it_never_runs(
    kind: Kind, pool: concurrent.futures.ThreadPoolExecutor
):
    metric_before = requests_total(kind.url, "failure", "cancelled")
    slow = Slow(kind, pool)
    tag = next(_tags)
    client: grpcclient.InferenceServerClient | None = None
    try:
        client = kind.stream(rows(-4.0, tag=tag))
        wait_until(
            lambda: queue_state(kind.url, kind.runs_on).queued >= 1,
            10,
            f"{kind.name}: the stream's request queued behind the slow one",
        )
        client.stop_stream(cancel_requests=True)
        left_the_queue(kind, metric_before, "the cancelled stream's request left the queue")
    finally:
        first = slow.result()
        if client is not None:
            client.close()
    assert first.status_code == 200, first.text
    # a request still queued would run before this one
    np.testing.assert_array_equal(y_of(kind.infer(rows(7.0))), rows(7.0) * 2)
    assert not kind.event(f"ran-{tag}").exists(), "the cancelled stream's request ran"
    assert requests_total(kind.url, "failure", "cancelled") == metric_before + 1


def server_knows(kind: Kind, cancelled_before: float) -> bool:
    """Whether the server took in that the client of the request running on ``kind`` left:
    a decoupled request is counted cancelled at once; a batching runner marks the request in
    its running batch (read from the in-process server: nothing a client sees changes yet)."""
    if kind.name == "streaming":
        cancelled = requests_total(kind.url, "failure", "cancelled", model=kind.runs_on)
        return cancelled >= cancelled_before + 1
    core = kind.server.manager.runner(kind.runs_on, None).core
    items = [item for record in core.in_flight for item in record.batch.items]
    return bool(items) and all(item.cancelled for item in items)


def test_a_request_cancelled_while_it_runs_is_counted_cancelled_and_a_decoupled_model_is_told(
    kind: Kind,
):
    # The batching runners mark the running request (it finishes for nobody and is counted
    # cancelled, never a success); a decoupled model learns of it at its next response (its
    # generator is closed there) and the request is counted cancelled at once.
    success_before = requests_total(kind.url, "success", model=kind.runs_on)
    cancelled_before = requests_total(kind.url, "failure", "cancelled", model=kind.runs_on)
    tag = next(_tags)
    decoupled = kind.name == "streaming"
    client = kind.stream(rows(-5.0 if decoupled else -3.0, tag=tag))
    try:
        wait_until(
            lambda: kind.event(f"started-{tag}").exists(), 10, f"{kind.name}: the request runs"
        )
        client.stop_stream(cancel_requests=True)
        # released only once the server knows, else the answer could race the cancel
        wait_until(
            lambda: server_knows(kind, cancelled_before),
            10,
            f"{kind.name}: the server learnt the running request's client left",
        )
    finally:
        kind.event(f"release-{tag}").touch()
        client.close()
    wait_until(
        lambda: (
            requests_total(kind.url, "failure", "cancelled", model=kind.runs_on)
            >= cancelled_before + 1
        ),
        10,
        f"{kind.name}: the cancelled request counted cancelled once it returned",
    )
    if decoupled:
        wait_until(lambda: kind.event(f"closed-{tag}").exists(), 10, "the generator ended")
        assert not kind.event(f"after-{tag}").exists(), "the model sent on for nobody"
    np.testing.assert_array_equal(y_of(kind.infer(rows(7.0))), rows(7.0) * 2)
    assert requests_total(kind.url, "success", model=kind.runs_on) == success_before + 1
    assert (
        requests_total(kind.url, "failure", "cancelled", model=kind.runs_on) == cancelled_before + 1
    )


# -- 4. queue timeout ------------------------------------------------------------------------


def test_a_queued_request_past_its_timeout_fails_with_the_queue_timeout_status(
    kind: Kind, pool: concurrent.futures.ThreadPoolExecutor
):
    # every kind queues in its scheduling core's batcher (the decoupled kind's too) and, for
    # the ensemble, in the step model's batcher, which takes the ensemble request's timeout
    timeouts_before = failures(kind, "timeout")
    slow = Slow(kind, pool)
    tag = next(_tags)
    try:
        timed = pool.submit(kind.infer, rows(-4.0, tag=tag), 30.0, timeout=1000)  # 1 ms
        # the timeout is the longest it may wait: it is answered while the instance is busy
        concurrent.futures.wait([timed], timeout=5)
        answered_while_busy = timed.done()
    finally:
        first = slow.result()
    answer = timed.result(30)
    assert first.status_code == 200, first.text
    error = error_of(answer)
    assert answer.status_code == QUEUE_TIMEOUT_STATUS, (answer.status_code, error)
    assert "queue" in error, error  # "timed out in the queue" / "the queue timeout passed"
    assert failures(kind, "timeout") == timeouts_before + 1
    assert not kind.event(f"ran-{tag}").exists(), "the timed-out request ran"
    assert answered_while_busy, (
        f"{kind.name}: a request with a 1 ms queue timeout was answered only when the "
        "instance became free"
    )
    np.testing.assert_array_equal(y_of(kind.infer(rows(8.0))), rows(8.0) * 2)


# -- 6. statistics ---------------------------------------------------------------------------


def test_statistics_count_three_successful_requests(kind: Kind):
    before = kind.stats()
    for value in (1.0, 2.0, 3.0):
        np.testing.assert_array_equal(y_of(kind.infer(rows(value))), rows(value) * 2)
    after = kind.stats()  # for the ensemble: the ensemble's own statistics
    assert after["inference_count"] - before["inference_count"] == 3
    success = after["inference_stats"]["success"]["count"]
    assert success - before["inference_stats"]["success"]["count"] == 3
    assert after["inference_stats"]["fail"]["count"] == before["inference_stats"]["fail"]["count"]


# -- 7. metrics ------------------------------------------------------------------------------


def test_metrics_count_the_requests_of_the_model(kind: Kind):
    success_before = requests_total(kind.url, "success")
    invalid_before = requests_total(kind.url, "failure", "invalid")
    for value in (1.0, 2.0, 3.0):
        assert kind.infer(rows(value)).status_code == 200
    assert kind.infer(rows(-1.0)).status_code == 400
    assert requests_total(kind.url, "success") == success_before + 3
    assert requests_total(kind.url, "failure", "invalid") == invalid_before + 1


# -- 8. one mistake, one answer, on every path ------------------------------------------------


def http_answer(kind: Kind, body: dict) -> tuple[int, str]:
    answer = kind.http.post(f"/v2/models/{MODEL}/infer", json=body)
    return answer.status_code, error_of(answer)


def test_an_undeclared_output_requested_gets_one_answer_on_every_entry(kind: Kind):
    expected = (400, "output 'Z' is not an output of model 'conf'; its outputs are 'Y'")
    body = kind.body(rows(1.0))
    body["outputs"] = [{"name": "Z"}]
    assert http_answer(kind, body) == expected
    assert kind.call(rows(1.0), outputs=["Z"]) == expected
    assert kind.call(rows(1.0), outputs=["Y"]) == (200, "")


def test_a_priority_out_of_range_gets_one_answer(kind: Kind):
    # every kind has one level (the default): the decoupled runner took any priority as its
    # last level, the ensemble answered with its step's refusal
    expected = (400, "parameter 'priority': 2 is not a level of model 'conf' (1..1, 1 = highest)")
    assert http_answer(kind, kind.body(rows(1.0), priority=2)) == expected
    np.testing.assert_array_equal(y_of(kind.infer(rows(1.0), priority=1)), rows(1.0) * 2)


@pytest.mark.parametrize(
    ("shape", "message"),
    [
        (
            [1, 3],
            "input 'X': shape [1, 3] does not match the model's [-1, 4]: dimension 1 is 3, "
            "expected 4",
        ),
        (
            [1, 4, 1],
            "input 'X': shape [1, 4, 1] has 3 dimensions but the model expects 2: [-1, 4] "
            "(the first dimension is the batch, 1..8)",
        ),
        ([9, 4], "input 'X': shape [9, 4]: batch dimension 9 exceeds max_batch_size 8"),
    ],
    ids=["dims", "rank", "rows"],
)
def test_a_wrong_input_shape_gets_one_answer_on_every_entry(kind: Kind, shape, message):
    x = np.ones(shape, dtype=np.float32)
    assert http_answer(kind, kind.body(x)) == (400, message)
    assert kind.call(x) == (400, message)


# -- 5. drain on unload (last: it unloads and loads conf again) ------------------------------


def test_unload_lets_a_running_request_finish_and_refuses_new_ones(
    kind: Kind, pool: concurrent.futures.ThreadPoolExecutor
):
    slow = Slow(kind, pool)
    unloaded: concurrent.futures.Future[httpx.Response] | None = None
    try:
        # returns once the version has drained and its instances stopped
        unloaded = pool.submit(kind.http.post, f"/v2/repository/models/{MODEL}/unload")
        wait_until(
            lambda: kind.http.get(f"/v2/models/{MODEL}/ready").status_code != 200,
            10,
            f"{kind.name}: conf reads as not ready while it unloads",
        )
        during = kind.infer(rows(9.0))
        assert during.status_code == 503 or 400 <= during.status_code < 500, during.text
        assert not unloaded.done(), "the unload returned before the running request finished"
    finally:
        first = slow.result()
    assert first.status_code == 200, first.text
    np.testing.assert_array_equal(y_of(first)[:, 0], [-6.0])
    assert unloaded is not None
    assert unloaded.result(30).status_code == 200, unloaded.result().text
    after = kind.infer(rows(9.0))
    assert after.status_code == 503 or 400 <= after.status_code < 500, after.text
    loaded = kind.http.post(f"/v2/repository/models/{MODEL}/load", timeout=60)
    assert loaded.status_code == 200, loaded.text
    np.testing.assert_array_equal(y_of(kind.infer(rows(10.0))), rows(10.0) * 2)


# -- 9. the execution path's settings: execution timeout, token budget, adaptive batching ------
#
# Decoupled requests run on the same path as every other model's (one scheduling core, its
# dynamic batcher and watchdog, the instances' threads), so these settings act on them as on a
# batching model's. The kinds here are the ones whose batches take these settings: a batching
# model and a decoupled model that runs batches of streams (a Triton model whose ``execute``
# serves several requests, one response sender each: streaming's only way to form batches of
# several requests). Each model below is that Triton model: Y = 2 X, X a padded input (its
# length counts tokens: 4 per request here), marker -3 holds the instance as above.

PATH_KINDS = ["batching", "streaming"]

TRITON_CODE = '''
import json
import os
import time

import triton_python_backend_utils as pb_utils

EVENTS = {events!r}


def _touch(name):
    with open(os.path.join(EVENTS, name), "w"):
        pass


def _hold(name, deadline_s=15.0):
    path = os.path.join(EVENTS, name)
    end = time.monotonic() + deadline_s
    while not os.path.exists(path) and time.monotonic() < end:
        time.sleep(0.002)


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        self.decoupled = pb_utils.using_decoupled_model_transaction_policy(config)

    def execute(self, requests):
        answers = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()
            if x[0, 0] == -3:
                _touch(f"started-{{int(x[0, 1])}}")
                _hold(f"release-{{int(x[0, 1])}}")
            answer = pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("Y", x * 2)])
            if self.decoupled:  # one response, then the final flag, through its own sender
                final = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
                request.get_response_sender().send(answer, flags=final)
            else:
                answers.append(answer)
        return None if self.decoupled else answers
'''

PATH_COMMON = """\
backend: python
max_batch_size: 8
inputs: [{name: X, datatype: FP32, shape: [-1], pad_value: 0}]
outputs: [{name: Y, datatype: FP32, shape: [-1]}]
instance_group: [{count: 1, kind: cpu}]
"""

#: Model -> its settings (each model has one, so that they do not act on each other).
PATH_MODELS = {
    "timeout": "execution_timeout_s: 1\ndynamic_batching: {max_queue_delay_us: 0}\n",
    "tokens": "dynamic_batching: {max_queue_delay_us: 0, max_batch_tokens: 8}\n",
    # a lone client: the configured 1.5 s delay until the first batch is measured, then none
    # (early_dispatch off: it would also send a lone client's request at once)
    "adaptive": (
        "dynamic_batching:\n"
        "  {max_queue_delay_us: 1500000, early_dispatch: false, adaptive: {target_p99_ms: 200}}\n"
    ),
}


@dataclass
class PathKind:
    """One kind's server of the three models of this section."""

    name: str
    server: InProcessServer
    events: Path
    http: httpx.Client

    def infer(self, model: str, x: np.ndarray, timeout_s: float = 30.0) -> httpx.Response:
        tensor = {"name": "X", "datatype": "FP32", "shape": list(x.shape)}
        body = {"inputs": [{**tensor, "data": x.ravel().tolist()}]}
        return self.http.post(f"/v2/models/{model}/infer", json=body, timeout=timeout_s)

    def batch_sizes(self, model: str) -> dict[int, int]:
        """Executions of ``model`` so far by batch size (its statistics' ``batch_stats``)."""
        answer = self.http.get(f"/v2/models/{model}/stats")
        assert answer.status_code == 200, answer.text
        stats = answer.json()["model_stats"][0]["batch_stats"]
        return {entry["batch_size"]: entry["compute_infer"]["count"] for entry in stats}

    def hold(self, model: str, pool: concurrent.futures.ThreadPoolExecutor) -> tuple[int, Any]:
        """A request of ``model`` holding its instance (marker -3): its tag and its answer's
        future, once the model runs it."""
        tag = next(_tags)
        answer = pool.submit(self.infer, model, rows(-3.0, tag=tag))
        started = self.events / f"started-{tag}"
        wait_until(lambda: started.exists() or answer.done(), 10, f"{self.name}: {model} holds")
        assert not answer.done(), answer.result().text
        return tag, answer

    def release(self, tag: int) -> None:
        (self.events / f"release-{tag}").touch()


@pytest.fixture(scope="module", params=PATH_KINDS)
def path_kind(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[PathKind]:
    name = str(request.param)
    base = tmp_path_factory.mktemp(f"conformance_path_{name}")
    events = base / "events"
    events.mkdir()
    policy = "model_transaction_policy: {decoupled: true}\n" if name == "streaming" else ""
    for model, settings in PATH_MODELS.items():
        (base / "repo" / model / "1").mkdir(parents=True)
        (base / "repo" / model / "config.yaml").write_text(PATH_COMMON + settings + policy)
        code = textwrap.dedent(TRITON_CODE.format(events=str(events))).lstrip()
        (base / "repo" / model / "1" / "model.py").write_text(code)
    running = InProcessServer(base / "repo")
    with httpx.Client(base_url=running.url, timeout=30.0) as http:
        try:
            yield PathKind(name, running, events, http)
        finally:
            running.stop()


def test_a_call_past_the_execution_timeout_fails_with_500_and_its_instance_is_replaced(
    path_kind: PathKind, pool: concurrent.futures.ThreadPoolExecutor
):
    tag, stuck = path_kind.hold("timeout", pool)
    try:
        answer = stuck.result(8)  # the watchdog answers at 1 s; the model holds for 15
    finally:
        path_kind.release(tag)
    error = error_of(answer)
    assert answer.status_code == 500, (answer.status_code, error)
    assert "execution_timeout_s" in error and "did not finish within 1 s" in error, error
    # its replacement serves the next request, once loaded (503 "being restarted" until then)
    wait_until(
        lambda: path_kind.http.get("/v2/models/timeout/ready").status_code == 200,
        20,
        f"{path_kind.name}: the replacement instance is ready",
    )
    np.testing.assert_array_equal(y_of(path_kind.infer("timeout", rows(3.0))), rows(3.0) * 2)


def test_the_token_budget_bounds_the_batches_that_form(path_kind: PathKind):
    with concurrent.futures.ThreadPoolExecutor(5) as pool:  # the held request and four
        budgeted(path_kind, pool)


def budgeted(path_kind: PathKind, pool: concurrent.futures.ThreadPoolExecutor) -> None:
    before = path_kind.batch_sizes("tokens")
    tag, blocker = path_kind.hold("tokens", pool)
    try:
        # four requests of 4 tokens queue behind it; 8 tokens fit two of them in a batch
        queued = [pool.submit(path_kind.infer, "tokens", rows(v)) for v in (1.0, 2.0)]
        queued += [pool.submit(path_kind.infer, "tokens", rows(v)) for v in (3.0, 4.0)]
        wait_until(
            lambda: queue_state(path_kind.server.url, "tokens").queued == 4,
            10,
            f"{path_kind.name}: four requests queued behind the held one",
        )
    finally:
        path_kind.release(tag)
    assert blocker.result(30).status_code == 200
    for value, future in zip((1.0, 2.0, 3.0, 4.0), queued, strict=True):
        np.testing.assert_array_equal(y_of(future.result(30)), rows(value) * 2)
    after = path_kind.batch_sizes("tokens")
    added = {size: after[size] - before.get(size, 0) for size in after}
    assert {size: n for size, n in added.items() if n} == {1: 1, 2: 2}, added


def test_adaptive_batching_drops_the_delay_a_lone_client_gains_nothing_from(
    path_kind: PathKind,
):
    started = time.monotonic()
    first = path_kind.infer("adaptive", rows(1.0))
    assert y_of(first).shape == (1, 4)
    assert time.monotonic() - started >= 1.0  # the configured delay, before any measurement
    for value in (2.0, 3.0, 4.0):
        started = time.monotonic()
        answer = path_kind.infer("adaptive", rows(value))
        waited_s = time.monotonic() - started
        np.testing.assert_array_equal(y_of(answer), rows(value) * 2)
        assert waited_s < 0.75, f"{path_kind.name}: waited {waited_s:.2f} s for nobody"
