"""``eagle-jax serve``: an OpenAI-compatible HTTP server on the engine.

Three parts, one module each: ``worker`` (the one thread that owns the engine; requests
reach it through the engine's thread-safe inbox and their text comes back per request),
``protocol`` (the OpenAI request bodies, checked into ``SamplingParams``, and the response
and chunk bodies) and ``app`` (the FastAPI routes, served by uvicorn, and graceful
shutdown); ``metrics`` holds the Prometheus series. The HTTP side never touches JAX.
"""
