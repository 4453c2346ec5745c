"""Prometheus metrics (prometheus-client), named like vLLM's with a `kvserve:` prefix.

One registry per app (no module-level state). Counters and histograms are updated as
requests run; gauges that describe the engines, the pool, the tiers and the sessions are
read when /metrics is scraped, so they are never stale.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncIterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from server.engine.request import Event, Failed, Finished, TextDelta

# Up to 30 minutes: on a CPU a long prompt's first token, or a long answer, takes minutes, not 40 s.
LATENCY_BUCKETS = (
    *(0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0),
    *(60.0, 120.0, 300.0, 600.0, 1200.0, 1800.0),
)


class Metrics:
    def __init__(self, host, generation_routes: tuple[str, ...]) -> None:
        """`generation_routes`: the paths whose refused requests count as failures (server/serving/apis.py)."""
        self.generation_routes = generation_routes
        self.registry = CollectorRegistry()
        r = self.registry
        self.http_requests = Counter(
            "kvserve:http_requests", "HTTP requests by route and status", ["route", "status"], registry=r
        )
        self.ttft = Histogram(
            "kvserve:time_to_first_token_seconds", "Time to first token", ["model"], buckets=LATENCY_BUCKETS, registry=r
        )
        self.itl = Histogram(
            "kvserve:inter_token_latency_seconds",
            "Time between output tokens",
            ["model"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "kvserve:e2e_request_latency_seconds", "Request latency", ["model"], buckets=LATENCY_BUCKETS, registry=r
        )
        self.prompt_computed = Counter(
            "kvserve:prompt_tokens_computed", "Prompt tokens fed to the model", ["model"], registry=r
        )
        self.prompt_cached = Counter(
            "kvserve:prompt_tokens_cached", "Prompt tokens reused from cached K/V (any tier)", ["model"], registry=r
        )
        self.generation = Counter("kvserve:generation_tokens", "Generated tokens", ["model"], registry=r)
        self.finished = Counter(
            "kvserve:request_success", "Requests finished, by finish reason", ["model", "finish_reason"], registry=r
        )
        self.failed = Counter("kvserve:request_failure", "Requests failed, by code", ["model", "code"], registry=r)
        r.register(_StateCollector(host))

    def on_response(self, route: str, status: int, seconds: float) -> None:
        self.http_requests.labels(route, str(status)).inc()

    def on_refused(self, route: str, model: str, code: str) -> None:
        """A generation request answered with an error before it ran (a 400 included): a failure too."""
        if route in self.generation_routes:
            self.failed.labels(model, code).inc()

    async def meter(self, events: AsyncIterator[Event], model: str, started: float) -> AsyncIterator[Event]:
        """Pass a request's events through, timing its tokens and counting its usage."""
        last = None
        async for event in events:
            now = time.monotonic()
            if isinstance(event, TextDelta) and event.token_ids:
                if last is None:
                    self.ttft.labels(model).observe(now - started)
                else:
                    gap = (now - last) / len(event.token_ids)
                    for _ in event.token_ids:
                        self.itl.labels(model).observe(gap)
                last = now
            elif isinstance(event, Finished):
                usage = event.usage
                self.prompt_computed.labels(model).inc(usage.prompt_tokens - usage.cached_tokens)
                self.prompt_cached.labels(model).inc(usage.cached_tokens)
                self.generation.labels(model).inc(usage.completion_tokens)
                self.finished.labels(model, event.finish_reason).inc()
                self.e2e.labels(model).observe(now - started)
            elif isinstance(event, Failed):
                self.failed.labels(model, event.code).inc()
            yield event

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _StateCollector:
    """Gauges read at scrape time from the engines, the pool, the tiers and the session store."""

    def __init__(self, host) -> None:
        self.host = host

    def describe(self):
        return []

    def collect(self):
        host = self.host
        running = GaugeMetricFamily("kvserve:num_requests_running", "Requests in the engine", labels=["model"])
        waiting = GaugeMetricFamily("kvserve:num_requests_waiting", "Requests queued", labels=["model"])
        usage = GaugeMetricFamily(
            "kvserve:kv_cache_usage_perc", "Pool blocks held by running requests", labels=["model"]
        )
        kv_bytes = GaugeMetricFamily("kvserve:kv_cache_bytes", "K/V bytes held, by tier", labels=["tier"])
        evictions = CounterMetricFamily("kvserve:kv_evictions", "K/V moved down or dropped, by tier", labels=["tier"])
        device_bytes = device_evictions = 0
        for model_id, engine in list(host.engines.items()):  # the loader thread may add one meanwhile
            stats = engine.stats
            running.add_metric([model_id], stats.num_running)
            waiting.add_metric([model_id], engine.num_queued)
            usage.add_metric([model_id], stats.num_blocks_used / stats.num_blocks)
            device_bytes += (stats.num_blocks_used + stats.num_blocks_cached) * engine.block_bytes
            device_evictions += stats.num_evictions
        evictions.add_metric(["device"], device_evictions)
        tiers = host.tiers.totals()
        kv_bytes.add_metric(["device"], device_bytes)
        kv_bytes.add_metric(["host"], tiers.host_bytes)
        kv_bytes.add_metric(["disk"], tiers.disk_bytes)
        evictions.add_metric(["host"], tiers.num_demoted["disk"])
        evictions.add_metric(["disk"], tiers.num_demoted["dropped"])
        failed = CounterMetricFamily(
            "kvserve:kv_snapshot_write_failures", "K/V snapshots the disk did not take (dropped, recomputed later)"
        )
        failed.add_metric([], tiers.num_failed_writes)
        sessions = GaugeMetricFamily("kvserve:sessions", "Live sessions, by kind", labels=["kind"])
        for kind, count in sorted(host.store.counts().items()):
            sessions.add_metric([kind], count)
        yield from (running, waiting, usage, kv_bytes, evictions, failed, sessions)
        if host.store.leases.is_up is not None:
            shared = GaugeMetricFamily("kvserve:shared_store_up", "1 when the shared store (Redis) answers, else 0")
            shared.add_metric([], 1.0 if host.store.leases.is_up else 0.0)
            yield shared
        stores = [s for s in (host.tiers.disk.store if host.tiers.disk else None, host.tiers.shared) if s is not None]
        if stores:
            blocks = CounterMetricFamily(
                "kvserve:kv_store_blocks",
                "K/V blocks through the block store, by tier (disk, shared) and outcome: queued (to the writer), "
                "written, skipped (already there), read, refused (failed its check: recomputed), failed (the disk or "
                "Redis did not answer)",
                labels=["tier", "outcome"],
            )
            for store in stores:
                for outcome, count in dataclasses.asdict(store.stats).items():
                    blocks.add_metric([store.origin, outcome.removeprefix("num_")], count)
            yield blocks
