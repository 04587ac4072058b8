"""Token ids of texts already tokenised at admission, handed to the model's CPU stage.

A text model's admission step tokenises every short text whole to count its tokens
(:class:`~gpuserve.text.truncation.PrefixTruncator`); its CPU stage then tokenised the same
text again to embed it. :class:`EncodedTexts` carries the first result over: the admission
step puts each text's ids (special tokens included, within the model's ``max_length``), the
CPU stage takes them, and tokenises only the texts it does not find (a call that did not go
through admission, a text put twice and taken once, an entry already evicted). A text maps to
one sequence of ids whatever request it came in, so an entry is right for any taker.

Bounded: at most ``capacity`` texts (the oldest go first), so texts admitted but never run
(a cancelled request, a request refused later) cost nothing lasting. Thread-safe (one lock):
admission runs on the event loop or its threads, the CPU stage on the instance's.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence

#: Texts held by default: a few batches' worth of short texts (under 1 MB of ids).
CAPACITY = 4096


class EncodedTexts:
    """Text -> token ids, put at admission and taken (removed) by the CPU stage.

    Args:
        capacity: Most texts held; putting one more evicts the oldest.
    """

    def __init__(self, capacity: int = CAPACITY) -> None:
        self.capacity = capacity
        self._ids: OrderedDict[str, list[int]] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._ids)

    def put(self, text: str, ids: list[int]) -> None:
        """Hold ``ids`` (the text's whole tokenisation, special tokens included) for ``text``."""
        with self._lock:
            self._ids[text] = ids
            self._ids.move_to_end(text)
            while len(self._ids) > self.capacity:
                self._ids.popitem(last=False)

    def take(self, texts: Sequence[str]) -> list[list[int] | None]:
        """The ids of each text of ``texts`` (None where missing); the entries found are
        removed. A text that appears twice in ``texts`` gets its ids both times."""
        with self._lock:
            held = self._ids
            found = [held.get(text) for text in texts]
            for text, ids in zip(texts, found, strict=True):
                if ids is not None:
                    held.pop(text, None)
            return found


__all__ = ["CAPACITY", "EncodedTexts"]
