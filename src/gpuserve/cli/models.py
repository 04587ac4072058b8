"""``gpuserve models``: look at a model repository, and manage the models of a running server.

    gpuserve models list [--url URL | --model-repository DIR] [--json]
    gpuserve models validate --model-repository DIR
    gpuserve models init DIR
    gpuserve models load MODEL [--config FILE] [--url URL]
    gpuserve models unload MODEL [--url URL]
    gpuserve models rollback MODEL [--url URL]
    gpuserve models canary MODEL --version N --weight W [--url URL]
    gpuserve models promote MODEL [--url URL]
    gpuserve models abort MODEL [--url URL]
    gpuserve models trace MODEL [--batches N] [--url URL]
    gpuserve models accuracy MODEL --precision P [--model-repository DIR] [--texts FILE]

Server calls go to the HTTP repository API (``--url``, default ``$GPUSERVE_URL`` or
``http://localhost:8000``) with ``--token`` (default ``$GPUSERVE_MANAGEMENT_TOKEN``) as the
bearer token. Exit status: 0 done, 1 the server refused or the repository has errors, 2 the
server could not be reached.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

_DEFAULT_URL = "http://localhost:8000"
_ACTIONS = {
    "load": "load",
    "unload": "unload",
    "rollback": "rollback",
    "canary": "canary",
    "promote": "canary/promote",
    "abort": "canary/abort",
    "trace": "trace",
}


def register(sub: Any) -> None:
    models = sub.add_parser("models", help="list, validate, load, unload and roll back models")
    actions = models.add_subparsers(dest="models_command", required=True)

    listing = actions.add_parser("list", help="models and versions of a server or a repository")
    _server_flags(listing)
    listing.add_argument(
        "--model-repository", type=Path, help="read this repository instead of asking a server"
    )
    listing.add_argument("--json", action="store_true", help="print JSON")
    listing.set_defaults(func=_list)

    validate = actions.add_parser(
        "validate", help="report every configuration error of every model (exit 1 if any)"
    )
    validate.add_argument(
        "--model-repository", type=Path, required=True, help="the repository folder to check"
    )
    validate.add_argument(
        "--no-model-files",
        action="store_true",
        help="skip the backend's check of each model file against its config, and the trial "
        "load with one request of zeros",
    )
    validate.set_defaults(func=_validate)

    init = actions.add_parser(
        "init",
        help="copy the embedded repository (text_embedding, simple) into a folder, to start "
        "a repository of your own",
    )
    init.add_argument("folder", type=Path, help="the new repository (created if missing)")
    init.set_defaults(func=_init)

    accuracy = actions.add_parser(
        "accuracy",
        help="a text model's embeddings at a precision against fp32 on held-out sentences "
        "(cosine min/mean, max abs error, recall@10), in-process",
    )
    accuracy.add_argument("model", help="the model (a folder of the repository)")
    accuracy.add_argument(
        "--precision",
        required=True,
        help="one or more of fp16, bf16, int8 (comma-separated), each measured against fp32",
    )
    accuracy.add_argument(
        "--model-repository", type=Path, help="the repository (default: the embedded one)"
    )
    accuracy.add_argument(
        "--texts", type=Path, help="held-out texts, one a line (default: the built-in sentences)"
    )
    accuracy.add_argument("--device", default="cpu", help="cpu (default) or cuda:N")
    accuracy.add_argument("--neighbours", type=int, default=10, help="k of recall@k (default 10)")
    accuracy.add_argument("--json", action="store_true", help="print JSON")
    accuracy.set_defaults(func=_accuracy)

    helps = {
        "load": "load a model, or apply repository changes to it (explicit mode)",
        "unload": "drain and unload a model (explicit mode)",
        "rollback": "serve the previous version again",
        "canary": "send a share of the traffic to a version",
        "promote": "make the canary the default version",
        "abort": "end the canary",
        "trace": "torch.profiler trace of the next batches (written to the server's trace_dir)",
    }
    for action, text in helps.items():
        parser = actions.add_parser(action, help=text)
        parser.add_argument("model", help="the model's name (its folder in the repository)")
        _server_flags(parser)
        if action == "load":
            parser.add_argument(
                "--config",
                type=Path,
                help="load with this configuration (YAML or JSON file) instead of config.yaml",
            )
        if action == "canary":
            parser.add_argument("--version", type=int, required=True, help="the canary version")
            parser.add_argument("--weight", type=float, required=True, help="share 0..1")
        if action == "trace":
            parser.add_argument("--batches", type=int, default=1, help="batches to trace")
        parser.set_defaults(func=_manage, action=action)


def _server_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--url",
        default=os.environ.get("GPUSERVE_URL", _DEFAULT_URL),
        help=f"server HTTP address (default $GPUSERVE_URL or {_DEFAULT_URL})",
    )
    parser.add_argument(
        "--token",
        default=os.environ.get("GPUSERVE_MANAGEMENT_TOKEN"),
        help="management bearer token (default $GPUSERVE_MANAGEMENT_TOKEN)",
    )
    parser.add_argument(
        "--timeout-s", type=float, default=600.0, help="how long to wait for the server"
    )


class _Unreachable(Exception):
    pass


def _post(args: argparse.Namespace, path: str, body: dict[str, Any] | None = None) -> Any:
    """POST JSON to the server; returns (status, decoded body)."""
    url = args.url.rstrip("/")
    if "://" not in url:
        url = f"http://{url}"
    data = json.dumps(body or {}).encode()
    headers = {"content-type": "application/json"}
    if args.token:
        headers["authorization"] = f"Bearer {args.token}"
    request = urllib.request.Request(url + path, data=data, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=args.timeout_s) as response:
            return response.status, json.loads(response.read() or b"null")
    except urllib.error.HTTPError as err:
        text = err.read()
        try:
            payload = json.loads(text)
        except ValueError:
            payload = {"error": text.decode(errors="replace")}
        return err.code, payload
    except (urllib.error.URLError, OSError) as err:
        reason = getattr(err, "reason", err)
        raise _Unreachable(f"cannot reach {url}: {reason}") from None


def _manage(args: argparse.Namespace) -> int:
    body: dict[str, Any] = {}
    if args.action == "load" and args.config is not None:
        try:
            config = _read_config(args.config)
        except (OSError, ValueError) as err:
            print(f"gpuserve models load: {args.config}: {err}", file=sys.stderr)
            return 1
        body = {"parameters": {"config": json.dumps(config)}}
    if args.action == "canary":
        body = {"version": args.version, "weight": args.weight}
    if args.action == "trace":
        body = {"batches": args.batches}
    path = f"/v2/repository/models/{args.model}/{_ACTIONS[args.action]}"
    try:
        status, payload = _post(args, path, body)
    except _Unreachable as err:
        print(f"gpuserve models {args.action}: {err}", file=sys.stderr)
        return 2
    if status != 200:
        message = payload.get("error") if isinstance(payload, dict) else payload
        print(f"gpuserve models {args.action} {args.model}: {status}: {message}", file=sys.stderr)
        return 1
    if args.action == "trace":
        print(
            f"tracing {payload['batches']} batch(es) of {payload['model']} version "
            f"{payload['version']} into <trace_dir>/{payload['trace']}"
        )
        return 0
    _print_status(payload)
    return 0


def _read_config(path: Path) -> Any:
    import yaml

    value = yaml.safe_load(path.read_text(encoding="utf-8"))  # JSON is YAML too
    if not isinstance(value, dict):
        raise ValueError("the configuration must be a mapping")
    return value


def _print_status(status: dict[str, Any]) -> None:
    canary = status.get("canary")
    line = f"{status['name']}: serving version {status.get('served_version') or '-'}"
    if canary:
        line += f", canary version {canary['version']} at {canary['weight']:.1%}"
    if status.get("held_back"):
        line += f", held back: {', '.join(status['held_back'])}"
    print(line)
    _print_rows(status.get("versions", []))


def _print_rows(rows: list[dict[str, Any]]) -> None:
    table = [("MODEL", "VERSION", "STATE", "TRAFFIC", "REASON")]
    for row in rows:
        traffic = row.get("traffic")
        table.append(
            (
                row["name"],
                row.get("version") or "-",
                row.get("state") or "-",
                f"{traffic:.1%}" if isinstance(traffic, (int, float)) else "",
                row.get("reason") or "",
            )
        )
    widths = [max(len(r[i]) for r in table) for i in range(4)]
    for r in table:
        print("  ".join(c.ljust(w) for c, w in zip(r[:4], widths, strict=True)) + "  " + r[4])


def _list(args: argparse.Namespace) -> int:
    if args.model_repository is not None:
        return _list_repository(args.model_repository, args.json)
    try:
        status, rows = _post(args, "/v2/repository/index")
    except _Unreachable as err:
        print(f"gpuserve models list: {err}", file=sys.stderr)
        return 2
    if status != 200:
        print(f"gpuserve models list: {status}: {rows}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        _print_rows(rows)
    return 0


def _list_repository(root: Path, as_json: bool) -> int:
    from gpuserve.errors import ConfigError
    from gpuserve.repository.scan import scan_repository

    try:
        entries = scan_repository(root)
    except ConfigError as err:
        print(f"gpuserve models list: {err}", file=sys.stderr)
        return 1
    rows = []
    for entry in entries:
        versions: list[int | None] = list(entry.available) or [None]
        for version in versions:
            folder = entry.folders.get(version) if version is not None else None
            if entry.error and (version is None or not entry.versions):
                state, reason = "INVALID", entry.error
            elif folder is not None and folder.problem:
                state, reason = "INCOMPLETE", folder.problem
            elif version in entry.versions:
                state, reason = "SELECTED", ""
            else:
                state, reason = "NOT_SELECTED", "not selected by the version policy"
            rows.append(
                {
                    "name": entry.name,
                    "version": str(version) if version is not None else "",
                    "state": state,
                    "reason": reason.splitlines()[0] if reason else "",
                    "backend": entry.config.backend if entry.config else "",
                }
            )
    if as_json:
        print(json.dumps(rows, indent=2))
    else:
        _print_rows(rows)
    return 0


def _validate(args: argparse.Namespace) -> int:
    from gpuserve.errors import ConfigError
    from gpuserve.repository.scan import scan_repository, validate_repository

    root: Path = args.model_repository
    try:
        problems = validate_repository(root, check_model_files=not args.no_model_files)
        count = len(scan_repository(root))
    except ConfigError as err:
        print(f"gpuserve models validate: {err}", file=sys.stderr)
        return 1
    for problem in problems:
        print(problem)
    if problems:
        print(f"{len(problems)} problem(s) in {count} model(s) of {root}", file=sys.stderr)
        return 1
    print(f"{root}: {count} model(s), no problems")
    return 0


def _init(args: argparse.Namespace) -> int:
    import shutil

    from gpuserve.config import default_model_repository

    source = default_model_repository()
    target: Path = args.folder
    names = sorted(p.name for p in source.iterdir() if p.is_dir() and not p.name.startswith("_"))
    taken = [name for name in names if (target / name).exists()]
    if taken:
        print(
            f"gpuserve models init: {target} already has {', '.join(taken)}; nothing copied",
            file=sys.stderr,
        )
        return 1
    target.mkdir(parents=True, exist_ok=True)
    for name in names:
        shutil.copytree(
            source / name, target / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc")
        )
    print(f"{target}: {', '.join(names)} (serve it: gpuserve serve --model-repository {target})")
    return 0


def _accuracy(args: argparse.Namespace) -> int:
    from gpuserve.bench.accuracy import heldout_texts, measure_accuracy
    from gpuserve.config import default_model_repository
    from gpuserve.errors import ConfigError

    repository = args.model_repository or default_model_repository()
    model_dir = repository / args.model
    precisions = [p.strip() for p in args.precision.split(",") if p.strip()]
    known = ("fp32", "fp16", "bf16", "int8")
    bad = [p for p in precisions if p not in known]
    if not precisions or bad:
        print(
            f"gpuserve models accuracy: --precision {args.precision!r}; expected one or more "
            f"of {', '.join(known)}",
            file=sys.stderr,
        )
        return 2
    if not (model_dir / "config.yaml").is_file():
        print(f"gpuserve models accuracy: no model {args.model!r} in {repository}", file=sys.stderr)
        return 1
    try:
        texts = heldout_texts(args.texts)
        reports = measure_accuracy(model_dir, precisions, texts, args.device, args.neighbours)
    except (ConfigError, ValueError) as err:  # a load refused: the message names why
        print(f"gpuserve models accuracy: {err}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps([r.as_dict() for r in reports], indent=2))
        return 0
    source = args.texts or "built-in held-out sentences"
    print(f"{args.model} against fp32 on {len(texts)} texts ({source}), {args.device}:")
    print("| precision | cosine min | cosine mean | max abs error | recall@k |")
    print("|---|---|---|---|---|")
    for r in reports:
        print(
            f"| {r.precision} | {r.cosine_min:.4f} | {r.cosine_mean:.4f} | "
            f"{r.max_abs_error:.4f} | {r.recall_at_k:.3f} (k={r.k}) |"
        )
    return 0
