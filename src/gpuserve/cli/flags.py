"""What ``gpuserve`` says about a flag it does not know: the nearest flag it has, or, for a
``tritonserver`` flag, the ``gpuserve serve`` setting that does the same.

    gpuserve serve: unknown flag '--http-prot'; did you mean '--http-port'?
    gpuserve serve: '--log-verbose' is tritonserver's; gpuserve serve uses --log-level debug

Triton's flags that gpuserve spells the same (``--model-repository``, ``--http-port``,
``--grpc-port``, ``--metrics-port``, ``--model-control-mode``, ``--load-model``) need nothing
here: the parser takes them, in Triton's ``--flag=value`` form too.
"""

from __future__ import annotations

import argparse

from gpuserve.config.keys import nearest

#: tritonserver flags gpuserve spells differently, or has no setting for: what to use instead.
TRITON_FLAGS = {
    "--model-store": "--model-repository DIR",
    "--log-verbose": "--log-level debug (a level above 0), or --log-level info",
    "--log-info": "--log-level info (or warning to hide info messages)",
    "--log-warning": "--log-level warning",
    "--log-error": "--log-level error",
    "--log-file": "nothing: gpuserve logs to standard error (redirect it)",
    "--repository-poll-secs": "--repository-poll-interval-s S",
    "--exit-timeout-secs": "--shutdown-timeout-s S",
    "--allow-grpc": "--grpc-port -1 to turn gRPC off (it is on by default)",
    "--allow-http": "nothing: HTTP is always on (--http-port N)",
    "--allow-metrics": "--metrics-port -1 to serve /metrics on the HTTP port only",
    "--allow-gpu-metrics": "nothing: GPU metrics are on when NVML finds a GPU",
    "--allow-cpu-metrics": "nothing: process CPU and memory metrics are always on",
    "--http-address": "--host ADDRESS (one address for every listener)",
    "--grpc-address": "--host ADDRESS (one address for every listener)",
    "--metrics-address": "--host ADDRESS (one address for every listener)",
    "--exit-on-error": "nothing: a model that fails to load never stops the others; "
    "--strict-readiness keeps the server unready while a required model is not ready",
    "--backend-config": "each model's config.yaml (parameters, onnx, optimization)",
    "--backend-directory": "nothing: the backends are part of gpuserve",
    "--repoagent-directory": "nothing: gpuserve has no repository agents",
    "--pinned-memory-pool-byte-size": "nothing: gpuserve pins host buffers as it needs",
    "--cuda-memory-pool-byte-size": "nothing: the CUDA caching allocator of PyTorch is used",
    "--http-thread-count": "nothing: HTTP runs on one event loop",
    "--model-load-thread-count": "nothing: models load in parallel, each on threads of its own",
    "--id": "nothing",
    "--rate-limit": "nothing: gpuserve has no rate limiter",
    "--response-cache-byte-size": "nothing: gpuserve has no response cache",
    "--allow-sagemaker": "nothing",
    "--allow-vertex-ai": "nothing",
    "--grpc-use-ssl": "--tls-cert-file and --tls-key-file (HTTP and gRPC alike)",
    "--grpc-server-cert": "--tls-cert-file FILE",
    "--grpc-server-key": "--tls-key-file FILE",
}


def option_strings(parser: argparse.ArgumentParser) -> list[str]:
    """The long flags of ``parser`` and of its subcommands' parsers."""
    found: list[str] = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                found += option_strings(sub)
        else:
            found += [o for o in action.option_strings if o.startswith("--")]
    return found


def unknown_flag_message(command: str, parser: argparse.ArgumentParser, flag: str) -> str:
    """One line for ``flag`` (as given, maybe ``--flag=value``), which ``parser`` (that of
    ``command``, e.g. ``gpuserve serve``) does not take."""
    name = flag.split("=", 1)[0]
    if name in TRITON_FLAGS and command == "gpuserve serve":
        return f"{command}: {name!r} is tritonserver's; gpuserve serve uses {TRITON_FLAGS[name]}"
    close = nearest(name, option_strings(parser))
    hint = f"; did you mean {close!r}?" if close else f" (see {command} --help)"
    return f"{command}: unknown flag {name!r}{hint}"
