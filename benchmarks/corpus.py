#!/usr/bin/env python3
"""A corpus of real English prose of varied length, built offline from the docstrings of the
Python standard library (the interpreter that runs this script).

Nobody writes these texts for the benchmark: they are the module, class and function
docstrings of ``Lib/*.py`` (tests, idlelib, tkinter demos and vendored packages left out),
read with :mod:`ast` (no module is imported), cleaned of code (doctest lines, indented
blocks, reStructuredText markup) and split into sentences. The result depends only on the
Python version (3.11.7 here), so two runs on one interpreter send the same texts; the report
prints the corpus's SHA-256 so runs can be matched.

Two mixes:

* ``short``: single sentences of 4 to 40 words, in a seeded random order.
* ``chunks``: runs of consecutive sentences from one docstring, 60 to 200 words each (a
  target length drawn uniformly per chunk), in a seeded random order.

Usage::

    python benchmarks/corpus.py --mix short --count 5 --show     # a few texts and the stats
    python benchmarks/corpus.py --mix chunks --out /tmp/chunks.txt  # one text per line
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import random
import re
import sys
import sysconfig
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

MIXES = ("short", "chunks")
SHORT_WORDS = (4, 40)  # words per sentence in the short mix, inclusive
CHUNK_WORDS = (60, 200)  # words per chunk, inclusive
SEED = 20261201

# folders of the standard library that hold tests, demos, vendored or generated code
_SKIP_DIRS = frozenset(
    {
        "test",
        "tests",
        "idlelib",
        "lib2to3",
        "turtledemo",
        "site-packages",
        "ensurepip",
        "pydoc_data",
        "__pycache__",
        "tkinter",
        "config-3.11-x86_64-linux-gnu",
    }
)
_SENTENCE_END = re.compile(r"(?<=[a-z0-9)\]][.!?])\s+(?=[A-Z])")
_ROLE = re.compile(r":[a-z]+:`~?([^`]*)`")  # :func:`name` -> name
_LITERAL = re.compile(r"``([^`]*)``|`([^`]*)`")
_ALLOWED = re.compile(r"^[A-Za-z0-9 ,.;:'\"()\-!?/%&]+$")
_ABBREVIATIONS = ("e.g.", "i.e.", "etc.", "vs.", "cf.", "approx.")


@dataclass(frozen=True, slots=True)
class Corpus:
    """The texts of one mix.

    Attributes:
        mix: ``short`` or ``chunks``.
        texts: The texts, in the benchmark's (seeded random) order; no newlines inside.
        source: Where they came from (the standard library folder and Python version).
    """

    mix: str
    texts: tuple[str, ...]
    source: str

    @property
    def sha256(self) -> str:
        """Hash of the texts, one per line, to tell whether two runs sent the same corpus."""
        return hashlib.sha256("\n".join(self.texts).encode("utf-8")).hexdigest()

    def words(self) -> list[int]:
        """Whitespace-separated words per text."""
        return [len(text.split()) for text in self.texts]


def stdlib_dir() -> Path:
    """The running interpreter's standard library folder (``Lib/``)."""
    return Path(sysconfig.get_paths()["stdlib"])


def source_files(root: Path) -> list[Path]:
    """The ``.py`` files of the standard library whose docstrings make the corpus, sorted."""
    files = []
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).parts
        if any(part in _SKIP_DIRS or part.startswith("test") for part in parts):
            continue
        files.append(path)
    return files


def docstrings(path: Path) -> Iterator[str]:
    """Every module, class and function docstring of one file, in source order."""
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            text = ast.get_docstring(node, clean=True)
            if text:
                yield text


def paragraphs(docstring: str) -> Iterator[str]:
    """The prose paragraphs of a docstring, each joined into one line.

    Paragraphs are separated by blank lines. A paragraph is dropped when it looks like code or
    a table: an indented line, a doctest prompt, a field list (``Args:``, ``:param x:``), or a
    line that ends in ``::``.
    """
    for block in re.split(r"\n\s*\n", docstring):
        lines = block.splitlines()
        if not lines:
            continue
        if any(
            line.startswith((" ", "\t", ">>>", "...", ":", "-", "*", "|", "+", "="))
            or line.rstrip().endswith("::")
            or re.match(r"^\w[\w ]*:$", line.strip())
            for line in lines
        ):
            continue
        yield " ".join(line.strip() for line in lines)


def clean(text: str) -> str:
    """Strip reStructuredText roles and literals down to their words, squeeze spaces."""
    text = _ROLE.sub(r"\1", text)
    text = _LITERAL.sub(lambda m: m.group(1) or m.group(2), text)
    return re.sub(r"\s+", " ", text).strip()


def sentences(paragraph: str) -> list[str]:
    """Split one paragraph into sentences (a period, ``!`` or ``?`` before a capital)."""
    protected = paragraph
    for abbreviation in _ABBREVIATIONS:
        protected = protected.replace(abbreviation, abbreviation.replace(".", "\x00"))
    return [part.replace("\x00", ".") for part in _SENTENCE_END.split(protected)]


def is_prose(sentence: str) -> bool:
    """A sentence of English words: starts with a capital, ends with ``.``/``!``/``?``, only
    ordinary characters, and mostly words of letters (not identifiers or numbers)."""
    if not sentence or not sentence[0].isupper() or sentence[-1] not in ".!?":
        return False
    if not _ALLOWED.match(sentence):
        return False
    words = sentence.split()
    plain = sum(1 for word in words if word.strip(",.;:()'\"!?").isalpha())
    return plain >= 0.8 * len(words)


def prose_paragraphs(root: Path | None = None) -> list[list[str]]:
    """Every prose paragraph of the standard library as a list of clean sentences (only
    paragraphs with at least one sentence left), in file order, duplicates removed."""
    seen: set[str] = set()
    out = []
    for path in source_files(root or stdlib_dir()):
        for doc in docstrings(path):
            for paragraph in paragraphs(doc):
                kept = [s for s in sentences(clean(paragraph)) if is_prose(s)]
                key = " ".join(kept)
                if kept and key not in seen:
                    seen.add(key)
                    out.append(kept)
    return out


def cached_paragraphs(root: Path | None = None) -> list[list[str]]:
    """:func:`prose_paragraphs`, kept in the temporary folder (parsing the whole library takes
    a few seconds of CPU); the cache key is the library folder and the Python version, so a
    different interpreter never reads another one's corpus."""
    root = root or stdlib_dir()
    key = hashlib.sha256(f"{root}|{sys.version}|{SEED}".encode()).hexdigest()[:16]
    cache = Path(tempfile.gettempdir()) / f"gpuserve-corpus-{key}.json"
    try:
        return [list(group) for group in json.loads(cache.read_text(encoding="utf-8"))]
    except (OSError, ValueError):
        pass
    groups = prose_paragraphs(root)
    partial = cache.with_suffix(f".{id(groups)}.tmp")
    try:
        partial.write_text(json.dumps(groups), encoding="utf-8")
        partial.replace(cache)
    except OSError:
        pass
    return groups


def short_mix(groups: list[list[str]], rng: random.Random) -> list[str]:
    """Distinct sentences of :data:`SHORT_WORDS` words, shuffled."""
    low, high = SHORT_WORDS
    seen: set[str] = set()
    texts = []
    for group in groups:
        for sentence in group:
            if low <= len(sentence.split()) <= high and sentence not in seen:
                seen.add(sentence)
                texts.append(sentence)
    rng.shuffle(texts)
    return texts


def chunk_mix(groups: list[list[str]], rng: random.Random) -> list[str]:
    """Chunks of :data:`CHUNK_WORDS` words: consecutive sentences of one docstring paragraph
    run (paragraphs of one file follow each other), each cut at a sentence end near a target
    length drawn per chunk; shuffled."""
    low, high = CHUNK_WORDS
    stream = [sentence for group in groups for sentence in group]
    texts = []
    current: list[str] = []
    words = 0
    target = rng.randint(low, high)
    for sentence in stream:
        count = len(sentence.split())
        if words + count > high:
            if words >= low:
                texts.append(" ".join(current))
            current, words, target = [], 0, rng.randint(low, high)
            if count > high:
                continue
        current.append(sentence)
        words += count
        if words >= target:
            texts.append(" ".join(current))
            current, words, target = [], 0, rng.randint(low, high)
    rng.shuffle(texts)
    return texts


def build(mix: str, count: int | None = None, root: Path | None = None) -> Corpus:
    """The corpus of one mix, deterministic for a given Python installation.

    Args:
        mix: ``short`` (sentences) or ``chunks`` (60-200 words).
        count: Keep the first ``count`` texts (None: all).
        root: Standard library folder (default: the running interpreter's).

    Raises:
        ValueError: unknown mix, or no texts found under ``root``.
    """
    if mix not in MIXES:
        raise ValueError(f"mix must be one of {MIXES}, got {mix!r}")
    root = root or stdlib_dir()
    groups = cached_paragraphs(root)
    rng = random.Random(f"{SEED}-{mix}")
    texts = short_mix(groups, rng) if mix == "short" else chunk_mix(groups, rng)
    if not texts:
        raise ValueError(f"no prose found under {root}")
    if count is not None:
        texts = texts[:count]
    version = ".".join(str(v) for v in sys.version_info[:3])
    return Corpus(mix, tuple(texts), f"docstrings of the Python {version} standard library")


def write_lines(corpus: Corpus, path: Path) -> None:
    """One text per line, UTF-8."""
    path.write_text("".join(text + "\n" for text in corpus.texts), encoding="utf-8")


def read_lines(path: Path) -> list[str]:
    """The texts of a file written by :func:`write_lines` (empty lines skipped)."""
    return [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def describe(corpus: Corpus) -> str:
    """One line: how many texts, words per text (min / median / max), hash."""
    words = sorted(corpus.words())
    median = words[len(words) // 2]
    return (
        f"{corpus.mix}: {len(words)} texts, {words[0]}/{median}/{words[-1]} words "
        f"(min/median/max), from the {corpus.source}, sha256 {corpus.sha256[:12]}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mix", choices=MIXES, default="short")
    parser.add_argument("--count", type=int, default=None, help="first N texts (default all)")
    parser.add_argument("--out", type=Path, help="write one text per line here")
    parser.add_argument("--show", action="store_true", help="print the texts")
    args = parser.parse_args(argv)
    corpus = build(args.mix, args.count)
    print(describe(corpus))
    if args.out:
        write_lines(corpus, args.out)
    if args.show:
        for text in corpus.texts:
            print("-", text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
