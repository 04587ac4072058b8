"""HTTP content codings (RFC 9110 §8.4): compressed request bodies and compressed answers.

* A request body with ``Content-Encoding: gzip`` or ``deflate`` (zlib; a raw deflate stream is
  accepted too, as some clients send one) is decompressed before the request is handled, so
  every endpoint sees the plain body; ``identity`` is the same as none. Any other coding gets
  415 Unsupported Media Type naming the codings supported. Decompression stops as soon as the
  output would pass the body limit (413): a small "zip bomb" never expands in memory. A body
  that is not valid in its declared coding gets 400.
* ``Accept-Encoding`` picks the answer's coding: ``gzip`` if acceptable (q > 0), else
  ``deflate``, else none; the answer then carries ``Content-Encoding`` and ``Vary:
  Accept-Encoding``. Answers shorter than :data:`MIN_COMPRESS_BYTES` go uncompressed (the
  coding would make them longer), which the header allows: a client that asks still reads
  ``Content-Encoding`` to know.

Triton's HTTP client uses both (``request_compression_algorithm``,
``response_compression_algorithm``); with the binary tensor extension
``Inference-Header-Content-Length`` counts the uncompressed JSON, which is what the handler
sees.
"""

from __future__ import annotations

import zlib

#: Answers shorter than this are sent uncompressed, whatever the client accepts (bytes).
MIN_COMPRESS_BYTES = 512
#: zlib level for answers: fast, most of the gain on JSON tensors.
_LEVEL = 1
_SUPPORTED = ("gzip", "deflate", "identity")


class BodyRefused(Exception):
    """A body that cannot be decoded: answer ``status`` (400, 413 or 415) with ``message``."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def decode_body(coding: bytes, body: bytes | bytearray, limit: int) -> bytes | bytearray:
    """``body`` without its content coding(s), applied last-first as the header lists them.

    Args:
        coding: The ``Content-Encoding`` header value, e.g. ``b"gzip"``.
        body: The body as received.
        limit: Most bytes the decoded body may have (``max_request_body_bytes``).

    Raises:
        BodyRefused: 415 for an unsupported coding, 413 past ``limit``, 400 for bad data.
    """
    names = [part.strip().lower() for part in coding.decode("latin-1").split(",")]
    for name in reversed([n for n in names if n]):
        if name == "identity":
            continue
        if name in ("gzip", "x-gzip"):
            body = _inflate(body, 16 + zlib.MAX_WBITS, limit, "gzip")
        elif name == "deflate":
            try:
                body = _inflate(body, zlib.MAX_WBITS, limit, "deflate")
            except BodyRefused as err:
                if err.status != 400:
                    raise
                body = _inflate(body, -zlib.MAX_WBITS, limit, "deflate")  # raw deflate
        else:
            raise BodyRefused(
                415,
                f"Content-Encoding {name!r} is not supported; send the body as "
                f"{', '.join(_SUPPORTED)}",
            )
    return body


def _inflate(data: bytes | bytearray, wbits: int, limit: int, name: str) -> bytes:
    inflater = zlib.decompressobj(wbits)
    try:
        out = inflater.decompress(data, limit + 1)
        if len(out) > limit or inflater.unconsumed_tail:
            raise BodyRefused(
                413,
                f"request body exceeds the limit of {limit} bytes once decompressed "
                "(max_request_body_bytes)",
            )
        out += inflater.flush()
    except zlib.error as err:
        raise BodyRefused(400, f"request body is not valid {name} data: {err}") from None
    if not inflater.eof:
        raise BodyRefused(400, f"request body is not valid {name} data: it is cut short")
    if len(out) > limit:
        raise BodyRefused(
            413,
            f"request body exceeds the limit of {limit} bytes once decompressed "
            "(max_request_body_bytes)",
        )
    return out


def answer_coding(accept: bytes) -> bytes | None:
    """The coding to answer with for an ``Accept-Encoding`` value: ``b"gzip"``,
    ``b"deflate"`` or None (identity)."""
    weights: dict[str, float] = {}
    for part in accept.decode("latin-1").split(","):
        name, _, params = part.strip().partition(";")
        quality = 1.0
        params = params.strip().lower()
        if params.startswith("q="):
            try:
                quality = float(params[2:])
            except ValueError:
                quality = 0.0
        weights[name.strip().lower()] = quality
    star = weights.get("*", 0.0)
    for name in ("gzip", "deflate"):
        if weights.get(name, star) > 0:
            return name.encode()
    return None


def encode_body(coding: bytes, body: bytes) -> bytes:
    """``body`` compressed with ``coding`` (``b"gzip"`` or ``b"deflate"``, zlib format)."""
    wbits = 16 + zlib.MAX_WBITS if coding == b"gzip" else zlib.MAX_WBITS
    compressor = zlib.compressobj(_LEVEL, zlib.DEFLATED, wbits)
    return compressor.compress(body) + compressor.flush()
