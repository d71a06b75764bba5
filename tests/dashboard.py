"""The Grafana dashboard in deploy/observability/: the pdserve metrics its panels query."""

from __future__ import annotations

import json
import re
from pathlib import Path

DASHBOARD = Path(__file__).resolve().parents[1] / "deploy" / "observability" / "grafana-dashboard.json"


def dashboard_metrics() -> set[str]:
    """The metric names the dashboard's panels query (PromQL identifiers starting pdserve_); every panel
    must query at least one."""
    names: set[str] = set()
    for panel in json.loads(DASHBOARD.read_text())["panels"]:
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            found = set(re.findall(r"\b(pdserve_[a-z0-9_]+)\b", target["expr"]))
            assert found, f"{panel['title']}: a query with no pdserve metric"
            names |= found
    return names
