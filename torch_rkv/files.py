"""Writing the files torch_rkv caches (sensitivity profiles, codebooks, allocations): whole or not at all,
so that a reader, another process among them, never sees one half written."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def write_text_atomic(path, text: str) -> None:
    """Write `text` to `path` through a temporary file in the same folder and a rename (folders made)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
