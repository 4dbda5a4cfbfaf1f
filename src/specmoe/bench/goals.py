"""When a benchmark's goal counts as met: one rule for every section.

A goal on a ratio of two timed figures (tokens/s of one runner over another's) is met
only where the lower end of the ratio's interval clears it, the interval coming from at
least MIN_REPEATS timed repeats of each runner, interleaved (each round runs every runner
once, so a shared machine's drift falls on both alike). From a record's repeats the
interval is [a's slowest ÷ b's fastest, a's fastest ÷ b's slowest]: every repeat of one
against every repeat of the other. A median above the goal from one repeat, or from
runners timed one after another, is a measurement, not a met goal: the verdict says what
is missing.
"""

from __future__ import annotations

from dataclasses import dataclass

MIN_REPEATS = 3
NOT_INTERLEAVED = "rounds not interleaved"  # what suite.py's note says of runners timed one after another


@dataclass(frozen=True)
class Verdict:
    met: bool
    text: str  # "met", "not met", or "not met: <what the rule is missing>"

    def __str__(self) -> str:
        return self.text


def judge(low: float, goal: float, repeats: int, interleaved: bool) -> Verdict:
    """Whether a ratio whose interval over `repeats` repeats starts at `low` meets `goal` (at least)."""
    if repeats < MIN_REPEATS:
        return Verdict(False, f"not met: {repeats} repeat{'s' if repeats != 1 else ''}, the rule needs "
                              f"{MIN_REPEATS} interleaved")
    if not interleaved:
        return Verdict(False, f"not met: {NOT_INTERLEAVED}")
    return Verdict(low >= goal, "met" if low >= goal else "not met")


def repeat_range(record: dict, key: str = "decode_tokens_per_s") -> tuple[float, float, int]:
    """(slowest, fastest, repeats) of a bench record's timed repeats; a record that ran
    once, or kept no summary of its repeats, counts as one repeat of its one figure."""
    over = (record.get("over_repeats") or {}).get(key)
    if not over:
        return record[key], record[key], 1
    return over["min"], over["max"], int(record.get("repeats", 1))


def ratio_interval(a: dict, b: dict, key: str = "decode_tokens_per_s") -> tuple[float, float, int]:
    """(low, high, repeats) of a[key] / b[key] over both records' repeats; repeats: the fewer."""
    a_low, a_high, a_n = repeat_range(a, key)
    b_low, b_high, b_n = repeat_range(b, key)
    return a_low / b_high, a_high / b_low, min(a_n, b_n)


def judge_records(a: dict, b: dict, goal: float, interleaved: bool, key: str = "decode_tokens_per_s") -> Verdict:
    """The verdict on a[key] / b[key] >= goal from the two records' repeats."""
    low, _, repeats = ratio_interval(a, b, key)
    return judge(low, goal, repeats, interleaved)


def interval_text(a: dict, b: dict, interleaved: bool, key: str = "decode_tokens_per_s") -> str:
    """The interval a verdict stands on, e.g. "3 interleaved repeats: 0.96-1.04", "1 repeat"."""
    low, high, repeats = ratio_interval(a, b, key)
    if repeats == 1:
        return "1 repeat"
    return f"{repeats} {'interleaved ' if interleaved else ''}repeats{'' if interleaved else ', not interleaved'}: " \
           f"{low:.2f}-{high:.2f}"


def interleaved(doc: dict, where: str) -> bool:
    """Whether a bench document's group `where` ("B=16", "ablation draft-split, B=16") ran
    its runners side by side, rounds interleaved (suite.py notes the groups that did not)."""
    return not any(note.startswith(f"{where}:") and NOT_INTERLEAVED in note for note in doc.get("notes", []))
