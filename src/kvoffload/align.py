"""The alignment every host-pool chunk and storage slot keeps (O_DIRECT and
page alignment). A leaf module: it imports nothing of kvoffload, so the pool
and the tier contracts can both use it without importing each other."""

ALIGN = 4096  # O_DIRECT and page alignment


def align_up(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a
