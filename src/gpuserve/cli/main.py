"""The ``gpuserve`` command line.

    gpuserve serve [--model-repository DIR] [--host H] [--http-port N] [--log-level L]

Each flag can also be set through the environment (``GPUSERVE_MODEL_REPOSITORY``,
``GPUSERVE_HOST``, ``GPUSERVE_HTTP_PORT``, ``GPUSERVE_LOG_LEVEL``); a flag wins over the
environment. With no flags the embedded default repository is served on port 8000.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pydantic import ValidationError


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gpuserve", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command")
    serve = sub.add_parser("serve", help="serve a model repository over KServe V2 HTTP")
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
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``gpuserve`` script; returns the process exit code."""
    args = _parser().parse_args(argv)
    if args.command in (None, "serve"):
        return _serve(args)
    return 2


def _serve(args: argparse.Namespace) -> int:
    from gpuserve.config import ServerConfig
    from gpuserve.server.runner import GpuServer, configure_logging

    overrides = {
        key: value
        for key, value in {
            "model_repository": getattr(args, "model_repository", None),
            "host": getattr(args, "host", None),
            "http_port": getattr(args, "http_port", None),
            "log_level": getattr(args, "log_level", None),
            "shutdown_timeout_s": getattr(args, "shutdown_timeout_s", None),
        }.items()
        if value is not None
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


if __name__ == "__main__":
    sys.exit(main())
