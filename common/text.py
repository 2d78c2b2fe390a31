"""Text for log lines and messages that name peers."""
from __future__ import annotations

from collections.abc import Iterable

SHOWN = 8  # peers a log line names before it counts the rest


def few(items: Iterable[object], shown: int = SHOWN) -> str:
    """`items` as a log line names them: all of a few, or the first `shown` and how many more
    (a round of a thousand members that went on without most of them is one line, not 20 KB)."""
    listed = list(items)
    head = ", ".join(str(item) for item in listed[:shown])
    if len(listed) <= shown:
        return f"[{head}]"
    return f"[{head}, and {len(listed) - shown} more]"
