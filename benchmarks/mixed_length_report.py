"""Markdown report of a mixed_length.py run: corpus, (a) in-process limit, served req/s and
tokens/s per server x mix x concurrency, ratios, issue 20's targets with pass/fail, and the
before/after table when gpuserve-base ran."""

from __future__ import annotations

SUBJECT = "gpuserve"
BASE = "gpuserve-base"
INPROCESS_SHARE = 0.85  # served at the highest c >= this x the best in-process figure
PEER_TARGETS = {
    "pytriton": {"short": 1.5, "chunks": 1.3},
    "infinity": {"short": 1.3, "chunks": 1.3},
}
PEER_CONC = (8, 32)
# compared in the ratio table without a target: PyTriton in front of gpuserve's own packed
# encoder measures the serving layers alone (the execution is the same code)
PEERS = ("pytriton", "pytriton-packed", "infinity")


def _f(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _point_table(doc: dict, key: str, intro: str, columns: list[tuple[str, str, int]]) -> list[str]:
    """Markdown lines of a table with a row per point that has ``key`` (a dict of values):
    ``columns`` are (header, field of that dict, decimals). Empty when no point has it."""
    rows = [p for res in doc["servers"] for p in res["points"] if p.get(key)]
    if not rows:
        return []
    out = [intro, "| server | mix | c | " + " | ".join(c[0] for c in columns) + " |"]
    out.append("|---|---|---|" + "---|" * len(columns))
    for p in rows:
        values = p[key]
        cells = " | ".join(_f(values.get(field), digits) for _, field, digits in columns)
        out.append(f"| {p['server']} | {p['mix']} | {p['concurrency']} | {cells} |")
    out.append("")
    return out


def points(doc: dict) -> dict[tuple[str, str, int], dict]:
    """(server, mix, c) -> the measured point."""
    return {
        (p["server"], p["mix"], p["concurrency"]): p
        for res in doc["servers"]
        for p in res["points"]
    }


def best_inprocess(doc: dict, mix: str) -> dict | None:
    rows = [r for r in doc["inprocess"] if r["mix"] == mix]
    return max(rows, key=lambda r: r["texts_per_s"]) if rows else None


def reachable_inprocess(doc: dict, mix: str, c: int) -> dict | None:
    """The best in-process mode a server can match at concurrency ``c``: batches of ``c``
    texts in arrival (random) order. ``sortedB`` modes order the whole corpus by length
    before cutting it into batches; a server holding at most ``c`` requests at a time
    never sees such batches, whatever its per-request cost."""
    rows = [r for r in doc["inprocess"] if r["mix"] == mix and r["mode"].endswith(f"random{c}")]
    return max(rows, key=lambda r: r["texts_per_s"]) if rows else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def targets(doc: dict) -> list[tuple[str, float | None, float, bool | None]]:
    """(what, measured, needed, passed) for every target that this run can judge."""
    pts = points(doc)
    conc = doc["config"]["conc"]
    top = max(conc)
    out = []
    for mix in doc["config"]["mixes"]:
        best = best_inprocess(doc, mix)
        high = pts.get((SUBJECT, mix, top))
        if best and high:
            r = _ratio(high["rps"], best["texts_per_s"])
            out.append(
                (
                    f"{mix}: gpuserve c={top} / best in-process ({best['mode']})",
                    r,
                    INPROCESS_SHARE,
                    None if r is None else r >= INPROCESS_SHARE,
                )
            )
        held = reachable_inprocess(doc, mix, top)
        if held and high:
            r = _ratio(high["rps"], held["texts_per_s"])
            out.append(
                (
                    f"{mix}: gpuserve c={top} / in-process batches of {top} in arrival order "
                    f"({held['mode']})",
                    r,
                    INPROCESS_SHARE,
                    None if r is None else r >= INPROCESS_SHARE,
                )
            )
        low = pts.get((SUBJECT, mix, min(conc)))
        if low and high and top != min(conc):
            r = _ratio(high["rps"], low["rps"])
            out.append(
                (
                    f"{mix}: gpuserve c={top} / c={min(conc)} (never falls)",
                    r,
                    1.0,
                    None if r is None else r >= 1.0,
                )
            )
        for peer, need in PEER_TARGETS.items():
            for c in PEER_CONC:
                ours, theirs = pts.get((SUBJECT, mix, c)), pts.get((peer, mix, c))
                if ours and theirs:
                    r = _ratio(ours["rps"], theirs["rps"])
                    out.append(
                        (
                            f"{mix}: gpuserve / {peer} at c={c}",
                            r,
                            need[mix],
                            None if r is None else r >= need[mix],
                        )
                    )
    return out


def render(doc: dict) -> str:
    info, cfg = doc["info"], doc["config"]
    conc = cfg["conc"]
    L = [f"# Mixed-length text benchmark ({info['date'][:16]}, tag {cfg['tag']})\n"]
    la0, la1 = info["loadavg_start"], info.get("loadavg_end", ("?",))
    L.append(
        f"Python {info['python']}, {info['cpus']} CPUs, no GPU. Servers pinned to CPU "
        f"{cfg['server_cpus']} with {cfg['torch_threads']} torch thread "
        f"(OMP_NUM_THREADS), the load generator (gpuserve.bench, closed loop, keep-alive, "
        f"one text per request) on CPU {cfg['client_cpus']}. Each point: {cfg['warmup']} s "
        f"warm-up + {cfg['duration']} s in 3 windows (chunks: "
        f"{cfg.get('chunk_duration', cfg['duration'])} s). Peers: max batch {cfg['max_batch']}, "
        f"max wait {cfg['batch_wait_ms']} ms; gpuserve: its default repository as shipped. "
        f"Load average at start {la0[0]:.2f}, at end {la1[0]:.2f}. Total "
        f"{info.get('elapsed_s', 0) / 60:.1f} min.\n"
    )
    if info.get("base_src"):
        L.append(f"GPUSERVE_BASE_SRC={info['base_src']} (server gpuserve-base).\n")
    for name, why in doc["skipped"]:
        L.append(f"Skipped {name}: {why}.\n")
    L.append("## Corpus\n")
    L.append(
        "Docstrings of the Python standard library (benchmarks/corpus.py), tokens counted "
        "with the model's tokenizer after truncation to 256 (what every server embeds).\n"
    )
    L.append("| mix | texts | tokens min / median / mean / max | truncated | sha256 |")
    L.append("|---|---|---|---|---|")
    for c in doc["corpus"]:
        L.append(
            f"| {c['mix']} | {c['texts']} | {c['tokens_min']} / {c['tokens_median']} / "
            f"{c['tokens_mean']:.1f} / {c['tokens_max']} | {c['truncated']} | "
            f"`{c['sha256'][:12]}` |"
        )
    if doc["inprocess"]:
        L.append("\n## (a) In-process limit (no HTTP), same model, same texts\n")
        L.append("| mix | mode | texts/s | tokens/s | padded/real tokens | batch p50 ms |")
        L.append("|---|---|---|---|---|---|")
        for r in doc["inprocess"]:
            L.append(
                f"| {r['mix']} | {r['mode']} | {r['texts_per_s']:.1f} | "
                f"{r['tokens_per_s']:.0f} | {r['padding_ratio']:.2f} | {r['batch_ms_p50']:.1f} |"
            )
    L.append("\n## (b), (c) Served: req/s and tokens/s (one text per request)\n")
    head = " | ".join(f"c={c} req/s | c={c} tok/s" for c in conc)
    L.append(f"| server | mix | {head} | p99 ms at c={max(conc)} | errors |")
    L.append("|---|---|" + "---|---|" * len(conc) + "---|---|")
    pts = points(doc)
    for res in doc["servers"]:
        if "error" in res:
            L.append(f"| {res['server']} | FAILED: {res['error'][:120]} |")
        for mix in cfg["mixes"]:
            row = [pts.get((res["server"], mix, c)) for c in conc]
            if not any(row):
                continue
            cells = " | ".join(
                f"{_f(p['rps'])} | {_f(p['tokens_per_s'], 0)}" + ("" if p["stable"] else "*")
                if p
                else "- | -"
                for p in row
            )
            last = row[-1]
            errors = sum(sum(p["errors"].values()) for p in row if p)
            L.append(
                f"| {res['server']} | {mix} | {cells} | {_f(last and last['p99_ms'])} | {errors} |"
            )
    L.append("\n\\* the three windows of that point spread by more than 10%.\n")
    L.extend(
        _point_table(
            doc,
            "batches",
            "Batches gpuserve formed (its /metrics histograms over each point, warm-up "
            "included; tokens = real tokens, padding = padded / real tokens):\n",
            [
                ("rows/batch", "rows_per_batch", 1),
                ("tokens/batch", "tokens_per_batch", 0),
                ("padding", "padding_ratio", 2),
            ],
        )
    )
    L.extend(
        _point_table(
            doc,
            "server_cpu_us",
            "Server CPU per request, microseconds (/proc per-thread times over each point, "
            "warm-up included, divided by the rows the model ran): the event loop (main "
            "thread: HTTP, admission, answers), the instance's execution thread (the busiest "
            "other one) and every other thread:\n",
            [
                ("event loop", "event_loop_us", 0),
                ("instance thread", "instance_us", 0),
                ("other", "other_us", 0),
                ("total", "total_us", 0),
            ],
        )
    )
    L.append("## Ratios (req/s; tokens/s in brackets)\n")
    L.append(
        "| mix | server | "
        + " | ".join(f"c={c} / best in-process" for c in conc)
        + " | "
        + " | ".join(f"vs {p} c={c}" for p in PEERS for c in PEER_CONC)
        + " |"
    )
    L.append("|---|---|" + "---|" * (len(conc) + len(PEERS) * len(PEER_CONC)))
    for mix in cfg["mixes"]:
        best = best_inprocess(doc, mix)
        for res in doc["servers"]:
            name = res["server"]
            if not any(pts.get((name, mix, c)) for c in conc):
                continue
            cells = []
            for c in conc:
                p = pts.get((name, mix, c))
                r = _ratio(p and p["rps"], best and best["texts_per_s"])
                t = _ratio(p and p["tokens_per_s"], best and best["tokens_per_s"])
                cells.append(f"{_f(r, 2)} ({_f(t, 2)})")
            for peer in PEERS:
                for c in PEER_CONC:
                    ours, theirs = pts.get((name, mix, c)), pts.get((peer, mix, c))
                    r = _ratio(ours and ours["rps"], theirs and theirs["rps"])
                    t = _ratio(ours and ours["tokens_per_s"], theirs and theirs["tokens_per_s"])
                    cells.append("-" if peer == name else f"{_f(r, 2)} ({_f(t, 2)})")
            L.append(f"| {mix} | {name} | " + " | ".join(cells) + " |")
    if any(r["mix"] for r in doc["inprocess"]):
        L.append(
            "\nBest in-process: "
            + ", ".join(
                f"{m} {b['mode']} {b['texts_per_s']:.1f} texts/s"
                for m in cfg["mixes"]
                if (b := best_inprocess(doc, m))
            )
            + ".\n"
        )
    judged = targets(doc)
    L.append("## Issue 20 targets (gpuserve, req/s)\n")
    if not judged:
        L.append("Nothing to judge in this run (gpuserve or its references did not run).\n")
    else:
        L.append("| target | measured | needed | result |")
        L.append("|---|---|---|---|")
        for what, value, need, ok in judged:
            verdict = "-" if ok is None else "PASS" if ok else "FAIL"
            L.append(f"| {what} | {_f(value, 2)} | >= {need:g} | {verdict} |")
    if any(res["server"] == BASE for res in doc["servers"]):
        L.append("\n## Before/after: gpuserve-base -> gpuserve (req/s, tokens/s)\n")
        L.append("| mix | c | base req/s | new req/s | change | base tok/s | new tok/s |")
        L.append("|---|---|---|---|---|---|---|")
        for mix in cfg["mixes"]:
            for c in conc:
                b, n = pts.get((BASE, mix, c)), pts.get((SUBJECT, mix, c))
                if b and n:
                    change = 100.0 * (n["rps"] - b["rps"]) / b["rps"] if b["rps"] else None
                    L.append(
                        f"| {mix} | {c} | {b['rps']:.1f} | {n['rps']:.1f} | "
                        f"{_f(change)}% | {_f(b['tokens_per_s'], 0)} | {_f(n['tokens_per_s'], 0)} |"
                    )
    L.append("\n## Servers\n")
    for res in doc["servers"]:
        extra = "; ".join(res.get("info", []))
        L.append(
            f"- **{res['server']}**: {res['label']}; ready after "
            f"{_f(res.get('ready_s'))} s"
            + (f"; {extra}" if extra else "")
            + (f"; FAILED: {res['error']}" if "error" in res else "")
        )
    return "\n".join(L) + "\n"
