"""gpuserve.backends.hf_text.pair_rows: pairs tokenised on the Rust core of the model's
tokenizer give exactly the ids, segment ids and mask transformers' tokenizer gives for
``tokenizer(firsts, seconds, truncation=...)``: the query kept whole where it fits
(``only_second``), cut longest-first where it does not, on either truncation side, with the
query repeated in every row as a rerank request sends it."""

from __future__ import annotations

import pytest
import transformers

from gpuserve.backends.hf_text import pair_rows
from gpuserve.text.truncation import PrefixTruncator
from tests.fixtures.hf_models import minilm_dir

MAX = 48
QUERY = "what does the fox jump over"
PASSAGES = ["the quick brown fox jumps over the lazy dog " * n for n in (1, 3, 9, 20)] + [
    "",
    "naïve café Ünïcödé 東京 " * 7,
]
LONG_QUERY = "why " * 60


def expected(tokenizer, firsts, seconds, side):
    tokenizer.truncation_side = side
    out = []
    for first, second in zip(firsts, seconds, strict=True):
        heads = tokenizer(first, add_special_tokens=False)["input_ids"]
        fits = len(heads) + tokenizer.num_special_tokens_to_add(pair=True) < MAX
        strategy = "only_second" if fits else "longest_first"
        encoded = tokenizer([first], [second], truncation=strategy, max_length=MAX)
        out.append({key: values[0] for key, values in encoded.items()})
    return out


@pytest.mark.parametrize("side", ["right", "left"])
def test_pairs_equal_transformers_tokenizer(side: str) -> None:
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(minilm_dir()), local_files_only=True)
    own = PrefixTruncator.copy_of(tokenizer.backend_tokenizer)
    firsts = [QUERY] * len(PASSAGES) + [LONG_QUERY, LONG_QUERY]
    seconds = PASSAGES + ["short", "the lazy dog " * 40]
    got = pair_rows(own, firsts, seconds, MAX, side)
    want = expected(tokenizer, firsts, seconds, side)
    assert [row["input_ids"] for row in got] == [row["input_ids"] for row in want]
    assert [row["token_type_ids"] for row in got] == [row["token_type_ids"] for row in want]
    assert [row["attention_mask"] for row in got] == [row["attention_mask"] for row in want]
    assert max(len(row["input_ids"]) for row in got) == MAX
    # the query is whole in every row where it fits
    query = tokenizer(QUERY, add_special_tokens=False)["input_ids"]
    for row in got[: len(PASSAGES)]:
        assert row["input_ids"][1 : 1 + len(query)] == query
