"""`kvoffload stats`: a live per-tier table scraped from a /metrics endpoint
(the replay's --metrics-port, or any engine exporting our series).

Its hit rate is the *lookup hit rate*: hits / lookups of that tier's
manager. The scheduler looks a request's blocks up one by one only until
the first miss, so it is higher than the *prefix hit rate* that `kvoffload
replay` reports (blocks served / all prompt blocks referenced). The replay
prints both per tier, with the same definitions."""

from __future__ import annotations

import http.client
import math
import sys
import time
import urllib.request
from collections import defaultdict
from urllib.parse import urlsplit, urlunsplit

from kvoffload.redact import redact_text

COLUMNS = ("lookups", "hits", "misses", "lookup_hit_rate", "stored_blocks", "loaded_blocks",
           "evictions", "dropped_stores", "checksum_failures", "used_blocks", "usage")


def parse_metrics(text: str) -> dict[str, dict[str, float]]:
    """Per tier, the latest value of each kvoffload_* counter and gauge."""
    from prometheus_client.parser import text_string_to_metric_families

    tiers: dict[str, dict[str, float]] = defaultdict(dict)
    for family in text_string_to_metric_families(text):
        if not family.name.startswith("kvoffload_") or family.type not in ("counter", "gauge"):
            continue
        stat = family.name[len("kvoffload_"):]
        for sample in family.samples:
            if sample.name.endswith("_created") or "tier" not in sample.labels:
                continue
            tiers[sample.labels["tier"]][stat] = sample.value
    for t in tiers.values():
        t["lookup_hit_rate"] = lookup_hit_rate(t)
    return dict(tiers)


def lookup_hit_rate(counters: dict[str, float]) -> float:
    """hits / lookups of one tier's manager (a lookup answers hit, miss,
    pending or retry); lookups counted from those when not exported."""
    n = counters.get("lookups")
    if n is None:
        n = sum(counters.get(k, 0) for k in ("hits", "misses", "hits_pending", "retries"))
    return counters.get("hits", 0) / n if n else 0.0


def format_table(tiers: dict[str, dict[str, float]]) -> str:
    header = ["tier", *COLUMNS]
    rows = [header]
    for name in sorted(tiers):
        t = tiers[name]
        cells = [name]
        for c in COLUMNS:
            v = t.get(c, 0.0)
            if not math.isfinite(v):  # a NaN or +Inf gauge is valid exposition format: show it
                cells.append(str(v))
            else:
                cells.append(f"{v:.3f}" if c in ("lookup_hit_rate", "usage") else f"{int(v):,}")
        rows.append(cells)
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    return "\n".join("  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths)))
                     for r in rows) + "\nlookup_hit_rate: hits / lookups per tier (not the replay's prefix hit rate)"


INTERVAL_MAX_S = 365 * 86400  # time.sleep overflows past time_t


def scrape(url: str, timeout: float = 5.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return resp.read().decode()


def metrics_url(given: str) -> str:
    """The /metrics URL of `host:port` or a URL; ValueError saying what is wrong."""
    parts = urlsplit(given if "://" in given else f"http://{given}")  # ValueError: a broken IPv6 host
    parts.port  # noqa: B018 - parses the port: ValueError when not a number or out of range
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError("expected host:port or an http(s):// URL")
    if not parts.path.rstrip("/").endswith("/metrics"):  # before any ?query, not after it
        parts = parts._replace(path=parts.path.rstrip("/") + "/metrics")
    return urlunsplit(parts)


def run(args) -> int:
    if not (math.isfinite(args.interval) and 0 < args.interval <= INTERVAL_MAX_S):
        print(f"kvoffload stats: --interval must be a number of seconds in (0, {INTERVAL_MAX_S}], "
              f"got {args.interval!r}", file=sys.stderr)
        return 2
    try:
        url = metrics_url(args.url)
    except ValueError as e:
        print(redact_text(f"kvoffload stats: bad URL {args.url!r}: {e}"), file=sys.stderr)
        return 2
    while True:
        try:
            table = format_table(parse_metrics(scrape(url)))
        except (OSError, ValueError, http.client.HTTPException) as e:
            # ValueError: not UTF-8, or not Prometheus text (an HTML page on that port)
            why = " ".join(str(e).split())[:200] or type(e).__name__
            print(redact_text(f"kvoffload stats: cannot scrape {url}: {why}"), file=sys.stderr)
            if args.once:
                return 1
            table = None
        if table is not None:
            if not args.once:
                print("\x1b[2J\x1b[H", end="")  # clear screen for the live view
            print(time.strftime("%H:%M:%S"), url)
            print(table, flush=True)
        if args.once:
            return 0
        time.sleep(args.interval)


def add_parser(sub) -> None:
    p = sub.add_parser("stats")  # its help line: kvoffload.cli.COMMANDS
    p.add_argument("url", help="host:port or URL of a /metrics endpoint (e.g. the replay's --metrics-port)")
    p.add_argument("--interval", type=float, default=2.0, help="seconds between refreshes")
    p.add_argument("--once", action="store_true", help="print one table and exit")
    p.set_defaults(func=run)
