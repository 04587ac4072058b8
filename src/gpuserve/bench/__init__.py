"""Load generation and configuration search: ``gpuserve bench`` and ``gpuserve tune``.

Modules, from the wire up:

* :mod:`~gpuserve.bench.http_client` - a lean HTTP/1.1 keep-alive client (asyncio protocol).
* :mod:`~gpuserve.bench.targets` - HTTP and gRPC targets handing out sessions.
* :mod:`~gpuserve.bench.raw_target` - ready-made bodies POSTed to any URL (non-V2 peers).
* :mod:`~gpuserve.bench.inputs` - request data from model metadata or a file, encoded once.
* :mod:`~gpuserve.bench.lines` - varied requests from a file of one body or text per line.
* :mod:`~gpuserve.bench.tokens` - each request's size in tokens, for tokens/s.
* :mod:`~gpuserve.bench.stats` - per-request records, percentiles, window stability (pure).
* :mod:`~gpuserve.bench.loadgen` - closed/open-loop load, warm-up, windows until stable.
* :mod:`~gpuserve.bench.server_info` - metadata, statistics extension, GPU metrics.
* :mod:`~gpuserve.bench.benchmark` - one run end to end (:func:`run_benchmark`).
* :mod:`~gpuserve.bench.report` - table, JSON, CSV, latency-throughput plot.
* :mod:`~gpuserve.bench.tune` / :mod:`~gpuserve.bench.tune_report` - the tuner.

The bench is a client: it talks to any KServe V2 server over the wire and imports nothing of
gpuserve's server or engine.
"""
