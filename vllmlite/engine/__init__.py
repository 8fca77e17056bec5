"""The engine: LLMEngine.step(), intake, output processing, the async engine, request limits, metrics.
Sits on core/ and calls the worker through the batch contracts; knows nothing of HTTP."""
