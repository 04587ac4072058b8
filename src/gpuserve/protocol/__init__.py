"""Wire codecs of the KServe V2 Open Inference Protocol.

:mod:`~gpuserve.protocol.http_codec` turns HTTP bodies into validated
:class:`~gpuserve.engine.request.InferenceRequest` objects and responses back into bytes;
:mod:`~gpuserve.protocol.tensors` holds the per-tensor validation shared with the gRPC codec;
:mod:`~gpuserve.protocol.binary` the BYTES wire format.

The names below are imported lazily: :mod:`gpuserve.config` imports
:mod:`gpuserve.datatypes`, and the codecs need the config types, so an eager import
here would be circular.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gpuserve.protocol.http_codec import (
        BINARY_CONTENT_TYPE,
        HEADER_LENGTH_HEADER,
        JSON_CONTENT_TYPE,
        DecodedRequest,
        EncodedResponse,
        OutputOptions,
        decode_infer_request,
        encode_infer_response,
        parse_header_length,
    )
    from gpuserve.protocol.tensors import (
        array_from_json,
        array_from_raw,
        build_input,
        check_datatype,
        check_shape,
        element_count,
        validate_request_shapes,
    )

_EXPORTS = {
    "BINARY_CONTENT_TYPE": "http_codec",
    "HEADER_LENGTH_HEADER": "http_codec",
    "JSON_CONTENT_TYPE": "http_codec",
    "DecodedRequest": "http_codec",
    "EncodedResponse": "http_codec",
    "OutputOptions": "http_codec",
    "decode_infer_request": "http_codec",
    "encode_infer_response": "http_codec",
    "parse_header_length": "http_codec",
    "array_from_json": "tensors",
    "array_from_raw": "tensors",
    "build_input": "tensors",
    "check_datatype": "tensors",
    "check_shape": "tensors",
    "element_count": "tensors",
    "validate_request_shapes": "tensors",
}

__all__ = [
    "BINARY_CONTENT_TYPE",
    "HEADER_LENGTH_HEADER",
    "JSON_CONTENT_TYPE",
    "DecodedRequest",
    "EncodedResponse",
    "OutputOptions",
    "array_from_json",
    "array_from_raw",
    "build_input",
    "check_datatype",
    "check_shape",
    "decode_infer_request",
    "element_count",
    "encode_infer_response",
    "parse_header_length",
    "validate_request_shapes",
]


def __getattr__(name: str) -> Any:
    """One of ``__all__``, imported from its module on first use and cached in this module.

    Raises:
        AttributeError: ``name`` is not one of this package's exports.
    """
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value
