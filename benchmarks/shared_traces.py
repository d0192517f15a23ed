"""Where this repository's benchmarks find the shared traces (not part of
the package: a user passes the path of a trace of their own).

$KVOFFLOAD_SHARED_DIR/traces, else ../shared/traces beside the checkout (for
a git worktree, beside the main checkout too).
"""

from __future__ import annotations

import os
from pathlib import Path

CHECKOUT = Path(__file__).resolve().parent.parent


def _checkouts(root: Path) -> list[Path]:
    """The checkout, and the main checkout when it is a git worktree (its
    .git is a file naming .../main/.git/worktrees/NAME)."""
    out = [root]
    try:
        text = (root / ".git").read_text()
    except OSError:
        return out  # a plain checkout (.git a directory) or none
    if text.startswith("gitdir:"):
        gitdir = Path(text.split(":", 1)[1].strip())
        if gitdir.parent.name == "worktrees":
            out.append(gitdir.parent.parent.parent)
    return out


def shared_trace_path(name: str = "mooncake_conversation_trace.jsonl", root: Path = CHECKOUT) -> Path:
    """The shared trace `name`: under $KVOFFLOAD_SHARED_DIR/traces when that is
    set and holds it, else under ../shared/traces beside the checkout (the
    first candidate is returned when none holds it, so the caller's error
    names a path)."""
    candidates = [c.parent / "shared" for c in _checkouts(root)]
    if os.environ.get("KVOFFLOAD_SHARED_DIR"):
        candidates.insert(0, Path(os.environ["KVOFFLOAD_SHARED_DIR"]))
    for base in candidates:
        if (base / "traces" / name).exists():
            return base / "traces" / name
    return candidates[0] / "traces" / name
