"""Prometheus metrics of one server, in a registry of its own.

A registry per app (not prometheus_client's global one) lets several servers live in one
process, as they do in the tests, without their counters mixing.

Names (all prefixed ``specdraft_``):

=====================================  =========  ==============================================
requests_total{endpoint,status}        counter    HTTP responses of the /v1 endpoints by status
request_endings_total{reason}          counter    how generations ended: finished, cancelled
                                                  (client left), timeout, shutdown, engine
prompt_tokens_total                    counter    prompt tokens of queued requests
generated_tokens_total                 counter    tokens generated (cancelled requests included)
engine_steps_total                     counter    batched decoding steps
tokens_per_step                        histogram  τ of each finished request (prefill included)
decode_steps_total{depth}              counter    finished requests' decode steps by drafted depth (0: none)
drafting_off_steps_total               counter    of those, steps adaptive drafting ran plain (no drafter call)
batch_rows                             histogram  rows in the batch at each step
queue_depth                            gauge      requests waiting for a batch slot
running_requests                       gauge      requests in the batch (or being prefilled)
time_to_first_token_seconds            histogram  request received -> first token ready
request_latency_seconds{endpoint}      histogram  request received -> last token ready
=====================================  =========  ==============================================
"""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from .scheduler import SchedulerMetrics

TAU_BUCKETS = (1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 8.0)
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class ServerMetrics(SchedulerMetrics):
    """The server's metrics; also the scheduler's hooks."""

    def __init__(self):
        self.registry = r = CollectorRegistry()
        p = "specdraft_"
        self.requests = Counter(p + "requests", "HTTP responses of the /v1 endpoints", ["endpoint", "status"],
                                registry=r)
        self.endings = Counter(p + "request_endings", "How generations ended", ["reason"], registry=r)
        self.prompt_tokens = Counter(p + "prompt_tokens", "Prompt tokens of queued requests", registry=r)
        self.generated_tokens = Counter(p + "generated_tokens", "Tokens generated", registry=r)
        self.steps = Counter(p + "engine_steps", "Batched decoding steps", registry=r)
        self.tau = Histogram(p + "tokens_per_step", "Tokens per target forward of each finished request",
                             buckets=TAU_BUCKETS, registry=r)
        self.depth_steps = Counter(p + "decode_steps", "Decode steps of finished requests by drafted depth",
                                   ["depth"], registry=r)
        self.off_steps = Counter(p + "drafting_off_steps", "Decode steps adaptive drafting ran plain", registry=r)
        self.batch_rows = Histogram(p + "batch_rows", "Rows in the batch at each step",
                                    buckets=(1, 2, 4, 8, 16, 32, 64), registry=r)
        self.queue_depth = Gauge(p + "queue_depth", "Requests waiting for a batch slot", registry=r)
        self.running = Gauge(p + "running_requests", "Requests in the batch", registry=r)
        self.ttft = Histogram(p + "time_to_first_token_seconds", "Request received to first token ready",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.latency = Histogram(p + "request_latency_seconds", "Request received to last token ready",
                                 ["endpoint"], buckets=LATENCY_BUCKETS, registry=r)

    # ---- scheduler hooks (scheduler thread; prometheus_client is thread-safe) -------------

    def queue(self, waiting: int, running: int) -> None:
        self.queue_depth.set(waiting)
        self.running.set(running)

    def step(self, rows: int, seconds: float) -> None:
        self.steps.inc()
        self.batch_rows.observe(rows)

    def tokens(self, n: int) -> None:
        if n:
            self.generated_tokens.inc(n)

    def finished(self, tokens_per_step: float) -> None:
        self.tau.observe(tokens_per_step)

    def drafting(self, drafted_hist: dict[int, int], off_steps: int) -> None:
        for depth, steps in drafted_hist.items():
            self.depth_steps.labels(str(depth)).inc(steps)
        if off_steps:
            self.off_steps.inc(off_steps)

    def ended(self, reason: str) -> None:
        self.endings.labels(reason).inc()

    # ---- exposition -------------------------------------------------------------------------

    def render(self) -> tuple[bytes, str]:
        """The text exposition format and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
