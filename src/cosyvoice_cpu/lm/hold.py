"""Pausing a request's decoding: a :class:`Hold` stops the LM scheduler feeding a request after some tokens until
it is released (a streamed sentence holds the LM at its first chunk while that chunk's flow runs)."""

from __future__ import annotations

import threading

from cosyvoice_cpu.errors import need


class Hold:
    """Pauses a request after ``after`` speech tokens until :meth:`release` (see :meth:`LMScheduler.submit`).

    Releasing wakes the scheduler at once (it sleeps while every active row is held); releasing twice, or a hold
    that was never submitted, is harmless.
    """

    def __init__(self, after: int) -> None:
        need(isinstance(after, int) and after >= 0, "hold after", after, "a token count >= 0")
        self.after = after
        self._released = threading.Event()
        self._wake: threading.Condition | None = None  # the scheduler's, set by submit

    def attach(self, wake: threading.Condition) -> None:
        """Wake ``wake`` (a scheduler's condition) at release."""
        self._wake = wake

    @property
    def released(self) -> bool:
        return self._released.is_set()

    def release(self) -> None:
        self._released.set()
        notify(self._wake)


class RelayHold(Hold):
    """A hold for a request submitted before its reader exists (a text stream's next passage, decoded while the
    one before is spoken): pauses after ``after`` tokens until :meth:`hand_over` gives it the reader's hold (from
    then on it pauses as that one does) or None (released)."""

    def __init__(self, after: int) -> None:
        super().__init__(after)
        self._to: Hold | None = None

    @property
    def released(self) -> bool:
        return self._released.is_set() or (self._to is not None and self._to.released)

    def hand_over(self, hold: Hold | None) -> None:
        if hold is None:
            self.release()
            return
        self._to, self.after = hold, hold.after
        hold.attach(self._wake)  # its release wakes the scheduler that holds this one
        notify(self._wake)


def notify(wake: threading.Condition | None) -> None:
    """Notify one waiter of ``wake`` (None: nobody to wake)."""
    if wake is not None:
        with wake:
            wake.notify()
