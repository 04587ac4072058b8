"""Typed APIs on the inference service: embeddings, rerank/classify/sparse, generation, and
calls of many rows served in chunks. Each is an adapter on the one admission path."""
