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
    args, unknown = parser.parse_known_args(given)
    if args.command is None:
        args, unknown = parser.parse_known_args(["serve", *given])
    if unknown:
        return _refuse(parser, args, unknown)
    return int(args.func(args))


def _refuse(parser: argparse.ArgumentParser, args: argparse.Namespace, unknown: list[str]) -> int:
    """Name each argument the command does not take (exit status 2, as argparse's errors):
    the nearest flag it has, or for a tritonserver flag the gpuserve setting to use."""
    from gpuserve.cli.flags import unknown_flag_message

    command = subcommand_parser(parser, args.command)
    name = f"gpuserve {args.command}"
    after_flag = False
    for argument in unknown:
        if argument.startswith("--"):
            print(unknown_flag_message(name, command, argument), file=sys.stderr)
            after_flag = "=" not in argument
        elif after_flag:  # the unknown flag's value
            after_flag = False
        else:
            print(f"{name}: unexpected argument {argument!r} (see {name} --help)", file=sys.stderr)
    return 2


def subcommand_parser(parser: argparse.ArgumentParser, command: str) -> argparse.ArgumentParser:
    """The parser of subcommand ``command`` (``serve``, ``models``, ...)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices[command]
    raise KeyError(command)


if __name__ == "__main__":
    sys.exit(main())
