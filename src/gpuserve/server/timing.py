"""Per-request timing reported to clients, with the same names over HTTP and gRPC.

HTTP sends them as response headers; gRPC as trailing metadata (keys are lower case, as gRPC
metadata requires). Values are whole microseconds as decimal strings.

* ``x-queue-time-us``: from admission into the model's queue until its batch started.
* ``x-compute-time-us``: the batch's preprocess + forward + postprocess.
* ``x-total-time-us``: from the server receiving the request until the response was ready
  (protocol decode, queue, compute and encode; network time is not included).
"""

from __future__ import annotations

QUEUE_TIME_US = "x-queue-time-us"
COMPUTE_TIME_US = "x-compute-time-us"
TOTAL_TIME_US = "x-total-time-us"

QUEUE_TIME_US_HEADER = QUEUE_TIME_US.encode()
COMPUTE_TIME_US_HEADER = COMPUTE_TIME_US.encode()
TOTAL_TIME_US_HEADER = TOTAL_TIME_US.encode()


def microseconds(seconds: float) -> str:
    """``seconds`` as whole microseconds (truncated), the value format of the timing keys."""
    return str(int(seconds * 1e6))


def timing_metadata(queue_s: float, compute_s: float, total_s: float) -> list[tuple[str, str]]:
    """The three timing keys and values, e.g. for gRPC trailing metadata."""
    return [
        (QUEUE_TIME_US, microseconds(queue_s)),
        (COMPUTE_TIME_US, microseconds(compute_s)),
        (TOTAL_TIME_US, microseconds(total_s)),
    ]
