"""``gpuserve export``: convert a served torch-backend model to ONNX inside the repository.

    gpuserve export --model-repository DIR MODEL [--version V] [--fp16]
                    [--to-model NAME] [--to-version N] [--opset N]

``backend`` belongs to a model (its ``config.yaml``), not to a version, so the ONNX graph
cannot become a version of the torch model itself. It becomes a version of a sibling model,
``<MODEL>_onnx`` by default (``--to-model``)::

    DIR/MODEL/config.yaml              backend: torch (left alone)
    DIR/MODEL_onnx/config.yaml         backend: onnx, same inputs/outputs/batching/instances
    DIR/MODEL_onnx/<N>/model.onnx

The first export creates the folder, its ``config.yaml`` and version 1; a later export adds
the next version (or ``--to-version N``) and leaves that ``config.yaml`` alone, so the
repository's version policy decides which export is served. An existing version folder is
never overwritten. Everything is written under a dot-named folder, which the repository scan
ignores, and renamed into place at the end.

A ``python``-backend model exports itself when its ``Model`` class defines
``export_onnx(config, version_path, folder, *, fp16, opset)``: the hook writes the new
version's files into ``folder`` (``model.onnx`` and whatever serves it, e.g. a tokenizer and a
``model.py``) and returns an object with ``config_yaml`` (of the new model, whose backend is
``python``), ``max_abs_diff`` and ``note``. The default ``text_embedding`` model has one (see
:mod:`gpuserve.models.text_embedding_onnx`): its export is a ``python`` model that tokenises
and runs the graph on ONNX Runtime.
"""

from __future__ import annotations

import argparse
import logging
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpuserve.errors import GpuserveError

logger = logging.getLogger(__name__)

#: What an export imports besides torch (the ``onnx`` extra): the graph is checked with onnx
#: and compared with the torch module on ONNX Runtime.
EXPORT_NEEDS = ("onnx", "onnxruntime")


@dataclass(slots=True)
class ExportResult:
    """What :func:`export_model` wrote.

    Attributes:
        model: The ONNX model's name (its folder in the repository).
        version: The version folder written.
        path: The ``model.onnx`` written.
        config_written: A new ``config.yaml`` was written (the model folder was new).
        source: ``<model>:<version>`` that was exported.
        max_abs_diff: Largest |ONNX Runtime - torch| on the check batch, or None.
        check_note: Why the numeric check did not run, or "".
        backend: Backend of the written model (``onnx``, or ``python`` from a model's hook).
    """

    model: str
    version: int
    path: Path
    config_written: bool
    source: str
    max_abs_diff: float | None
    check_note: str
    backend: str = "onnx"


def register(sub: Any) -> None:
    parser = sub.add_parser(
        "export",
        help="convert a torch-backend model to ONNX as a version of <MODEL>_onnx",
        description=__doc__.split("\n\n")[0],
    )
    parser.add_argument(
        "--model-repository", type=Path, required=True, help="model repository folder"
    )
    parser.add_argument(
        "model",
        help="name of a backend 'torch' model (model.py or model.pt), or of a 'python' model "
        "whose Model defines export_onnx (text_embedding)",
    )
    parser.add_argument(
        "--version", type=int, help="version to export (default: the highest one served)"
    )
    parser.add_argument(
        "--fp16",
        action="store_true",
        help="half-precision weights and compute; inputs/outputs keep their datatypes",
    )
    parser.add_argument("--to-model", help="name of the ONNX model (default: <MODEL>_onnx)")
    parser.add_argument(
        "--to-version", type=int, help="version folder to write (default: the next free one)"
    )
    parser.add_argument("--opset", type=int, default=17, help="ONNX opset, 17 or later")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        result = export_model(
            args.model_repository,
            args.model,
            version=args.version,
            fp16=args.fp16,
            to_model=args.to_model,
            to_version=args.to_version,
            opset=args.opset,
        )
    except GpuserveError as err:
        print(f"gpuserve export: {err.message}", file=sys.stderr)
        return 1
    except ImportError as err:  # a package the exporter imports deep inside
        from gpuserve.backends.optional import missing_dependency

        missing = missing_dependency(err, "exporting to ONNX")
        if missing is None:
            raise
        print(f"gpuserve export: {missing.message}", file=sys.stderr)
        return 1
    print(f"exported {result.source} to {result.path}")
    if result.config_written:
        print(f"wrote {result.path.parent.parent / 'config.yaml'} (backend {result.backend})")
    if result.max_abs_diff is not None:
        print(f"check: max |onnxruntime - torch| = {result.max_abs_diff:.3g}")
    else:
        print(f"check skipped: {result.check_note}")
    return 0


def export_model(
    repository: Path,
    model: str,
    *,
    version: int | None = None,
    fp16: bool = False,
    to_model: str | None = None,
    to_version: int | None = None,
    opset: int = 17,
) -> ExportResult:
    """Export ``model`` (backend torch) as a version of ``to_model`` (backend onnx).

    Args:
        repository: The model repository folder.
        model: The torch-backend model.
        version: Its version to export; default the highest one its version policy selects.
        fp16: Half-precision weights and compute, declared datatypes at the boundary.
        to_model: The ONNX model's name; default ``<model>_onnx``.
        to_version: The version to write; default the next free number (1 for a new model).
        opset: ONNX opset, at least 17.

    Raises:
        MissingDependencyError: onnx or onnxruntime is not installed (the ``onnx`` extra).
        ConfigError: unknown model or version, not a torch model, a target that is not an
            onnx model, an existing version folder, a model that cannot be exported.
        BackendError: the exported graph disagrees with the torch module (fp32).
    """
    from gpuserve.backends.optional import require

    # Before anything is loaded: without them torch's exporter fails deep inside with a
    # long traceback; this says which extra to install (issue 19).
    for module in EXPORT_NEEDS:
        require(module, "exporting to ONNX")
    from gpuserve.backends.onnx_export import export_version, exported_config_yaml
    from gpuserve.config import CONFIG_FILENAME, load_model_config
    from gpuserve.errors import ConfigError
    from gpuserve.repository.scan import scan_model, version_folders

    source_dir = repository / model
    if not (source_dir / CONFIG_FILENAME).is_file():
        raise ConfigError(f"no model '{model}' in {repository} (no {source_dir / CONFIG_FILENAME})")
    entry = scan_model(source_dir)
    if entry.config is None:
        raise ConfigError(f"cannot export model '{model}': {entry.error}")
    if version is None:
        if not entry.versions:
            raise ConfigError(f"cannot export model '{model}': {entry.error}")
        version = entry.versions[-1]
    elif version not in entry.available:
        raise ConfigError(f"model '{model}' has no version {version} (it has {entry.available})")

    hook = _python_export_hook(entry.config, source_dir / str(version), version)
    target_backend = "python" if hook is not None else "onnx"
    target_name = to_model or f"{model}_onnx"
    target = repository / target_name
    new_model = not target.exists()
    if not new_model:
        existing = load_model_config(target / CONFIG_FILENAME)
        if existing.backend != target_backend:
            raise ConfigError(
                f"{target / CONFIG_FILENAME}: backend is '{existing.backend}', not "
                f"'{target_backend}'; choose another --to-model"
            )
    taken = [] if new_model else version_folders(target)
    new_version = to_version if to_version is not None else max(taken, default=0) + 1
    if new_version < 1:
        raise ConfigError(f"--to-version must be a positive integer, got {new_version}")
    if (target / str(new_version)).exists():
        raise ConfigError(f"{target / str(new_version)} exists; choose another --to-version")

    staging = repository / f".{target_name}.export-{new_version}.tmp"
    shutil.rmtree(staging, ignore_errors=True)
    onnx_path = staging / str(new_version) / "model.onnx"
    onnx_path.parent.mkdir(parents=True)
    try:
        if hook is not None:
            written = hook(
                entry.config, source_dir / str(version), onnx_path.parent, fp16=fp16, opset=opset
            )
            text, diff, note = written.config_yaml, written.max_abs_diff, written.note
        else:
            check = export_version(
                entry.config, source_dir / str(version), version, onnx_path, fp16=fp16, opset=opset
            )
            text = exported_config_yaml(entry.config, f"{model}:{version}", fp16)
            diff, note = check.max_abs_diff, check.note
        if new_model:
            (staging / CONFIG_FILENAME).write_text(text, encoding="utf-8")
            staging.rename(target)
        else:
            (staging / str(new_version)).rename(target / str(new_version))
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    final = target / str(new_version) / "model.onnx"
    logger.info("exported %s:%d to %s (fp16: %s)", model, version, final, fp16)
    return ExportResult(
        model=target_name,
        version=new_version,
        path=final,
        config_written=new_model,
        source=f"{model}:{version}",
        max_abs_diff=diff,
        check_note=note,
        backend=target_backend,
    )


def _python_export_hook(config: Any, version_path: Path, version: int) -> Any:
    """The ``Model.export_onnx`` hook of a python-backend version; None for other backends.

    Raises:
        ConfigError: a python model without the hook (or a model.py that fails to import).
    """
    if config.backend != "python":
        return None
    from gpuserve.backends.loader import import_module_from_path
    from gpuserve.errors import ConfigError

    module = import_module_from_path(version_path / "model.py", config.name or "model", version)
    hook = getattr(getattr(module, "Model", None), "export_onnx", None)
    if hook is None:
        raise ConfigError(
            f"model '{config.name}' has backend 'python'; export converts backend 'torch' "
            "models (model.py or model.pt), and python models whose Model defines export_onnx"
        )
    return hook
