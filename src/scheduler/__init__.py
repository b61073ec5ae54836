"""Scheduler process: continuous batching over a paged KV cache, the model runner, models and weight loading."""
