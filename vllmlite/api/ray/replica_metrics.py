"""One Prometheus page from many replicas' pages: every sample gains a `replica` label.

Owns the merge: a prometheus-client collector over the replicas' parsed pages, in which each family
keeps one HELP and TYPE and its samples keep their own labels; prometheus-client writes the text.
Knows nothing of Ray or of which metrics exist.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families


class ReplicaPagesCollector:
    """The families of `pages` (None pages are skipped), each once, in the order first seen; the
    samples of `pages[i]` labelled `replica="i"`, in page order."""

    def __init__(self, pages: Sequence[str | None]) -> None:
        self._pages = pages

    def collect(self) -> Iterator[Metric]:
        families: dict[str, Metric] = {}
        for replica, page in enumerate(self._pages):
            if page is None:
                continue
            for family in text_string_to_metric_families(page):
                merged = families.setdefault(family.name, Metric(family.name, family.documentation, family.type))
                for sample in family.samples:
                    merged.add_sample(sample.name, {**sample.labels, "replica": str(replica)}, sample.value)
        yield from families.values()


def merge_replica_metrics(pages: Sequence[str | None]) -> str:
    """The samples of `pages[i]` labelled `replica="i"`, grouped by family; None pages are skipped.

    >>> page = '# HELP x_total Things.\\n# TYPE x_total counter\\nx_total{model_name="m"} 2.0\\n'
    >>> print(merge_replica_metrics([page, None, page]), end="")
    # HELP x_total Things.
    # TYPE x_total counter
    x_total{model_name="m",replica="0"} 2.0
    x_total{model_name="m",replica="2"} 2.0
    """
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ReplicaPagesCollector(pages))
    return generate_latest(registry).decode()
