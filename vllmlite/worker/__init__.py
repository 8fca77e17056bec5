"""The worker: the model runner (owns the KV cache), sampling, speculative decoding, structured output.
Called by the engine through core/batch.py; knows nothing of the scheduler's state or the API."""
