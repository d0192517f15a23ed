"""The soak's disk fault (a size-limited tmpfs filled, then freed) and the
summary of each fault window: the requests it touched and the tier's
/metrics series during the fault and after it."""

from __future__ import annotations

import errno
import shutil
import subprocess
from pathlib import Path

# fault -> (its end, the tier label it hits)
WINDOWS = {"redis_kill": ("redis_restart", "redis"), "mooncake_kill": ("mooncake_restart", "mooncake"),
           "disk_fill": ("disk_free", "storage")}
COUNTERS = ("errors", "stores_refused", "store_failures", "load_failures", "failed_stores", "reconnects",
            "lookup_timeouts", "allocation_failures", "hits", "stored_bytes", "loaded_bytes")


class DiskFiller:
    """A tmpfs of size_mib at `mount` (root only), the storage tier in its kv/
    directory; fill() writes a file until ENOSPC, free() deletes it."""

    def __init__(self, mount: Path, size_mib: int):
        self.mount = Path(mount)
        self.mount.mkdir(parents=True, exist_ok=True)
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mib}m", "tmpfs", str(self.mount)],
                           capture_output=True, text=True)
        self.mounted = r.returncode == 0
        if not self.mounted:
            print(f"disk fault skipped: cannot mount a tmpfs ({(r.stderr or r.stdout).strip()[:120]})", flush=True)
        self.dir = self.mount / "kv"
        self.dir.mkdir(exist_ok=True)
        self.filler = self.mount / "filler"
        self.filled_bytes = 0

    def fill(self) -> None:
        if not self.mounted:
            return
        chunk = b"\0" * (4 << 20)
        with open(self.filler, "wb", buffering=0) as f:
            try:
                while True:
                    self.filled_bytes += f.write(chunk)
            except OSError as e:
                if e.errno != errno.ENOSPC:
                    raise

    def free(self) -> None:
        self.filler.unlink(missing_ok=True)

    def close(self) -> None:
        if self.mounted:
            subprocess.run(["umount", "-l", str(self.mount)], capture_output=True)
        shutil.rmtree(self.mount, ignore_errors=True)


def _at(samples, t: float) -> dict:
    """The last scrape at or before t (else the first)."""
    best = samples[0][1] if samples else {}
    for ts, tiers in samples:
        if ts > t:
            break
        best = tiers
    return best


def _deltas(samples, tier: str, t0: float, t1: float) -> dict:
    a, b = _at(samples, t0).get(tier, {}), _at(samples, t1).get(tier, {})
    return {k: b.get(k, 0) - a.get(k, 0) for k in COUNTERS if b.get(k, 0) - a.get(k, 0)}


def _min_up(samples, tier: str, t0: float, t1: float):
    ups = [tiers.get(tier, {}).get("server_up") for ts, tiers in samples if t0 <= ts <= t1]
    ups = [u for u in ups if u is not None]
    return min(ups) if ups else None


def _recovered_after(samples, tier: str, t1: float):
    """Seconds from the fault's end to the first scrape with the tier's server_up at 1 (None: never)."""
    for ts, tiers in samples:
        if ts >= t1 and tiers.get(tier, {}).get("server_up") == 1:
            return ts - t1
    return None


def _down_share(samples, tier: str, t0: float, t1: float):
    """Share of the scrapes in [t0, t1] with the tier's server_up at 0."""
    ups = [tiers.get(tier, {}).get("server_up") for ts, tiers in samples if t0 <= ts <= t1]
    ups = [u for u in ups if u is not None]
    return sum(u == 0 for u in ups) / len(ups) if ups else None


def _fmt(d: dict, up=None) -> str:
    parts = [] if up is None else [f"server_up {up:.0f}"]
    for k, v in d.items():
        parts.append(f"{k} +{v / 2**20:.0f} MiB" if k.endswith("bytes") else f"{k} +{v:.0f}")
    return "; ".join(parts) or "no change"


def fault_summary(records, samples, faults: list[tuple[str, float]], start: float) -> dict:
    times = dict(faults)
    end = max((r.end for r in records), default=start)
    rows, spans = [], []
    for fault, (finish, tier) in WINDOWS.items():
        if fault not in times or finish not in times:
            continue
        t0, t1 = times[fault], times[finish]
        later = [t for t in times.values() if t > t1]
        t2 = min([end, t1 + 120.0] + later)  # the recovery window: until the next fault, 2 min at most
        spans.append((t0, t2))
        touched = [r for r in records if r.start < t1 and r.end > t0]
        after = [r for r in records if r.start < t2 and r.end > t1]
        rows.append({
            "fault": f"{fault} .. {finish}", "tier": tier, "window_s": t1 - t0,
            "requests": len(touched), "failed": sum(not r.ok for r in touched),
            "max_gap_s": max((r.max_gap_s for r in touched), default=0.0),
            "max_ttft_s": max((r.ttft_s or 0 for r in touched), default=0.0),
            "during": _fmt(_deltas(samples, tier, t0, t1), _min_up(samples, tier, t0, t1)),
            "after": _fmt(_deltas(samples, tier, t1, t2), _at(samples, t2).get(tier, {}).get("server_up")),
            "after_failed": sum(not r.ok for r in after),
            "after_max_gap_s": max((r.max_gap_s for r in after), default=0.0),
            "recovered_after_s": _recovered_after(samples, tier, t1),
        })
    quiet = [r for r in records if not any(r.start < b and r.end > a for a, b in spans)]
    quiet_down = {t: _down_share([s for s in samples if not any(a <= s[0] <= b for a, b in spans)], t, start, end)
                  for t in ("redis", "mooncake")}
    return {"requests": len(records), "failed_requests": sum(not r.ok for r in records),
            "errors": sorted({r.error for r in records if not r.ok})[:5], "fault_rows": rows,
            "quiet_s": (end - start) - sum(b - a for a, b in spans),
            "quiet_max_gap_s": max((r.max_gap_s for r in quiet), default=0.0),
            "quiet_max_ttft_s": max((r.ttft_s or 0 for r in quiet), default=0.0),
            "max_gap_s": max((r.max_gap_s for r in records), default=0.0),
            "quiet_down_share": quiet_down}


def plot_soak(records, faults: list[tuple[str, float]], start: float, path, title: str) -> None:
    """TTFT and the longest chunk gap of every request over time, fault windows shaded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 3.8))
    ok = [r for r in records if r.ok]
    ax.scatter([r.start - start for r in ok], [r.ttft_s or 0 for r in ok], s=6, label="TTFT")
    ax.scatter([r.start - start for r in ok], [r.max_gap_s for r in ok], s=6, label="longest chunk gap")
    bad = [r for r in records if not r.ok]
    if bad:
        ax.scatter([r.start - start for r in bad], [0] * len(bad), marker="x", color="red", label="failed")
    times = dict(faults)
    for i, (fault, (finish, tier)) in enumerate(WINDOWS.items()):
        if fault in times and finish in times:
            ax.axvspan(times[fault] - start, times[finish] - start, color=f"C{i + 2}", alpha=0.2,
                       label={"redis": "Redis killed", "mooncake": "Mooncake master killed"}.get(tier, "disk full"))
    ax.set_xlabel("seconds into the soak")
    ax.set_ylabel("seconds")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
