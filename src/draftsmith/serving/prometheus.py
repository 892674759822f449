"""Reading counters from a server's Prometheus `/metrics` page."""

from __future__ import annotations

import re

import httpx

from draftsmith.errors import DraftsmithError

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
        try:
            out[(m.group(1), labels)] = float(m.group(3))
        except ValueError:
            continue  # not a sample line (a page that is not Prometheus text)
    return out


def scrape(base_url: str, timeout: float = 10.0) -> dict[tuple[str, tuple], float]:
    root = base_url.rstrip("/").removesuffix("/v1")
    try:
        r = httpx.get(f"{root}/metrics", timeout=timeout)
        r.raise_for_status()
    except httpx.HTTPError as exc:
        raise DraftsmithError(f"cannot read the server's counters at {root}/metrics: {exc}",
                              "serve with an engine that exposes Prometheus metrics (vLLM), "
                              "or measure in the reference engine only") from None
    return parse(r.text)


def total(samples: dict, name: str, **labels: str) -> float:
    """Sum of a metric over every series whose labels include `labels`."""
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= set(ls))
