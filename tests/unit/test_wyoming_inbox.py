"""The text a Wyoming client streams before the engine's text stream is open (its voice loading, its slot awaited)
waits in a TextInbox and reaches the stream in order, with the close or the cancel that came meanwhile."""

from __future__ import annotations

from cosyvoice_cpu.server.wyoming_audio import TextInbox


class Recorder:
    def __init__(self) -> None:
        self.calls: list[str] = []

    def feed(self, text: str) -> None:
        self.calls.append(text)

    def close(self) -> None:
        self.calls.append("<close>")

    def cancel(self) -> None:
        self.calls.append("<cancel>")


def test_text_before_the_stream_is_handed_over_in_order() -> None:
    inbox = TextInbox()
    inbox.feed("One. ")
    inbox.feed("Two")
    inbox.close()
    stream = Recorder()
    assert inbox.attach(stream) is stream
    assert stream.calls == ["One. ", "Two", "<close>"]
    inbox.cancel()  # after the attach, straight through
    assert stream.calls[-1] == "<cancel>"


def test_a_cancel_before_the_stream_cancels_it_at_once() -> None:
    inbox = TextInbox()
    inbox.feed("Hello")
    inbox.close()
    inbox.cancel()
    stream = inbox.attach(Recorder())
    assert stream.calls == ["Hello", "<cancel>"]


def test_after_the_attach_text_passes_through() -> None:
    inbox = TextInbox()
    stream = inbox.attach(Recorder())
    inbox.feed("a")
    inbox.close()
    assert stream.calls == ["a", "<close>"] and inbox.pending == []
