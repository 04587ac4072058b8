"""Decoupled execution: the executor of one version's streams (``executor``), batches of
streams for models that serve several in one call (``batching``), and the bounded buffer
between a model's thread and its client (``buffer``)."""
