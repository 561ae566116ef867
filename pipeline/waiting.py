"""Waiting for a condition: the one poll-until-deadline helper of ddiloco, on ``tenacity``.

Every "wait until a server answers / a process exits / a key appears" of the project goes
through :func:`wait_until` (raises on timeout) or :func:`poll_until` (returns the last, falsy
value on timeout), so the deadline, the interval and the error text are written once. Network
retries of the store use redis-py's ``Retry`` instead (``ddiloco.store.connect``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

import tenacity

from ddiloco.pipeline.errors import DDilocoError

__all__ = ["WaitTimeout", "poll_until", "wait_until"]

T = TypeVar("T")


class WaitTimeout(DDilocoError, TimeoutError):
    """A condition did not hold within its deadline; the message names what was awaited."""


def poll_until(
    condition: Callable[[], T],
    *,
    timeout_s: float | None,
    interval_s: float = 0.1,
    retry_on: tuple[type[BaseException], ...] = (),
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> T:
    """Call ``condition`` every ``interval_s`` seconds until it returns a truthy value.

    Args:
        condition: called with no arguments; its first truthy result is returned. An exception
            it raises ends the wait and propagates, unless it is one of ``retry_on``.
        timeout_s: give up after this many seconds (``None``: never). ``condition`` is always
            called at least once, and once more at the deadline.
        interval_s: pause between two calls, seconds.
        retry_on: exception types that count as "not yet" (e.g. ``ConnectionError`` while a
            server starts); the last one is raised if the deadline passes on it.
        clock: monotonic clock in seconds (injectable for tests).
        sleep: how to pause (injectable for tests).

    Returns:
        The first truthy result, or the last (falsy) result when ``timeout_s`` passed.
    """
    deadline = None if timeout_s is None else clock() + max(0.0, timeout_s)

    def stop(_: tenacity.RetryCallState) -> bool:
        return deadline is not None and clock() >= deadline

    def wait(_: tenacity.RetryCallState) -> float:
        if deadline is None:
            return interval_s
        # Never sleep past the deadline: the last call happens at it.
        return max(0.0, min(interval_s, deadline - clock()))

    retry: tenacity.retry_base = tenacity.retry_if_result(lambda value: not value)
    if retry_on:
        retry = retry | tenacity.retry_if_exception_type(retry_on)

    def last_outcome(state: tenacity.RetryCallState) -> T:
        assert state.outcome is not None
        return state.outcome.result()  # the last value, or the last retry_on exception

    retrying: tenacity.Retrying = tenacity.Retrying(
        retry=retry, stop=stop, wait=wait, sleep=sleep, retry_error_callback=last_outcome)
    return retrying(condition)


def wait_until(
    condition: Callable[[], T],
    *,
    timeout_s: float | None,
    what: str,
    interval_s: float = 0.1,
    retry_on: tuple[type[BaseException], ...] = (),
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> T:
    """:func:`poll_until`, raising when the deadline passes.

    Args:
        what: what is awaited, for the error ("redis-server to accept connections").
        (others as :func:`poll_until`)

    Returns:
        The first truthy result of ``condition``.

    Raises:
        WaitTimeout: ``condition`` stayed falsy (or kept raising one of ``retry_on``) for
            ``timeout_s`` seconds.
    """
    try:
        value = poll_until(condition, timeout_s=timeout_s, interval_s=interval_s,
                           retry_on=retry_on, clock=clock, sleep=sleep)
    except retry_on as exc:
        raise WaitTimeout(f"timed out after {timeout_s:g} s waiting for {what}: "
                          f"{type(exc).__name__}: {exc}") from exc
    if not value:
        raise WaitTimeout(f"timed out after {timeout_s:g} s waiting for {what}")
    return value
