"""Running means of several sensors, one sequence per sensor, over gpuserve's HTTP API.

Serve the example repository first::

    gpuserve serve --model-repository examples/sequence/model_repository

then ``python examples/sequence/client.py``: each sensor's readings are sent one request at
a time (``sequence_start`` on the first, ``sequence_end`` on the last); the server keeps each
sequence's sum and count between its requests, and batches the sensors together.
"""

from __future__ import annotations

import argparse
import concurrent.futures

import numpy as np
import tritonclient.http as httpclient

READINGS = {
    101: [20.5, 21.0, 21.5, 22.0],
    102: [5.0, 7.0, 9.0],
    "sensor-c": [100.0, 0.0, 50.0, 50.0, 25.0],
}


def run_sensor(url: str, sensor: int | str, values: list[float]) -> list[float]:
    client = httpclient.InferenceServerClient(url)
    means = []
    for index, value in enumerate(values):
        reading = httpclient.InferInput("VALUE", [1, 1], "FP32")
        reading.set_data_from_numpy(np.array([[value]], dtype=np.float32))
        result = client.infer(
            "running_mean",
            [reading],
            sequence_id=sensor,
            sequence_start=index == 0,
            sequence_end=index == len(values) - 1,
        )
        means.append(float(result.as_numpy("MEAN")[0, 0]))
    return means


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="localhost:8000", help="host:port of the HTTP API")
    args = parser.parse_args()
    with concurrent.futures.ThreadPoolExecutor(len(READINGS)) as pool:
        futures = {s: pool.submit(run_sensor, args.url, s, v) for s, v in READINGS.items()}
        for sensor, future in futures.items():
            means = future.result()
            print(f"{sensor}: " + " ".join(f"{m:g}" for m in means))
            expected = np.cumsum(READINGS[sensor]) / np.arange(1, len(READINGS[sensor]) + 1)
            assert np.allclose(means, expected), (means, expected)


if __name__ == "__main__":
    main()
