"""One Prometheus page from many replicas' pages: every sample gains a `replica` label.

Owns the merge (families keep one HELP and TYPE line; samples keep their own labels). Knows nothing of
Ray or of which metrics exist: it reads and writes the text format only.
"""

from __future__ import annotations

from collections.abc import Sequence

from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.utils import floatToGoString


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(labels: dict[str, str]) -> str:
    return ",".join(f'{name}="{_escape(value)}"' for name, value in labels.items())


def merge_replica_metrics(pages: Sequence[str | None]) -> str:
    """The samples of `pages[i]` labelled `replica="i"`, grouped by family; None pages are skipped.

    >>> page = '# HELP x_total Things.\\n# TYPE x_total counter\\nx_total{model_name="m"} 2.0\\n'
    >>> print(merge_replica_metrics([page, None, page]), end="")
    # HELP x_total Things.
    # TYPE x_total counter
    x_total{model_name="m",replica="0"} 2.0
    x_total{model_name="m",replica="2"} 2.0
    """
    families: dict[str, tuple[str, str, list[str]]] = {}
    for replica, page in enumerate(pages):
        if page is None:
            continue
        for family in text_string_to_metric_families(page):
            _, _, lines = families.setdefault(family.name, (family.type, family.documentation, []))
            for sample in family.samples:
                labels = {**sample.labels, "replica": str(replica)}
                lines.append(f"{sample.name}{{{_labels(labels)}}} {floatToGoString(sample.value)}")
    out: list[str] = []
    for name, (kind, documentation, lines) in families.items():
        help_text = documentation.replace("\\", "\\\\").replace("\n", "\\n")
        name += "_total" if kind == "counter" else ""  # as prometheus_client's own text format names it
        out += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", *lines]
    return "\n".join(out) + "\n" if out else ""
