"""Subprocess runs started together, so that the machine's second core works too.

A command-line run here is mostly one core importing torch, or ranks waiting for a timeout to
fire: run one test at a time, the other core idles. A module starts the runs its selected tests
check (`selected`) in one `Runs` (a context manager), `jobs` at a time, and each test waits for
its own. Each run keeps its own clock (the function it calls times itself), so a refusal's
seconds stay its own.

Not for runs whose function sets a preexec_fn (subprocess does not allow one beside threads).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from concurrent.futures import Future, ThreadPoolExecutor


class Runs:
    def __init__(self, jobs: int = 2) -> None:
        self._pool = ThreadPoolExecutor(jobs, thread_name_prefix="run")
        self._futures: dict[Hashable, Future] = {}

    def start(self, key: Hashable, fn: Callable, *args, **kwargs) -> None:
        self._futures[key] = self._pool.submit(fn, *args, **kwargs)

    def result(self, key: Hashable):
        """`fn`'s return value (or its exception) for `key`, once that run has ended."""
        if key not in self._futures:
            raise KeyError(f"no run was started for {key!r}: see tests/concurrent_runs.py")
        return self._futures[key].result()

    def close(self) -> None:
        """Runs not yet started never start; running ones end under their own timeouts."""
        self._pool.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> Runs:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def run_together(fn: Callable, calls: dict[Hashable, tuple], jobs: int = 2) -> dict:
    """{key: fn(*calls[key])}, `jobs` calls at a time."""
    with Runs(jobs) as runs:
        for key, args in calls.items():
            runs.start(key, fn, *args)
        return {key: runs.result(key) for key in calls}


def _items(request, test: str) -> list:
    return [
        item
        for item in request.session.items
        if item.path == request.path and getattr(item, "originalname", None) == test
    ]


def selected(request, test: str, parameter: str) -> list:
    """The values of `parameter` for which this session runs `test` of the requesting module,
    in order: what a module-scoped fixture starts for it (and no more, under `-k`)."""
    return [item.callspec.params[parameter] for item in _items(request, test)]


def runs_test(request, test: str) -> bool:
    """Whether this session runs (unparametrized) `test` of the requesting module."""
    return bool(_items(request, test))
