"""Small files written so that a kill leaves the old version or the new one, never half of one."""

from __future__ import annotations

import os


def write(path: str | os.PathLike, content: str | bytes) -> None:
    """Writes `content` to a temporary file beside `path` (named per process), then renames it over `path`."""
    path = os.fspath(path)
    temporary = f"{path}.tmp{os.getpid()}"
    with open(temporary, "wb" if isinstance(content, bytes) else "w", **({} if isinstance(content, bytes)
                                                                          else {"encoding": "utf-8"})) as f:
        f.write(content)
    os.replace(temporary, path)
