"""Incremental text of a growing list of token ids, for streaming.

After each engine step a sequence has one or more new tokens. What may be sent to the
client is the decoded text minus anything that could still change or must never be
shown: an incomplete UTF-8 character at the end (decoded as U+FFFD until its last byte
arrives), text from a stop string on, and a tail that might be the start of a stop
string. When the sequence finishes, the rest of the engine's final text is released, so
the streamed pieces add up to exactly the text a non-streamed request returns.
"""

from __future__ import annotations

REPLACEMENT = "\ufffd"


def cut_at_stop(text: str, stops: tuple[str, ...]) -> tuple[str, bool]:
    """(text before the earliest stop string, whether one occurs)."""
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return (text[: min(hits)], True) if hits else (text, False)


def releasable(text: str, stops: tuple[str, ...]) -> str:
    """The prefix of a still-growing text that can be sent now."""
    text, stopped = cut_at_stop(text, stops)
    if stopped:
        return text
    text = text.rstrip(REPLACEMENT)  # bytes of a character that is not complete yet
    hold = 0  # longest tail that is a proper prefix of some stop string
    for stop in stops:
        tail = text[len(text) - min(len(stop) - 1, len(text)):]
        for i in range(len(tail) - hold):  # longest candidate first
            if stop.startswith(tail[i:]):
                hold = len(tail) - i
                break
    return text[: len(text) - hold]


class IncrementalText:
    """Text already sent for one sequence; `update` returns the next piece to send."""

    def __init__(self, tokenizer, stops: tuple[str, ...]):
        self.tokenizer = tokenizer
        self.stops = stops
        self.sent = ""

    def update(self, token_ids: list[int], final_text: str | None = None) -> str:
        """The new text after `token_ids`; pass `final_text` (the engine's) once finished."""
        if self.tokenizer is None:
            return ""
        if final_text is None:
            full = releasable(self.tokenizer.decode(token_ids), self.stops)
        else:
            full = final_text
        # Decoding is prefix-stable for the tokenizers in use, so `full` extends `sent`;
        # if it ever did not, text already sent cannot be taken back, only not repeated.
        piece = full[len(self.sent):]
        self.sent += piece
        return piece
