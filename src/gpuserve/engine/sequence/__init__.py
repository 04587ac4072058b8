"""Sequence batching: the batcher (``batcher``), its slot table (``slots``), where each
sequence sits in a batch (``layout``) and its implicit state tensors (``tensors``)."""
