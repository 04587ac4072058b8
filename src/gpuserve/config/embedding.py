"""The ``embedding:`` section of a model's config: serving it on the OpenAI-compatible
embeddings API, and the check of that section against the model's tensors."""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import Field, model_validator

from gpuserve.config.base import Strict

if TYPE_CHECKING:
    from gpuserve.config.model import ModelConfig


class EmbeddingConfig(Strict):
    """Serve the model on the OpenAI-compatible embeddings API (``POST /v1/embeddings``,
    ``GET /v1/models``): which tensors carry the text and the embedding.

    Automatic (no section needed) for the ``huggingface`` backend's ``feature-extraction``
    task; any other model opts in with this section (the default ``text_embedding`` does).
    A request of N inputs is served as N rows of ``text_input`` (or ``token_ids_input``),
    split into requests of at most ``max_batch_size`` rows that are batched with V2 traffic.

    Attributes:
        enabled: False keeps the model off the embeddings API (e.g. a feature-extraction
            model that should be served over V2 only).
        text_input: The BYTES input taking one UTF-8 text per row (shape ``[1]`` or ``[]``);
            None for a model that takes token ids only.
        token_ids_input: An INT64 or INT32 input of shape ``[-1]`` taking one sequence of
            token ids per row, or None: requests sending token ids are refused (400).
        output: The FP32 (or FP16/FP64) output holding one embedding per row, shape
            ``[width]``.
        dimensions: Widths the embedding may be cut to (Matryoshka models: the first N
            values), each at most ``width``; a request's ``dimensions`` must be one of them
            or the full width. Empty: the model refuses ``dimensions`` (400).
        normalize_truncated: L2-normalise a cut embedding (as OpenAI's ``dimensions``
            does); False returns the first N values as computed.
        token_counts: How ``usage.prompt_tokens`` is obtained: ``model`` calls the
            model's ``count_tokens(texts) -> list[int]`` (tokens per text after truncation,
            run at admission off the event loop; the default repository's model and the
            huggingface backend have one); ``none`` reports 0 tokens for text inputs. Token-id
            inputs count their ids either way.
    """

    enabled: bool = True
    text_input: str | None = "TEXT"
    token_ids_input: str | None = None
    output: str = Field(default="EMBEDDING", min_length=1)
    dimensions: list[int] = Field(default_factory=list)
    normalize_truncated: bool = True
    token_counts: Literal["model", "none"] = "model"

    @model_validator(mode="after")
    def _check(self) -> EmbeddingConfig:
        if self.text_input is None and self.token_ids_input is None:
            raise ValueError("set text_input, token_ids_input or both (both are null)")
        if self.text_input is not None and self.text_input == self.token_ids_input:
            raise ValueError(
                f"text_input and token_ids_input must differ, both are {self.text_input!r}"
            )
        for width in self.dimensions:
            if width < 1:
                raise ValueError(f"dimensions must be >= 1, got {width}")
        if len(set(self.dimensions)) != len(self.dimensions):
            raise ValueError(f"dimensions must not repeat, got {self.dimensions}")
        return self


_EMBEDDING_DATATYPES = ("FP32", "FP16", "FP64")
_TOKEN_ID_DATATYPES = ("INT64", "INT32")


def embedding_problem(config: ModelConfig, embedding: EmbeddingConfig) -> str | None:
    """What is wrong with ``embedding`` for ``config``'s tensors, or None when it fits; the
    message names the section's field and the model's tensors.

    Inputs and outputs are checked only when declared (a backend may fill them in at load):
    ``text_input`` BYTES ``[1]`` or ``[]``; ``token_ids_input`` INT64/INT32 ``[-1]``; any
    other input optional (the API sends only one); ``output`` FP32/FP16/FP64 ``[width]``
    with every ``dimensions`` entry at most ``width``.
    """
    model = f"model {config.name!r}" if config.name else "the model"
    if config.inputs:
        used = [n for n in (embedding.text_input, embedding.token_ids_input) if n is not None]
        for field, name, datatypes, shapes in (
            ("embedding.text_input", embedding.text_input, ("BYTES",), ([1], [])),
            ("embedding.token_ids_input", embedding.token_ids_input, _TOKEN_ID_DATATYPES, ([-1],)),
        ):
            if name is None:
                continue
            spec = config.input(name)
            if spec is None:
                names = ", ".join(t.name for t in config.inputs)
                return f"{field} {name!r} is not an input of {model} (inputs: {names})"
            if spec.datatype not in datatypes or spec.shape not in shapes:
                return (
                    f"{field} {name!r} is {spec.datatype} {spec.shape}; it must be "
                    f"{' or '.join(datatypes)} with shape {' or '.join(map(str, shapes))}"
                )
            if len(used) > 1 and not spec.optional:
                return f"{field} {name!r} must be an optional input (a request sends text or ids)"
        required = [t.name for t in config.inputs if not t.optional and t.name not in used]
        if required:
            return (
                f"embedding: inputs {required} are required by {model}, but the embeddings "
                f"API sends only {used}: declare them optional"
            )
    if config.outputs:
        out = next((t for t in config.outputs if t.name == embedding.output), None)
        if out is None:
            names = ", ".join(t.name for t in config.outputs)
            return (
                f"embedding.output {embedding.output!r} is not an output of {model} "
                f"(outputs: {names})"
            )
        if out.datatype not in _EMBEDDING_DATATYPES or len(out.shape) != 1:
            return (
                f"embedding.output {out.name!r} is {out.datatype} {out.shape}; it must be "
                f"{'/'.join(_EMBEDDING_DATATYPES)} with shape [width]"
            )
        width = out.shape[0]
        too_wide = [d for d in embedding.dimensions if width != -1 and d > width]
        if too_wide:
            return (
                f"embedding.dimensions {too_wide} exceed the width {width} of output "
                f"{out.name!r} of {model}"
            )
    return None
