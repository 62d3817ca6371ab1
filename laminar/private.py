"""The project's own files are private to the user that runs it.

`private_dir(path)` makes a directory owner-only (0700): created so if missing, and narrowed to 0700 if it exists,
belongs to this user and is open to its group or others (a state directory made before this rule). Used for the
state directory (`LAMINAR_HOME`, `.laminar` by default: the dev stack's Temporal database and its WAL, logs,
dev.json, the local store, the tiny base models, process tables, drill and chaos reports) and for a local object
store's root wherever it is. Everything under an owner-only directory is out of other users' reach whatever its
own mode, so files inside keep their ordinary modes. No secret is written to a file: the relay and metrics tokens
and the Temporal API key reach processes only through their environment (client/settings.py `env()`).
"""

from __future__ import annotations

import os
from pathlib import Path

from laminar.logs import get_logger

log = get_logger(__name__)

PRIVATE_DIR_MODE = 0o700


def private_dir(path: str | os.PathLike[str]) -> Path:
    """`path` as an owner-only directory (module docstring); returns it. OSError if it cannot be made."""
    p = Path(path)
    p.mkdir(mode=PRIVATE_DIR_MODE, parents=True, exist_ok=True)
    st = p.stat()
    if st.st_uid == os.getuid() and st.st_mode & 0o077:
        p.chmod(PRIVATE_DIR_MODE)
        log.info("directory_made_private", path=str(p), mode_was=oct(st.st_mode & 0o777))
    return p
