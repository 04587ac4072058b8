"""``gpuserve serve``: run the server on a model repository.

Each flag can also be set through the environment (``GPUSERVE_MODEL_REPOSITORY``,
``GPUSERVE_HOST``, ``GPUSERVE_HTTP_PORT``, ``GPUSERVE_LOG_LEVEL``, ...); a flag wins over the
environment. With no flags the embedded default repository is served on port 8000.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from pydantic import ValidationError

#: flag destination -> ServerConfig field (same names); None values are not overrides.
SERVE_FIELDS = ["model_repository", "host", "http_port", "log_level", "shutdown_timeout_s"]


def register(sub: Any) -> None:
    serve = sub.add_parser("serve", help="serve a model repository over KServe V2")
    serve.add_argument(
        "--model-repository",
        type=Path,
        help="model repository folder "
        "(default: the embedded repository with text_embedding and simple)",
    )
    serve.add_argument("--host", help="bind address (default 0.0.0.0)")
    serve.add_argument("--http-port", type=int, help="HTTP port (default 8000)")
    serve.add_argument("--log-level", choices=["debug", "info", "warning", "error"])
    serve.add_argument(
        "--shutdown-timeout-s",
        type=float,
        help="seconds in-flight requests may take to finish on SIGTERM (default 30)",
    )
    serve.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from gpuserve.config import ServerConfig
    from gpuserve.server.runner import GpuServer, configure_logging

    overrides = {
        name: getattr(args, name) for name in SERVE_FIELDS if getattr(args, name, None) is not None
    }
    try:
        config = ServerConfig(**overrides)
    except ValidationError as err:
        for item in err.errors():
            field = ".".join(str(p) for p in item["loc"])
            print(
                f"gpuserve: invalid setting {field}: {item['msg']} (given: {item.get('input')!r})",
                file=sys.stderr,
            )
        return 2
    configure_logging(config.log_level)
    GpuServer(config).run()
    return 0
