"""RoutingPolicy: how the Ray ingress picks a replica for a request (the --routing knob's values).

Owns the names only, so that the CLI (api/cli.py) names them without importing the Ray room;
api/ray/routing.py implements them.
"""

from __future__ import annotations

import enum


class RoutingPolicy(str, enum.Enum):
    PREFIX_AWARE = "prefix_aware"
    ROUND_ROBIN = "round_robin"
    LEAST_LOADED = "least_loaded"
