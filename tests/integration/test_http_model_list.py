"""``GET /v2/models``, KServe's model list, against the real server: every model of the
repository by name (``{"models": [...]}``, as KServe's ``ListModelsResponse``), a model that
failed to load included; behind the API token like the other V2 views."""

from __future__ import annotations

import httpx

from tests.fixtures.triton_examples import write_auto_complete_simple
from tests.helpers import InProcessServer


def test_the_model_list_names_every_model(tmp_path):
    root = tmp_path / "models"
    write_auto_complete_simple(root / "simple")
    write_auto_complete_simple(root / "another")
    (root / "broken").mkdir()
    (root / "broken" / "config.pbtxt").write_text('backend: "python"\n')  # no version folder
    server = InProcessServer(root, api_token="s3cret")
    try:
        assert httpx.get(f"{server.url}/v2/models", timeout=10).status_code == 401
        auth = {"authorization": "Bearer s3cret"}
        for path in ("/v2/models", "/v2/models/"):
            answer = httpx.get(f"{server.url}{path}", headers=auth, timeout=10)
            assert answer.status_code == 200
            assert answer.json() == {"models": ["another", "broken", "simple"]}
        ready = httpx.get(f"{server.url}/v2/models/simple/ready", headers=auth, timeout=10)
        assert ready.status_code == 200
        wrong = httpx.delete(f"{server.url}/v2/models", headers=auth, timeout=10)
        assert wrong.status_code == 405, wrong.text  # GET only, as every V2 view
    finally:
        server.stop()
