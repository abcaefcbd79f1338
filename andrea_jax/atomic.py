"""Small files written so that a kill leaves the old version or the new one, never half of one."""

from __future__ import annotations

import os


def write(path: str | os.PathLike, content: str | bytes, temporary_name: str | None = None) -> None:
    """Writes `content` to a temporary file beside `path` (named per process), then renames it over `path`.

    `temporary_name`: the temporary file's name in the same directory, for directories whose readers
    take every file whose name resembles `path` (default: `path` + ".tmp<pid>")."""
    path = os.fspath(path)
    temporary = (f"{path}.tmp{os.getpid()}" if temporary_name is None
                 else os.path.join(os.path.dirname(path), temporary_name))
    with open(temporary, "wb" if isinstance(content, bytes) else "w", **({} if isinstance(content, bytes)
                                                                          else {"encoding": "utf-8"})) as f:
        f.write(content)
    os.replace(temporary, path)
