"""Before/after table for run.py --compare BASE,NEW: the same server measured from two source
trees in one run (see README.md, "Comparing a change against a base commit").

For each model and concurrency it puts side by side: req/s, server CPU per request (the whole
server process tree's CPU time / completed requests) and main-thread CPU per request (for
gpuserve the asyncio event loop: HTTP parsing, JSON codec, batching decisions). With
--rounds > 1 each cell is the mean of the rounds, the rounds follow in brackets.
"""
from statistics import mean

SLOWER_LIMIT_PCT = -5.0  # issue 14: req/s within 5% of the base
OTHER_LOAD_LIMIT_PCT = 10.0  # other work on the server's CPUs above this voids the comparison


def _points(results, server, model, c, key):
    vals = []
    for res in results:
        if res["server"] != server or res["model"] != model:
            continue
        for r in res["runs"]:
            if r["concurrency"] == c and r.get(key) is not None:
                vals.append(r[key])
    return vals


def _cell(vals, fmt):
    if not vals:
        return "-"
    s = fmt.format(mean(vals))
    return s + (" [" + ", ".join(fmt.format(v) for v in vals) + "]" if len(vals) > 1 else "")


def _delta(base, new):
    if not base or not new:
        return None
    return 100.0 * (mean(new) - mean(base)) / mean(base)


def _pct(d):
    return "-" if d is None else f"{d:+.1f}%"


def compare_lines(results, base, new, models, conc):
    """Markdown lines of the before/after section.

    Args:
        results: run.py's per-(server, model) result dicts (keys server, model, runs).
        base: server name of the "before" tree (e.g. gpuserve-base).
        new: server name of the "after" tree (e.g. gpuserve).
        models: model names in report order.
        conc: concurrencies in report order.
    """
    L = [f"## Before/after: {new} against {base}\n",
         f"Δ = ({new} - {base}) / {base}. req/s check: ok while Δ ≥ {SLOWER_LIMIT_PCT:g}% "
         "(issue 14: within 5%); CPU per request should not grow. Server CPU µs/req = CPU time of "
         "the whole server process tree during the point / completed requests; loop µs/req = the "
         "same for the server's main thread only (gpuserve: the asyncio event loop).\n",
         f"| model | c | {base} req/s | {new} req/s | Δ req/s | check | {base} CPU µs/req | "
         f"{new} CPU µs/req | Δ CPU | {base} loop µs/req | {new} loop µs/req | Δ loop |",
         "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for model in models:
        for c in conc:
            cells = [model, str(c)]
            for key, fmt in (("rps", "{:.0f}"), ("cpu_us_per_req", "{:.0f}"),
                             ("main_cpu_us_per_req", "{:.0f}")):
                b = _points(results, base, model, c, key)
                n = _points(results, new, model, c, key)
                d = _delta(b, n)
                cells += [_cell(b, fmt), _cell(n, fmt), _pct(d)]
                if key == "rps":
                    cells.append("-" if d is None else "ok" if d >= SLOWER_LIMIT_PCT else "**SLOWER**")
            L.append("| " + " | ".join(cells) + " |")
    L.append("")
    noisy = sorted({(res["server"], res["model"], r["concurrency"]) for res in results
                    if res["server"] in (base, new) for r in res["runs"]
                    if r.get("other_on_server_cpus_pct", 0) > OTHER_LOAD_LIMIT_PCT})
    if noisy:
        L.append(f"**Not a valid speed comparison:** other work used more than {OTHER_LOAD_LIMIT_PCT:g}% of "
                 "the server's CPU during " + ", ".join(f"{s}/{m} c={c}" for s, m, c in noisy)
                 + " (column 'other load on server CPUs' in Details). Rerun on a quiet machine.\n")
    return L
