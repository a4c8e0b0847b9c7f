"""Typed lines for `lily chat` run in the test's own process."""


def feed_input(monkeypatch, lines) -> None:
    """input() returns these lines, then raises EOFError (Ctrl-D): drives `lily chat` in the test's process."""
    it = iter(lines)

    def fake_input(prompt=""):
        try:
            return next(it)
        except StopIteration:
            raise EOFError from None

    monkeypatch.setattr("builtins.input", fake_input)
