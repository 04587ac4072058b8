"""The mixed-length benchmark's judgement of issue 20's targets, and its corpus (pure code)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import corpus
import mixed_length_inprocess
import mixed_length_report as report
import mixed_length_servers as servers


def point(server: str, mix: str, c: int, rps: float) -> dict:
    return {
        "server": server,
        "mix": mix,
        "concurrency": c,
        "rps": rps,
        "tokens_per_s": rps * 20,
        "p50_ms": 1.0,
        "p99_ms": 2.0,
        "ok": 10,
        "errors": {},
        "stable": True,
    }


def document(gpuserve: dict[int, float], pytriton: dict[int, float]) -> dict:
    return {
        "info": {
            "date": "2026-12-01T15:00",
            "python": "3.11.7",
            "cpus": 2,
            "loadavg_start": (0.1,),
            "loadavg_end": (0.2,),
            "elapsed_s": 60,
        },
        "config": {
            "conc": [1, 8, 32],
            "mixes": ["short"],
            "tag": "t",
            "server_cpus": "1",
            "client_cpus": "0",
            "torch_threads": 1,
            "warmup": 1,
            "duration": 3,
            "max_batch": 64,
            "batch_wait_ms": 2,
        },
        "corpus": [
            {
                "mix": "short",
                "texts": 3,
                "tokens_min": 5,
                "tokens_median": 9,
                "tokens_mean": 9.5,
                "tokens_max": 20,
                "truncated": 0,
                "sha256": "ab" * 32,
            }
        ],
        "inprocess": [
            {
                "mix": "short",
                "mode": "batch1",
                "texts_per_s": 60.0,
                "tokens_per_s": 900.0,
                "padding_ratio": 1.0,
                "batch_ms_p50": 16.0,
            },
            {
                "mix": "short",
                "mode": "sorted32",
                "texts_per_s": 120.0,
                "tokens_per_s": 1900.0,
                "padding_ratio": 1.02,
                "batch_ms_p50": 260.0,
            },
        ],
        "servers": [
            {
                "server": "gpuserve",
                "label": "g",
                "points": [point("gpuserve", "short", c, r) for c, r in gpuserve.items()],
            },
            {
                "server": "pytriton",
                "label": "p",
                "points": [point("pytriton", "short", c, r) for c, r in pytriton.items()],
            },
        ],
        "skipped": [("infinity", "no venv")],
    }


def verdicts(doc: dict) -> dict[str, bool | None]:
    return {what: ok for what, _, _, ok in report.targets(doc)}


def test_targets_pass_when_served_is_near_the_best_in_process_and_ahead_of_the_peer():
    doc = document({1: 60.0, 8: 110.0, 32: 105.0}, {1: 55.0, 8: 70.0, 32: 60.0})
    judged = verdicts(doc)
    assert judged["short: gpuserve c=32 / best in-process (sorted32)"] is True  # 105/120
    assert judged["short: gpuserve c=32 / c=1 (never falls)"] is True
    assert judged["short: gpuserve / pytriton at c=8"] is True  # 110/70 = 1.57
    assert judged["short: gpuserve / pytriton at c=32"] is True
    assert not any("infinity" in what for what in judged)  # it did not run: not judged
    text = report.render(doc)
    assert "| short: gpuserve c=32 / best in-process (sorted32) | 0.88 | >= 0.85 | PASS |" in text
    assert "Skipped infinity: no venv." in text


def test_targets_fail_when_throughput_falls_with_concurrency_or_trails_the_peer():
    doc = document({1: 60.0, 8: 70.0, 32: 50.0}, {1: 55.0, 8: 70.0, 32: 40.0})
    judged = verdicts(doc)
    assert judged["short: gpuserve c=32 / best in-process (sorted32)"] is False
    assert judged["short: gpuserve c=32 / c=1 (never falls)"] is False
    assert judged["short: gpuserve / pytriton at c=8"] is False  # 1.0 < 1.5
    assert judged["short: gpuserve / pytriton at c=32"] is False  # 1.25 < 1.5
    assert "| FAIL |" in report.render(doc)


def test_server_cpu_per_request_splits_the_event_loop_from_the_instance_thread():
    before = {100: 1.0, 101: 2.0, 102: 0.5}
    after = {100: 1.2, 101: 3.0, 102: 0.6, 103: 0.1}  # 103 started during the point
    cpu = servers.cpu_per_request(100, before, after, requests=1000)
    assert cpu == pytest.approx(
        {"event_loop_us": 200.0, "instance_us": 1000.0, "other_us": 200.0, "total_us": 1400.0}
    )
    assert servers.cpu_per_request(100, before, {}, 1000) == {}
    assert servers.cpu_per_request(100, before, after, 0) == {}
    doc = document({1: 60.0, 8: 110.0, 32: 105.0}, {1: 55.0, 8: 70.0, 32: 60.0})
    doc["servers"][0]["points"][-1]["server_cpu_us"] = cpu
    assert "| gpuserve | short | 32 | 200 | 1000 | 200 | 1400 |" in report.render(doc)


def test_thread_cpu_of_this_process_has_its_main_thread():
    times = servers.thread_cpu_s(os.getpid())
    if not times:
        pytest.skip("no /proc here")
    assert os.getpid() in times and all(t >= 0 for t in times.values())


def test_in_process_sorted_batches_hold_texts_of_nearly_one_length():
    texts = [f"t{i}" for i in range(64)]
    lengths = [(i * 37) % 64 for i in range(64)]
    plan = mixed_length_inprocess.batches("sorted8", texts, lengths)
    assert sorted(i for group in plan for i in group) == list(range(64))
    assert all(max(lengths[i] for i in g) - min(lengths[i] for i in g) <= 7 for g in plan)
    random_plan = mixed_length_inprocess.batches("random8", texts, lengths)
    assert random_plan[0] == list(range(8))
    with pytest.raises(ValueError, match="unknown mode"):
        mixed_length_inprocess.batches("fancy8", texts, lengths)


def test_the_corpus_keeps_prose_and_drops_code():
    assert corpus.is_prose("Return a list of normalized paths with duplicates removed.")
    assert not corpus.is_prose("x = foo(bar) + 1.")
    assert not corpus.is_prose("lowercase start is not a sentence.")
    doc = "Summary line here.\n\n    >>> code()\n    1\n\nArgs:\n    x: thing\n\nMore prose."
    assert list(corpus.paragraphs(doc)) == ["Summary line here.", "More prose."]
    assert corpus.sentences("It works, e.g. here. Next one!") == [
        "It works, e.g. here.",
        "Next one!",
    ]
    groups = [
        ["One two three four five."] * 1,
        [f"Sentence number {i} has six words." for i in range(40)],
    ]
    import random

    chunks = corpus.chunk_mix(groups, random.Random(0))
    assert chunks and all(60 <= len(c.split()) <= 200 for c in chunks)
