"""A sequence-classification graph (a cross-encoder, a classifier) in ONNX, served on text.

ONNX has no tokenizer, so the served model composes the two stages as the ONNX
``text_embedding`` does (:mod:`gpuserve.models.text_embedding_onnx`): backend ``python`` with
``model.py`` = :class:`OnnxTextPairs`, which tokenises texts or text pairs in the CPU stage
(``tokenizer.json`` beside the graph; a pair is truncated as
:mod:`gpuserve.backends.hf_text` describes, the query kept whole where it fits) and runs
``model.onnx`` with the ``onnx`` backend itself (its execution providers, session options
and I/O binding). The version folder holds::

    1/model.onnx        inputs input_ids, attention_mask (and token_type_ids when the model
                        has them) int64 [batch, sequence]; output logits float32 [batch, n]
    1/tokenizer.json    the model's fast tokenizer
    1/model.py          from gpuserve.models.text_pairs_onnx import OnnxTextPairs as Model

and ``config.yaml`` declares ``TEXT`` BYTES [1], ``TEXT_PAIR`` BYTES [1] (optional) and one
FP32 output of the logits, with a ``rerank`` or ``classification`` section. Parameters:
``max_seq_len``, tokens per text or pair (default 512).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from functools import partial
from typing import Any

import numpy as np

from gpuserve.backends import hf_text
from gpuserve.backends.base import Admitted, LoadContext, Token
from gpuserve.backends.python import PythonModel
from gpuserve.errors import ConfigError
from gpuserve.text.decode import decode_texts
from gpuserve.text.truncation import PrefixTruncator, bounded_texts

TOKENIZER_FILENAME = "tokenizer.json"
GRAPH_OUTPUT = "logits"


class OnnxTextPairs(PythonModel):
    """Tokenise texts or pairs (CPU) -> ``model.onnx`` on the ``onnx`` backend -> logits."""

    def load(self, context: LoadContext) -> None:
        from tokenizers import Tokenizer

        from gpuserve.backends.onnx_backend import OnnxBackend

        config = context.config
        params = {**config.parameters, **context.parameters}
        self.max_length = int(params.get("max_seq_len", 512))
        path = context.version_path / TOKENIZER_FILENAME
        if not path.is_file():
            raise ConfigError(f"{path}: no tokenizer.json beside model.onnx")
        base = Tokenizer.from_file(str(path))
        base.no_padding()
        base.no_truncation()
        self.truncator = PrefixTruncator(base, self.max_length)  # its own copy
        self.pair_specials = int(base.num_special_tokens_to_add(True))
        self.tokenizers = {}
        for strategy in ("only_second", "longest_first"):
            own = Tokenizer.from_str(base.to_str())
            own.enable_truncation(self.max_length, strategy=strategy)
            self.tokenizers[strategy] = own
        self.plain = Tokenizer.from_str(base.to_str())
        self.plain.enable_truncation(self.max_length)
        self.pad_id = int((base.padding or {}).get("pad_id", 0))
        self.text_input = config.inputs[0].name
        self.pair_input = config.inputs[1].name if len(config.inputs) > 1 else None
        self.output = config.outputs[0].name
        graph_config = config.model_copy(  # the graph's own tensors, from model.onnx
            update={
                "backend": "onnx",
                "inputs": [],
                "outputs": [],
                **dict.fromkeys(("rerank", "classification", "sparse", "embedding")),
            }
        )
        graph_config = OnnxBackend.complete_config(graph_config, context.version_path)
        self.feeds = [t.name for t in graph_config.inputs]
        self.graph_output = next(
            (t.name for t in graph_config.outputs if t.name == GRAPH_OUTPUT),
            graph_config.outputs[0].name,
        )
        self.graph = OnnxBackend()
        # the graph's own config; the graph calls no other model
        self.graph.load(replace(context, config=graph_config, caller=None))
        self._admit = (
            partial(
                hf_text.admit_pairs,
                self.truncator,
                self.pair_specials,
                False,
                name=self.text_input,
                pair_name=self.pair_input,
            )
            if self.pair_input is not None
            else None
        )

    def warmup(self) -> None:
        text = np.array([[b"gpuserve warms up the model."]], dtype=object)
        inputs = {self.text_input: text}
        if self.pair_input is not None:
            inputs[self.pair_input] = text
        self.postprocess(self.forward(self.preprocess(inputs)))

    def admit(self, inputs: dict[str, np.ndarray]) -> Admitted:
        """Admission step: tokens per row (pairs counted as pairs), long texts cut before
        tokenisation (:mod:`gpuserve.backends.hf_text`)."""
        from gpuserve.backends.text_admission import admit_texts

        if self._admit is not None:
            return self._admit(inputs)
        return admit_texts(self.truncator, inputs, self.text_input)

    def tokenize(self, texts: Sequence[str], add_special_tokens: bool) -> list[list[Token]]:
        """The tokens of each text, untruncated (TEI's ``/tokenize``; thread-safe)."""
        return hf_text.tokenize(self.truncator.tokenizer, list(texts), add_special_tokens)

    def preprocess(self, inputs: dict[str, np.ndarray]) -> Any:
        """TEXT (and TEXT_PAIR) BYTES [B, 1] -> the graph's int64 [B, L] feeds."""
        firsts = bounded_texts(self.truncator, decode_texts(inputs[self.text_input]))
        encodings: list[Any]
        if self.pair_input is None or self.pair_input not in inputs:
            encodings = self.plain.encode_batch(firsts)
        else:
            seconds = bounded_texts(self.truncator, decode_texts(inputs[self.pair_input]))
            heads = self.plain.encode_batch(firsts, add_special_tokens=False)
            encodings = [None] * len(firsts)
            fits = [len(h.ids) + self.pair_specials < self.max_length for h in heads]
            for strategy, chosen in (("only_second", True), ("longest_first", False)):
                rows = [i for i, f in enumerate(fits) if f is chosen]
                if rows:
                    done = self.tokenizers[strategy].encode_batch(
                        [(firsts[i], seconds[i]) for i in rows]
                    )
                    for i, encoding in zip(rows, done, strict=True):
                        encodings[i] = encoding
        width = max(len(e.ids) for e in encodings)
        batch = len(encodings)
        ids = np.full((batch, width), self.pad_id, dtype=np.int64)
        mask = np.zeros((batch, width), dtype=np.int64)
        types = np.zeros((batch, width), dtype=np.int64)
        for row, encoding in enumerate(encodings):
            n = len(encoding.ids)
            ids[row, :n] = encoding.ids
            mask[row, :n] = 1
            types[row, :n] = encoding.type_ids
        named = {"input_ids": ids, "attention_mask": mask, "token_type_ids": types}
        return self.graph.preprocess({name: named[name] for name in self.feeds})

    def forward(self, batch: Any) -> Any:
        return self.graph.forward(batch)

    def postprocess(self, outputs: Any) -> dict[str, np.ndarray]:
        logits = self.graph.postprocess(outputs)[self.graph_output]
        return {self.output: np.asarray(logits, dtype=np.float32)}

    def unload(self) -> None:
        self.graph.unload()
