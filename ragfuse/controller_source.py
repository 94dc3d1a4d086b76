"""The loading controller of a store's delay profile, kept in step with the profile file.

A long-running process (a server, the demo, a framework's shared pipeline) read the profile once,
when it opened the store, so a ``ragfuse profile`` run beside it took effect only after a restart.
Now each fused answer that lets the controller choose its ratio looks at the file (one ``stat``) and
reads it again where it changed: a profile made, replaced or removed is the next answer's.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

from ragfuse.engine.file_stamp import Stamp, file_stamp
from ragfuse.engine.kvstore import LoadingController

# what a profile file gives: the controller built from it, or none and why (a note every answer it
# would have served carries), or none and nothing to say (no profile: answers run at r*)
Controlled = tuple[LoadingController | None, str | None]


class ControllerSource:
    def __init__(self, path: Path, load: Callable[[], Controlled]) -> None:
        """``load`` builds the controller from the profile at ``path`` (or says why there is none)."""
        self.path, self._load = path, load
        self._lock = threading.Lock()  # answers on several threads (a framework's batch) share it
        self._stamp: Stamp | None = file_stamp(path)
        self._value = load()

    def current(self) -> Controlled:
        """The controller of the profile as the file is now."""
        with self._lock:
            stamp = file_stamp(self.path)  # profiles are saved by rename: a new one is a new inode
            if stamp != self._stamp:
                self._stamp, self._value = stamp, self._load()
            return self._value
