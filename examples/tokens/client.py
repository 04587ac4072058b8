"""Stream the tokens example's answer as it is generated.

HTTP (default): Triton's generate extension, ``POST /v2/models/tokens/generate_stream``,
read as server-sent events with httpx. ``--grpc``: ``ModelStreamInfer`` with tritonclient,
the end of the stream marked by ``triton_final_response``.

    python examples/tokens/client.py --url 127.0.0.1:8000 "hello"
    python examples/tokens/client.py --grpc --url 127.0.0.1:8001 "hello"
"""

from __future__ import annotations

import argparse
import json
import queue
import sys

import numpy as np


def stream_http(url: str, prompt: str, max_tokens: int | None) -> list[str]:
    import httpx

    body: dict = {"PROMPT": prompt}
    if max_tokens is not None:
        body["MAX_TOKENS"] = max_tokens
    tokens = []
    endpoint = f"http://{url}/v2/models/tokens/generate_stream"
    with httpx.stream("POST", endpoint, json=body, timeout=60) as response:
        if response.status_code != 200:
            sys.exit(f"error {response.status_code}: {response.read().decode()}")
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            event = json.loads(line[len("data: ") :])
            if "error" in event:
                sys.exit(f"error: {event['error']}")
            tokens.append(event["TOKEN"])
            print(event["TOKEN"], end=" ", flush=True)
    print()
    return tokens


def stream_grpc(url: str, prompt: str, max_tokens: int | None) -> list[str]:
    import tritonclient.grpc as grpcclient

    inputs = [grpcclient.InferInput("PROMPT", [1], "BYTES")]
    inputs[0].set_data_from_numpy(np.array([prompt.encode()], dtype=object))
    if max_tokens is not None:
        inputs.append(grpcclient.InferInput("MAX_TOKENS", [1], "INT32"))
        inputs[1].set_data_from_numpy(np.array([max_tokens], dtype=np.int32))
    results: queue.Queue = queue.Queue()
    tokens = []
    with grpcclient.InferenceServerClient(url) as client:
        client.start_stream(callback=lambda result, error: results.put((result, error)))
        client.async_stream_infer("tokens", inputs, enable_empty_final_response=True)
        while True:
            result, error = results.get(timeout=60)
            if error is not None:
                sys.exit(f"error: {error}")
            response = result.get_response()
            if response.outputs:
                token = result.as_numpy("TOKEN")[0].decode()
                tokens.append(token)
                print(token, end=" ", flush=True)
            if response.parameters["triton_final_response"].bool_param:
                break
        client.stop_stream()
    print()
    return tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("prompt", nargs="?", default="hello")
    parser.add_argument("--url", default="127.0.0.1:8000", help="host:port (HTTP, or gRPC)")
    parser.add_argument("--grpc", action="store_true", help="stream over gRPC instead")
    parser.add_argument("--max-tokens", type=int, default=None)
    args = parser.parse_args()
    stream = stream_grpc if args.grpc else stream_http
    stream(args.url, args.prompt, args.max_tokens)


if __name__ == "__main__":
    main()
