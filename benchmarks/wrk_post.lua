-- POST the body in the file named by $GPUSERVE_BENCH_BODY; at the end print one line
-- "RESULT {json}" with the request count, errors and latency percentiles (microseconds).
-- No per-request callbacks are defined, so wrk stays on its C fast path.
local file = assert(io.open(os.getenv("GPUSERVE_BENCH_BODY"), "rb"))
wrk.method = "POST"
wrk.body = file:read("*a")
file:close()
wrk.headers["Content-Type"] = "application/json"

done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    'RESULT {"requests":%d,"duration_us":%d,"errors":%d,"status_errors":%d,' ..
    '"p50_us":%d,"p90_us":%d,"p99_us":%d,"max_us":%d}\n',
    summary.requests, summary.duration, e.connect + e.read + e.write + e.status + e.timeout,
    e.status, latency:percentile(50), latency:percentile(90), latency:percentile(99),
    latency.max))
end
