"""The ``gpuserve`` command line: one module per subcommand, each with ``register(subparsers)``.

    gpuserve --version
    gpuserve serve [--model-repository DIR] [--host H] [--http-port N] [--log-level L]
    gpuserve bench --model M [--concurrency 1:64:x2 | --request-rate R] [--protocol grpc]
    gpuserve tune --model M --latency-budget-ms 100 [--output DIR]

Each subcommand module adds its parser and sets ``func`` (a callable taking the parsed
arguments and returning the exit code). With no subcommand, ``serve`` runs.
"""

from __future__ import annotations

import argparse
import importlib
import sys

#: Subcommand modules under gpuserve.cli, in help order.
SUBCOMMANDS = ["serve", "export", "bench", "tune", "models"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gpuserve", description="GPU inference server (KServe V2 protocol)"
    )
    parser.add_argument("--version", action="version", version=f"gpuserve {version()}")
    sub = parser.add_subparsers(dest="command")
    for name in SUBCOMMANDS:
        try:
            module = importlib.import_module(f"gpuserve.cli.{name}")
        except ModuleNotFoundError as err:
            if err.name == f"gpuserve.cli.{name}":
                continue
            raise
        module.register(sub)
    return parser


def version() -> str:
    """The installed distribution's version (the package's own when not installed)."""
    from importlib import metadata

    try:
        return metadata.version("gpuserve")
    except metadata.PackageNotFoundError:
        from gpuserve import __version__

        return __version__


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``gpuserve`` script; returns the process exit code."""
    parser = build_parser()
    given = list(sys.argv[1:] if argv is None else argv)
    if given and given[0].startswith("-") and given[0] not in ("-h", "--help", "--version"):
        given.insert(0, "serve")  # `gpuserve --model-repository DIR` serves, as `gpuserve` does
    args = parser.parse_args(given)
    if args.command is None:
        args = parser.parse_args(["serve", *given])
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
