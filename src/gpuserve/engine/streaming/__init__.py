"""Decoupled execution's own part: the bounded buffer between a model's thread and the client
of its stream (``buffer``). Decoupled requests are queued, batched and run by the scheduling
core and the instances like every other request (:mod:`gpuserve.engine.runners.streaming`)."""
