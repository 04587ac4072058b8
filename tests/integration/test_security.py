"""Security over real HTTP and gRPC (issue 8): bearer tokens for inference and for
management, management off unless enabled, TLS from certificate files (a self-signed
certificate made at test time, real clients), limits on header size, tensor element count and
BYTES element size, no file paths or stack traces in answers, and no model loaded from outside
the repository (path traversal in names, symbolic links in the scan and the load API)."""

from __future__ import annotations

import contextlib
import datetime
import ipaddress
import json
import os
import re
import socket
import ssl
from pathlib import Path

import grpc
import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import given, settings
from hypothesis import strategies as st
from tritonclient.grpc import service_pb2, service_pb2_grpc

from tests.fixtures.lifecycle_support import make_repository
from tests.helpers import InProcessServer

API, MANAGEMENT = "api-s3cret", "mgmt-s3cret"
BEARER_API = {"authorization": f"Bearer {API}"}
BEARER_MANAGEMENT = {"authorization": f"Bearer {MANAGEMENT}"}
ROW = [float(i) for i in range(16)]


def fp32_body(rows: int = 1) -> dict:
    return {
        "inputs": [{"name": "INPUT0", "shape": [rows, 16], "datatype": "FP32", "data": ROW * rows}]
    }


def grpc_fp32(model: str = "double_fp32") -> service_pb2.ModelInferRequest:
    message = service_pb2.ModelInferRequest(model_name=model)
    message.inputs.add(name="INPUT0", datatype="FP32", shape=[1, 16])
    message.raw_input_contents.append(np.arange(16, dtype="<f4").tobytes())
    return message


def code_of(call, *args, **kwargs) -> grpc.StatusCode:
    try:
        call(*args, **kwargs)
    except grpc.RpcError as err:
        return err.code()
    return grpc.StatusCode.OK


# -- bearer tokens -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def token_server(tmp_path_factory):
    repo = make_repository(tmp_path_factory.mktemp("tokens") / "repo", "double_fp32", "echo_bytes")
    running = InProcessServer(
        repo,
        metrics_port=-1,
        model_control_mode="explicit",
        load_model=["*"],
        api_token=API,
        management_token=MANAGEMENT,
    )
    yield running
    running.stop()


def test_http_api_token_guards_everything_but_health_metrics_and_openapi(token_server):
    with httpx.Client(base_url=token_server.url, timeout=30) as client:
        for path in ("/v2/health/live", "/v2/health/ready", "/metrics", "/v2/openapi.json"):
            assert client.get(path).status_code == 200, path
        before = client.get("/v2/models/double_fp32/stats", headers=BEARER_API).json()
        for headers in (
            {},
            {"authorization": "Bearer wrong"},
            {"authorization": API},
            BEARER_MANAGEMENT,
        ):
            refused = client.post("/v2/models/double_fp32/infer", json=fp32_body(), headers=headers)
            assert refused.status_code == 401, refused.text
            assert refused.headers["www-authenticate"] == "Bearer"
            assert "Bearer" in refused.json()["error"]
            for path in (
                "/v2",
                "/v2/models/double_fp32",
                "/v2/models/double_fp32/ready",
                "/v2/models/double_fp32/config",
                "/v2/models/stats",
            ):
                assert client.get(path, headers=headers).status_code == 401, path
        ok = client.post("/v2/models/double_fp32/infer", json=fp32_body(), headers=BEARER_API)
        assert ok.status_code == 200 and ok.json()["outputs"][0]["data"][1] == 2.0
        assert client.get("/v2/models/double_fp32", headers=BEARER_API).status_code == 200
        after = client.get("/v2/models/double_fp32/stats", headers=BEARER_API).json()
        # the refused requests never reached the model
        count = lambda stats: stats["model_stats"][0]["inference_count"]  # noqa: E731
        assert count(after) == count(before) + 1


def test_http_management_token_is_separate_from_the_api_token(token_server):
    with httpx.Client(base_url=token_server.url, timeout=30) as client:
        # reading the repository takes either token, but not none
        assert client.post("/v2/repository/index").status_code == 401
        assert client.post("/v2/repository/index", headers=BEARER_API).status_code == 200
        assert client.post("/v2/repository/index", headers=BEARER_MANAGEMENT).status_code == 200
        load = "/v2/repository/models/echo_bytes/load"
        assert client.post(load, headers=BEARER_API).status_code == 401
        response = client.post(load, headers=BEARER_MANAGEMENT)
        assert response.status_code == 200, response.text
        # the management token is not an inference token
        infer = client.post("/v2/models/echo_bytes/infer", headers=BEARER_MANAGEMENT, json={})
        assert infer.status_code == 401


def test_load_generator_sends_the_api_token_over_http_and_grpc(token_server):
    from gpuserve.bench.benchmark import BenchConfig, run_benchmark
    from gpuserve.bench.loadgen import LoadSettings
    from gpuserve.bench.server_info import ServerError

    fast = LoadSettings(warmup_s=0.2, window_s=0.3, stable_windows=2, tolerance=0.5, max_windows=3)
    base = {"url": token_server.url, "model": "double_fp32", "levels": [2], "settings": fast}
    with pytest.raises(ServerError, match="HTTP 401"):
        run_benchmark(BenchConfig(**base))
    for protocol in ("http", "grpc"):
        config = BenchConfig(**base, protocol=protocol, grpc_url=token_server.grpc_url, token=API)
        [level] = run_benchmark(config).levels
        assert level.summary.ok > 0 and not level.summary.errors, (protocol, level.summary)
        assert level.server is not None  # the statistics reads carried the token too


def test_grpc_api_token_and_management_token(token_server):
    with grpc.insecure_channel(token_server.grpc_url) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        health = health_pb2_grpc.HealthStub(channel)
        # open: liveness, readiness and the standard health service
        assert stub.ServerLive(service_pb2.ServerLiveRequest(), timeout=5).live
        assert stub.ServerReady(service_pb2.ServerReadyRequest(), timeout=5).ready
        serving = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
        assert serving.status == health_pb2.HealthCheckResponse.SERVING
        api = tuple(BEARER_API.items())
        wrong = (("authorization", "Bearer nope"),)
        for metadata in ((), wrong, tuple(BEARER_MANAGEMENT.items())):
            assert code_of(stub.ModelInfer, grpc_fp32(), metadata=metadata, timeout=10) == (
                grpc.StatusCode.UNAUTHENTICATED
            )
            request = service_pb2.ModelMetadataRequest(name="double_fp32")
            assert code_of(stub.ModelMetadata, request, metadata=metadata, timeout=5) == (
                grpc.StatusCode.UNAUTHENTICATED
            )
        with pytest.raises(grpc.RpcError) as err:
            list(stub.ModelStreamInfer(iter([grpc_fp32()]), timeout=10))
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        response = stub.ModelInfer(grpc_fp32(), metadata=api, timeout=10)
        assert np.frombuffer(response.raw_output_contents[0], "<f4")[1] == 2.0
        streamed = list(stub.ModelStreamInfer(iter([grpc_fp32()]), metadata=api, timeout=10))
        assert len(streamed) == 1 and not streamed[0].error_message
        index = service_pb2.RepositoryIndexRequest()
        assert code_of(stub.RepositoryIndex, index, timeout=5) == grpc.StatusCode.UNAUTHENTICATED
        assert code_of(stub.RepositoryIndex, index, metadata=api, timeout=5) == grpc.StatusCode.OK
        load = service_pb2.RepositoryModelLoadRequest(model_name="echo_bytes")
        assert code_of(stub.RepositoryModelLoad, load, metadata=api, timeout=30) == (
            grpc.StatusCode.UNAUTHENTICATED
        )
        management = tuple(BEARER_MANAGEMENT.items())
        assert code_of(stub.RepositoryModelLoad, load, metadata=management, timeout=30) == (
            grpc.StatusCode.OK
        )


def test_management_is_off_unless_enabled(tmp_path):
    repo = make_repository(tmp_path / "repo", "double_fp32")
    server = InProcessServer(repo, metrics_port=-1)  # model control mode 'none', no flags
    try:
        with httpx.Client(base_url=server.url, timeout=30) as client:
            for action in (
                "load",
                "unload",
                "rollback",
                "canary",
                "canary/promote",
                "canary/abort",
            ):
                response = client.post(f"/v2/repository/models/double_fp32/{action}")
                assert response.status_code == 403, (action, response.text)
                assert "disabled" in response.json()["error"]
            # reading stays open
            assert client.post("/v2/repository/index").status_code == 200
            status = client.post("/v2/repository/models/double_fp32/status")
            assert status.status_code == 200
        with grpc.insecure_channel(server.grpc_url) as channel:
            stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
            unload = service_pb2.RepositoryModelUnloadRequest(model_name="double_fp32")
            assert code_of(stub.RepositoryModelUnload, unload, timeout=10) == (
                grpc.StatusCode.PERMISSION_DENIED
            )
            assert stub.ModelReady(service_pb2.ModelReadyRequest(name="double_fp32")).ready
    finally:
        server.stop()
    server = InProcessServer(repo, metrics_port=-1, enable_management=True)
    try:
        rollback = httpx.post(f"{server.url}/v2/repository/models/double_fp32/rollback", timeout=30)
        assert rollback.status_code == 400  # enabled; nothing to roll back to
    finally:
        server.stop()


# -- TLS ---------------------------------------------------------------------------------


def self_signed_certificate(folder: Path) -> tuple[Path, Path]:
    """A certificate for localhost and 127.0.0.1, valid for a day, and its key (PEM)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.UTC)
    certificate = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            ),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_file, key_file = folder / "server.crt", folder / "server.key"
    cert_file.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return cert_file, key_file


def test_tls_for_http_and_grpc_with_real_clients(tmp_path):
    cert_file, key_file = self_signed_certificate(tmp_path)
    repo = make_repository(tmp_path / "repo", "double_fp32")
    server = InProcessServer(repo, metrics_port=-1, tls_cert_file=cert_file, tls_key_file=key_file)
    https = f"https://127.0.0.1:{server.port}"
    try:
        trust = ssl.create_default_context(cafile=str(cert_file))
        with httpx.Client(base_url=https, verify=trust, timeout=30) as client:
            assert client.get("/v2/health/ready").status_code == 200
            response = client.post("/v2/models/double_fp32/infer", json=fp32_body())
            assert response.status_code == 200 and response.json()["outputs"][0]["data"][3] == 6.0
        with pytest.raises(httpx.HTTPError):  # no certificate trust: refused by the client
            httpx.get(f"{https}/v2/health/ready", timeout=10)
        plain = None
        with contextlib.suppress(httpx.HTTPError):  # plain HTTP to the TLS port: no answer
            plain = httpx.get(f"{server.url}/v2/health/ready", timeout=10)
        assert plain is None or plain.status_code == 400
        triton = grpcclient.InferenceServerClient(
            server.grpc_url, ssl=True, root_certificates=str(cert_file)
        )
        try:
            tensor = grpcclient.InferInput("INPUT0", [1, 16], "FP32")
            tensor.set_data_from_numpy(np.ones((1, 16), np.float32))
            out = triton.infer("double_fp32", [tensor]).as_numpy("OUTPUT0")
            np.testing.assert_array_equal(out, np.full((1, 16), 2.0))
        finally:
            triton.close()
        with grpc.insecure_channel(server.grpc_url) as channel:  # plaintext: no answer
            stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
            assert code_of(stub.ServerLive, service_pb2.ServerLiveRequest(), timeout=3) in (
                grpc.StatusCode.UNAVAILABLE,
                grpc.StatusCode.DEADLINE_EXCEEDED,
            )
    finally:
        server.stop()


def test_load_generator_over_tls_with_the_server_certificate(tmp_path):
    from gpuserve.bench.benchmark import BenchConfig, run_benchmark
    from gpuserve.bench.loadgen import LoadSettings
    from gpuserve.bench.server_info import ServerError

    cert_file, key_file = self_signed_certificate(tmp_path)
    repo = make_repository(tmp_path / "repo", "double_fp32")
    server = InProcessServer(repo, metrics_port=-1, tls_cert_file=cert_file, tls_key_file=key_file)
    fast = LoadSettings(warmup_s=0.2, window_s=0.3, stable_windows=2, tolerance=0.5, max_windows=3)
    https = f"https://127.0.0.1:{server.port}"
    base = {"url": https, "model": "double_fp32", "levels": [2], "settings": fast}
    try:
        with pytest.raises(ServerError, match="CERTIFICATE_VERIFY_FAILED"):
            run_benchmark(BenchConfig(**base))  # not trusted without the CA file
        for protocol, grpc_url in (("http", ""), ("grpc", f"grpcs://{server.grpc_url}")):
            config = BenchConfig(**base, protocol=protocol, grpc_url=grpc_url, ca_file=cert_file)
            result = run_benchmark(config)
            [level] = result.levels
            assert level.summary.ok > 0 and not level.summary.errors, (protocol, level.summary)
            assert level.server is not None
    finally:
        server.stop()


def test_tls_needs_both_files(tmp_path):
    from gpuserve.config import ServerConfig

    with pytest.raises(ValueError, match="tls_key_file"):
        ServerConfig(model_repository=tmp_path, tls_cert_file=tmp_path / "server.crt")


# -- limits ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def limited_server(tmp_path_factory):
    repo = make_repository(
        tmp_path_factory.mktemp("limits") / "repo", "double_fp32", "echo_bytes", "varlen_fp32"
    )
    running = InProcessServer(
        repo,
        metrics_port=-1,
        max_header_bytes=4096,
        max_request_body_bytes=64 * 1024,
        max_tensor_elements=1000,
        max_bytes_element_bytes=100,
    )
    yield running
    running.stop()


def raw_http(port: int, request: bytes, chunks: int = 1) -> bytes:
    """Send ``request`` (in ``chunks`` pieces) on a fresh connection; return all it answers."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        size = -(-len(request) // chunks)
        try:
            for start in range(0, len(request), size):
                sock.sendall(request[start : start + size])
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server answered and closed before the rest was sent
        answer = b""
        while True:
            try:
                data = sock.recv(65536)
            except ConnectionResetError:
                break
            if not data:
                break
            answer += data
    return answer


def test_headers_larger_than_the_limit_get_431(limited_server):
    with httpx.Client(base_url=limited_server.url, timeout=10) as client:
        big = client.get("/v2/health/live", headers={"x-padding": "a" * 5000})
        assert big.status_code == 431 and "max_header_bytes" in big.json()["error"]
        many = client.get("/v2/health/live", headers={f"x-h{i}": "v" * 40 for i in range(120)})
        assert many.status_code == 431
        assert client.get("/v2/health/live", headers={"x-padding": "a" * 1000}).status_code == 200
        long_url = client.get("/v2/models/" + "m" * 5000)
        assert long_url.status_code == 431
    # one header that never ends, sent in pieces: cut off, never buffered without bound
    endless = b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\nX-Endless: " + b"a" * 200_000
    answer = raw_http(limited_server.port, endless, chunks=20)
    assert answer.startswith(b"HTTP/1.1 431 "), answer[:100]
    assert httpx.get(f"{limited_server.url}/v2/health/live").status_code == 200


def test_grpc_metadata_larger_than_the_limit_is_refused(limited_server):
    with grpc.insecure_channel(limited_server.grpc_url) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        code = code_of(
            stub.ModelInfer, grpc_fp32(), metadata=(("x-padding", "a" * 20000),), timeout=10
        )
        assert code not in (grpc.StatusCode.OK, grpc.StatusCode.UNKNOWN), code
        assert code_of(stub.ModelInfer, grpc_fp32(), timeout=10) == grpc.StatusCode.OK


def test_body_larger_than_the_limit_gets_413(limited_server):
    body = fp32_body()
    body["padding"] = "x" * 70_000
    response = httpx.post(f"{limited_server.url}/v2/models/double_fp32/infer", json=body)
    assert response.status_code == 413 and "max_request_body_bytes" in response.json()["error"]


def test_tensor_element_count_limit_refuses_on_the_shape(limited_server):
    url = f"{limited_server.url}/v2/models/varlen_fp32/infer"
    ok = {"inputs": [{"name": "X", "shape": [1, 1000], "datatype": "FP32", "data": [0.0] * 1000}]}
    assert httpx.post(url, json=ok).status_code == 200
    over = {"inputs": [{"name": "X", "shape": [1, 1001], "datatype": "FP32", "data": [0.0] * 1001}]}
    response = httpx.post(url, json=over)
    assert response.status_code == 400 and "max_tensor_elements" in response.json()["error"]
    # a shape of 10^18 elements with no data is refused from the shape alone
    huge = {"inputs": [{"name": "X", "shape": [1, 10**18], "datatype": "FP32", "data": []}]}
    response = httpx.post(url, json=huge)
    assert response.status_code == 400 and "max_tensor_elements" in response.json()["error"]
    with grpc.insecure_channel(limited_server.grpc_url) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        message = service_pb2.ModelInferRequest(model_name="varlen_fp32")
        message.inputs.add(name="X", datatype="FP32", shape=[1, 10**15])
        message.raw_input_contents.append(b"")
        with pytest.raises(grpc.RpcError) as err:
            stub.ModelInfer(message, timeout=10)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "max_tensor_elements" in err.value.details()


def test_bytes_element_size_limit(limited_server):
    url = f"{limited_server.url}/v2/models/echo_bytes/infer"

    def body(text: str) -> dict:
        return {"inputs": [{"name": "TEXT", "shape": [1, 1], "datatype": "BYTES", "data": [text]}]}

    assert httpx.post(url, json=body("a" * 100)).status_code == 200
    response = httpx.post(url, json=body("a" * 101))
    assert response.status_code == 400
    assert "101 bytes" in response.json()["error"] and "max_bytes_element_bytes" in response.text
    # binary tensor extension: a 4-byte length prefix, then the element
    element = b"b" * 500
    raw = len(element).to_bytes(4, "little") + element
    header = json.dumps(
        {
            "inputs": [
                {
                    "name": "TEXT",
                    "shape": [1, 1],
                    "datatype": "BYTES",
                    "parameters": {"binary_data_size": len(raw)},
                }
            ]
        }
    ).encode()
    response = httpx.post(
        url,
        content=header + raw,
        headers={"inference-header-content-length": str(len(header))},
    )
    assert response.status_code == 400 and "max_bytes_element_bytes" in response.text
    with grpc.insecure_channel(limited_server.grpc_url) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        for raw_contents in (False, True):
            message = service_pb2.ModelInferRequest(model_name="echo_bytes")
            tensor = message.inputs.add(name="TEXT", datatype="BYTES", shape=[1, 1])
            if raw_contents:
                message.raw_input_contents.append(raw)
            else:
                tensor.contents.bytes_contents.append(element)
            with pytest.raises(grpc.RpcError) as err:
                stub.ModelInfer(message, timeout=10)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "max_bytes_element_bytes" in err.value.details()


# -- no file paths or stack traces in answers ------------------------------------------------

_ABSOLUTE = re.compile(r"(?<![\w.])/(?!v2/)[\w.-]+/[\w./-]+")


def test_error_bodies_and_reasons_carry_no_file_paths(tmp_path, caplog):
    repo = make_repository(tmp_path / "repo", "double_fp32", "broken_model")
    bad = repo / "bad_config"
    (bad / "1").mkdir(parents=True)
    (bad / "config.yaml").write_text("backend: python\nmax_batch_size: -3\n")
    (bad / "1" / "model.py").write_text("")
    root = str(repo.resolve())
    server = InProcessServer(repo, metrics_port=-1, model_control_mode="explicit", load_model=["*"])
    texts: list[str] = []
    try:
        with httpx.Client(base_url=server.url, timeout=30) as client:
            texts.append(client.post("/v2/repository/index").text)
            for model in ("broken_model", "bad_config"):
                texts.append(client.get(f"/v2/models/{model}/ready").text)
                texts.append(client.get(f"/v2/models/{model}").text)
                texts.append(client.post(f"/v2/models/{model}/infer", json=fp32_body()).text)
                texts.append(client.post(f"/v2/repository/models/{model}/status").text)
                load = client.post(f"/v2/repository/models/{model}/load")
                assert load.status_code == 400
                texts.append(load.text)
        with grpc.insecure_channel(server.grpc_url) as channel:
            stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
            index = stub.RepositoryIndex(service_pb2.RepositoryIndexRequest(), timeout=5)
            texts.extend(row.reason for row in index.models)
            for model in ("broken_model", "bad_config"):
                with pytest.raises(grpc.RpcError) as err:
                    stub.ModelInfer(grpc_fp32(model), timeout=10)
                texts.append(err.value.details())
                load = service_pb2.RepositoryModelLoadRequest(model_name=model)
                with pytest.raises(grpc.RpcError) as err:
                    stub.RepositoryModelLoad(load, timeout=30)
                texts.append(err.value.details())
    finally:
        server.stop()
    everything = "\n".join(texts)
    assert "failed to load" in everything and "max_batch_size" in everything
    assert "bad_config/config.yaml" in everything  # named relative to the repository
    assert root not in everything and str(tmp_path) not in everything
    assert not _ABSOLUTE.search(everything), _ABSOLUTE.search(everything)
    assert "Traceback" not in everything and 'File "' not in everything
    # the log keeps the full paths for the operator
    assert root in caplog.text or str(repo) in caplog.text


def test_redactor_rules():
    from gpuserve.server.security import Redactor

    redact = Redactor(Path("/srv/models")).text
    assert redact("/srv/models/m/1/model.pt: bad") == "m/1/model.pt: bad"
    assert redact("see '/usr/lib/python3/site.py', line 3") == "see '.../site.py', line 3"
    assert redact("no endpoint GET /v2/models/x/y") == "no endpoint GET /v2/models/x/y"
    assert redact("shape [1, 16]/2 and 3/4 and N/A") == "shape [1, 16]/2 and 3/4 and N/A"
    assert redact("model repository /srv/models is not a folder") == (
        "model repository <model repository> is not a folder"
    )
    relative = Redactor(Path("models")).text
    assert relative("models/m/config.yaml: field x") == "m/config.yaml: field x"
    assert relative("GET /v2/models/m") == "GET /v2/models/m"


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.from_regex(r"[A-Za-z0-9_.-]{1,12}", fullmatch=True), min_size=1, max_size=4),
    st.text(max_size=20),
    st.sampled_from(["", ": bad", "' (line 3)", ", and more", "\n"]),
)
def test_redactor_never_lets_an_absolute_path_through(parts, before, after):
    from gpuserve.server.security import Redactor

    root = "/srv/model-repo"
    redact = Redactor(Path(root)).text
    for path in (root + "/" + "/".join(parts), "/opt/elsewhere/" + "/".join(parts)):
        message = redact(f"{before} {path}{after}")
        assert root not in message and "/opt/elsewhere" not in message, message


# -- nothing loads from outside the repository -------------------------------------------------


def outside_model(folder: Path, marker: Path) -> Path:
    """A valid python model outside the repository whose import writes ``marker``."""
    (folder / "1").mkdir(parents=True)
    (folder / "config.yaml").write_text(
        "backend: python\nmax_batch_size: 8\n"
        "inputs:\n  - {name: INPUT0, datatype: FP32, shape: [16]}\n"
        "outputs:\n  - {name: OUTPUT0, datatype: FP32, shape: [16]}\n"
    )
    (folder / "1" / "model.py").write_text(
        f"from pathlib import Path\nPath({str(marker)!r}).write_text('imported')\n"
        "from gpuserve import PythonModel\n\n\nclass Model(PythonModel):\n"
        "    def forward(self, batch):\n        return {'OUTPUT0': batch['INPUT0'] * 2}\n"
    )
    return folder


def test_symbolic_links_out_of_the_repository_are_never_loaded(tmp_path):
    marker = tmp_path / "outside-imported"
    outside = outside_model(tmp_path / "outside" / "evil", marker)
    repo = make_repository(tmp_path / "repo", "double_fp32")
    os.symlink(outside, repo / "linked_model")  # a whole model folder
    (repo / "linked_version").mkdir()  # a version folder
    (repo / "linked_version" / "config.yaml").write_text((outside / "config.yaml").read_text())
    os.symlink(outside / "1", repo / "linked_version" / "1")
    (repo / "linked_file" / "1").mkdir(parents=True)  # a file inside a version folder
    (repo / "linked_file" / "config.yaml").write_text((outside / "config.yaml").read_text())
    os.symlink(outside / "1" / "model.py", repo / "linked_file" / "1" / "model.py")
    inside = repo / "double_fp32"  # a link that stays inside the repository is fine
    os.symlink(inside, repo / "alias")
    server = InProcessServer(repo, metrics_port=-1, model_control_mode="explicit", load_model=["*"])
    try:
        with httpx.Client(base_url=server.url, timeout=30) as client:
            index = {row["name"]: row for row in client.post("/v2/repository/index").json()}
            for name in ("linked_model", "linked_version", "linked_file"):
                assert index[name]["state"] != "READY", index[name]
                assert "outside the model repository" in index[name]["reason"], index[name]
                assert client.post(f"/v2/models/{name}/infer", json=fp32_body()).status_code == 503
                load = client.post(f"/v2/repository/models/{name}/load")
                assert load.status_code == 400 and "outside the model repository" in load.text
            assert index["alias"]["state"] == "READY"
            assert client.post("/v2/models/alias/infer", json=fp32_body()).status_code == 200
    finally:
        server.stop()
    assert not marker.exists(), "a model outside the repository was imported"


TRAVERSAL_NAMES = ["..", "%2E%2E", ".hidden", "..%2F..%2Fevil", "a%00b", "%2Fetc", "%5C..%5Cevil"]


def test_traversal_in_model_names_is_refused_by_the_load_api(tmp_path):
    marker = tmp_path / "outside-imported"
    outside_model(tmp_path / "evil", marker)  # tmp_path/evil: a sibling of the repository
    (tmp_path / "config.yaml").write_text((tmp_path / "evil" / "config.yaml").read_text())
    (tmp_path / "1").mkdir()  # the repository's parent looks like a model folder too
    (tmp_path / "1" / "model.py").write_text((tmp_path / "evil" / "1" / "model.py").read_text())
    repo = make_repository(tmp_path / "repo", "double_fp32")
    server = InProcessServer(repo, metrics_port=-1, model_control_mode="explicit", load_model=["*"])
    try:
        for name in TRAVERSAL_NAMES:
            response = httpx.post(f"{server.url}/v2/repository/models/{name}/load", timeout=30)
            assert response.status_code in (400, 404), (name, response.text)
        with grpc.insecure_channel(server.grpc_url) as channel:
            stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
            for raw in ("..", "../evil", "/etc", str(tmp_path / "evil"), "a\\..\\b", ".", "a\x00"):
                load = service_pb2.RepositoryModelLoadRequest(model_name=raw)
                code = code_of(stub.RepositoryModelLoad, load, timeout=30)
                assert code == grpc.StatusCode.INVALID_ARGUMENT, (raw, code)
        infer = httpx.post(f"{server.url}/v2/models/double_fp32/infer", json=fp32_body())
        assert infer.status_code == 200
    finally:
        server.stop()
    assert not marker.exists()


def test_a_load_request_config_cannot_point_outside_the_version_folder(tmp_path):
    repo = make_repository(tmp_path / "repo", "double_fp32")
    server = InProcessServer(repo, metrics_port=-1, model_control_mode="explicit", load_model=["*"])
    try:
        for model_dir in ("/etc", "../../outside", "sub/../../x"):
            config = {
                "backend": "huggingface",
                "max_batch_size": 8,
                "huggingface": {"task": "feature-extraction", "model_dir": model_dir},
            }
            body = {"parameters": {"config": json.dumps(config)}}
            response = httpx.post(
                f"{server.url}/v2/repository/models/double_fp32/load", json=body, timeout=30
            )
            assert response.status_code == 400 and "model_dir" in response.json()["error"]
        assert (
            httpx.post(f"{server.url}/v2/models/double_fp32/infer", json=fp32_body()).status_code
            == 200
        )
    finally:
        server.stop()


def test_version_labels_that_are_not_ascii_digits_are_404(token_server):
    with httpx.Client(base_url=token_server.url, timeout=10, headers=BEARER_API) as client:
        for label in ("\u00b2", "\u0661", "1.0", "-1", "+1"):  # superscript 2, Arabic-Indic 1
            for tail in ("", "/ready", "/config", "/stats"):
                path = f"/v2/models/double_fp32/versions/{label}{tail}"
                assert client.get(path).status_code == 404, path
            infer = client.post(f"/v2/models/double_fp32/versions/{label}/infer", json=fp32_body())
            assert infer.status_code == 404
    with grpc.insecure_channel(token_server.grpc_url) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        message = grpc_fp32()
        message.model_version = "²"
        assert code_of(
            stub.ModelInfer, message, metadata=tuple(BEARER_API.items()), timeout=10
        ) == (grpc.StatusCode.NOT_FOUND)
