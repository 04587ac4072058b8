"""A target that POSTs ready-made bodies to one URL: any HTTP API, not only KServe V2.

``benchmarks/mixed_length.py`` drives gpuserve and PyTriton (V2 JSON) and infinity-emb
(OpenAI-style ``/embeddings``) through it, so every server gets the same load generator::

    target = RawHttpTarget("http://127.0.0.1:7997/embeddings", bodies, tokens=counts)
    levels = run_async(run_sweep(target, "concurrency", [1, 8, 32], settings))

A reply counts as a success on HTTP 200, whatever its body; the caller checks one answer's
content itself before the load.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gpuserve.bench.http_client import build_request, is_https, split_url
from gpuserve.bench.http_client import tls_context as _tls_context
from gpuserve.bench.targets import HttpSession, Outcome


class RawHttpSession(HttpSession):
    """One keep-alive connection; any reply's status is its outcome (no timing headers)."""

    def outcome(self, response: Any) -> Outcome:
        return str(response.status), -1, -1


class RawHttpTarget:
    """POST ``bodies[i % len(bodies)]`` to ``url``.

    Args:
        url: Full URL, e.g. ``http://127.0.0.1:8000/v2/models/text_embedding/infer``.
        bodies: Request bodies, encoded.
        content_type: Their ``Content-Type``.
        timeout_s: A request unanswered this long fails as ``timeout``.
        tokens: Size of each body in tokens (for tokens/s), or None.
        ca_file: PEM file for an ``https://`` URL (None: the system's CAs).

    Raises:
        ValueError: a malformed URL, no bodies, or ``tokens`` of another length.
    """

    def __init__(
        self,
        url: str,
        bodies: list[bytes],
        content_type: str = "application/json",
        timeout_s: float = 30.0,
        tokens: list[int] | None = None,
        ca_file: str | Path | None = None,
    ) -> None:
        if not bodies:
            raise ValueError("RawHttpTarget needs at least one body")
        if tokens is not None and len(tokens) != len(bodies):
            raise ValueError(f"{len(tokens)} token counts for {len(bodies)} bodies")
        self.host, self.port, path = split_url(url)
        query = url.split("?", 1)[1] if "?" in url else ""
        path = (path or "/") + (f"?{query}" if query else "")
        self.ssl = _tls_context(ca_file) if is_https(url) else None
        headers = {"Content-Type": content_type}
        self.requests = [
            build_request("POST", self.host, self.port, path, b, headers) for b in bodies
        ]
        self.samples = len(self.requests)
        self.sample_tokens = tokens
        self.timeout_s = timeout_s
        self.sessions: list[RawHttpSession] = []
        self.description = f"POST {url}"

    async def session(self) -> RawHttpSession:
        session = RawHttpSession(self)
        self.sessions.append(session)
        return session

    def check_timeouts(self, now: float) -> None:
        """Drop the connection of every request older than ``timeout_s``."""
        for session in self.sessions:
            started = session.started_s
            if started and now - started > self.timeout_s and session.conn is not None:
                session.conn.abort(TimeoutError("no answer in time"))

    async def close(self) -> None:
        for session in self.sessions:
            session.close()
        self.sessions.clear()
