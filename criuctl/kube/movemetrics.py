"""The controller's Prometheus metrics: PodMigrations by the phase they entered and how they
ended, the moved jobs' downtime, the bytes moved. The controller serves them on its health port
(`/metrics`), behind its scrape credential when it has one (`--metrics-token-file`): what a
dashboard of moves needs without asking every node's agent, which counts its own side of each."""

from __future__ import annotations

import hmac

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest

DOWNTIME_BUCKETS = (0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 60, 120, 300)


class MoveMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        self.registry = reg = CollectorRegistry()
        by_phase = ["phase"]
        self.phases = Counter("criuctl_podmigration_phases", "Phases entered", by_phase, registry=reg)
        self.ended = Counter("criuctl_podmigrations_ended", "Ended, by phase", by_phase, registry=reg)
        self.downtime = Histogram(
            "criuctl_podmigration_downtime_seconds",
            "How long a moved pod's job did not run (its source agent's measure)",
            buckets=DOWNTIME_BUCKETS,
            registry=self.registry,
        )
        self.bytes = Counter("criuctl_podmigration_bytes_moved", "Bytes moved by PodMigrations", registry=reg)

    def page(self) -> bytes:
        return generate_latest(self.registry)


def authorized(header: str, token: str | None) -> bool:
    """The request's `Authorization` header opens /metrics: any, where no scrape token is set."""
    if token is None:
        return True
    given = header.removeprefix("Bearer ").strip() if header.startswith("Bearer ") else ""
    return bool(given) and hmac.compare_digest(given.encode(), token.encode())


METRICS = MoveMetrics()  # one controller per process
