"""The server's Prometheus series, in a registry of their own (so two servers in one
process, e.g. in tests, keep apart). Written from the engine thread and the HTTP thread;
``prometheus_client`` is thread-safe."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# Outcomes a request can end with (the ``outcome`` label of requests_total).
OUTCOMES = ("stop", "length", "cancelled", "invalid", "rejected", "failed")

_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_PER_TOKEN = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56)


class ServerMetrics:
    """Every series ``GET /metrics`` shows."""

    def __init__(self, max_batch: int, max_accept: int):
        self.registry = r = CollectorRegistry()
        self.requests = Counter("eagle_jax_requests", "Requests by how they ended: stop, length, cancelled (client gone "
                                "or shutdown), invalid (400), rejected (overload), failed (engine error)",
                                ["outcome"], registry=r)
        for o in OUTCOMES:
            self.requests.labels(o)  # every outcome shows, at 0, from the start
        self.queue_length = Gauge("eagle_jax_queue_length", "Requests waiting for a slot (submitted, not yet seated)",
                                  registry=r)
        self.running = Gauge("eagle_jax_running_requests", "Rows of the batch holding a request", registry=r)
        self.free_slots = Gauge("eagle_jax_free_slots", "Slots free for a new request (max batch minus running)",
                                registry=r)
        self.free_slots.set(max_batch)
        self.max_batch = Gauge("eagle_jax_max_batch", "Requests decoded at once (--batch-size)", registry=r)
        self.max_batch.set(max_batch)
        self.ttft = Histogram("eagle_jax_time_to_first_token_seconds", "HTTP arrival to the first generated token",
                              buckets=_LATENCY, registry=r)
        self.tpot = Histogram("eagle_jax_time_per_output_token_seconds",
                              "Per request: first to last token over the tokens after the first", buckets=_PER_TOKEN,
                              registry=r)
        self.e2e = Histogram("eagle_jax_request_seconds", "HTTP arrival to the last token", buckets=_LATENCY, registry=r)
        self.accept_length = Histogram("eagle_jax_accept_length", "Tokens a request gained per speculative step",
                                       buckets=tuple(range(1, max_accept + 1)), registry=r)
        self.steps = Counter("eagle_jax_steps", "Engine steps by padded batch bucket and shape (what the policy chose)",
                             ["bucket", "shape"], registry=r)
        self.prompt_tokens = Counter("eagle_jax_prompt_tokens", "Prompt tokens of admitted requests", registry=r)
        self.generated_tokens = Counter("eagle_jax_generated_tokens", "Tokens generated", registry=r)
        self.speculative_pending = Gauge(
            "eagle_jax_speculative_graphs_pending", "Speculative step graphs still compiling in the background "
            "(--background-compile; plain steps run until 0 and the policy has calibrated)", registry=r)
        self.tokens_per_second = Gauge("eagle_jax_tokens_per_second",
                                       "Tokens generated per second over the last few seconds", registry=r)
