"""Reading counters from a server's Prometheus `/metrics` page."""

from __future__ import annotations

import re

import httpx

_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)$")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def parse(text: str) -> dict[tuple[str, tuple], float]:
    """{(name, ((label, value), ...)): value} for every sample line."""
    out = {}
    for line in text.splitlines():
        m = _LINE.match(line.strip())
        if not m or line.startswith("#"):
            continue
        labels = tuple(sorted(_LABEL.findall(m.group(2) or "")))
        out[(m.group(1), labels)] = float(m.group(3))
    return out


def scrape(base_url: str, timeout: float = 10.0) -> dict[tuple[str, tuple], float]:
    root = base_url.rstrip("/").removesuffix("/v1")
    r = httpx.get(f"{root}/metrics", timeout=timeout)
    r.raise_for_status()
    return parse(r.text)


def total(samples: dict, name: str, **labels: str) -> float:
    """Sum of a metric over every series whose labels include `labels`."""
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= set(ls))
