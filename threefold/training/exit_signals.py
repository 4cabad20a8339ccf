"""--exit-signal-handler's recorder (torch-free, so entry points install it first thing: a
signal during start-up, while torch imports or data indices build, is kept, not fatal)."""

from __future__ import annotations

import signal
from types import FrameType

EXIT_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
_INSTALLED: ExitSignalHandler | None = None


class ExitSignalHandler:
    """Records SIGTERM/SIGUSR1 instead of dying; restores the previous handlers on close."""

    def __init__(self) -> None:
        self.received: signal.Signals | None = None
        self._previous = {sig: signal.signal(sig, self._record) for sig in EXIT_SIGNALS}

    def _record(self, signum: int, frame: FrameType | None) -> None:
        self.received = signal.Signals(signum)

    def close(self) -> None:
        global _INSTALLED
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        if _INSTALLED is self:
            _INSTALLED = None


def exit_signal_handler() -> ExitSignalHandler:
    """The process's handler, installed on first use (what it recorded before is kept)."""
    global _INSTALLED
    if _INSTALLED is None:
        _INSTALLED = ExitSignalHandler()
    return _INSTALLED
