"""Continuous batching for generative models: the pure scheduling core.

``sequence`` holds one generated sequence's state, ``blocks`` the paged KV-cache block manager
(with prefix caching by chained block hashes) and ``scheduler`` the iteration-level scheduler
(chunked prefill, decode-first token budget, preemption by recompute). No torch, no asyncio, no
threads: an engine loop drives them on an injected clock.
"""
