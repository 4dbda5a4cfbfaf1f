"""Log-probabilities in OpenAI's two wire formats, written as a request's tokens arrive.

Legacy completions (`logprobs: k`): parallel lists `tokens`, `token_logprobs`,
`top_logprobs` (a dict of the k most likely tokens' texts, and the chosen token's, to
their log-probabilities; a text two tokens share keys the less likely one as
`token_id:N`) and `text_offset` (where each token's text starts, counted from
the start of the returned text: the prompt's when echoed). The first prompt token has no
log-probability (null). Chat (`logprobs: true, top_logprobs: k`): `{"content": [{token,
logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}`.

A token's text is what it adds after the tokens before it (engine values come from
engine/logprobs.py: the full model's log-softmax).
"""

from __future__ import annotations


class LogprobsWriter:
    """One request's log-probabilities; `add` formats the next tokens (a streamed chunk's
    or all of them), continuing the text offsets and the context of the previous call."""

    def __init__(self, tokenizer, kind: str, context: list[int] | None = None):
        self.tokenizer = tokenizer
        self.kind = kind
        self.context = list(context or [])
        self.offset = 0

    def text(self, token: int) -> str:
        if self.tokenizer is None:  # a checkpoint without a tokenizer: name the id
            return f"token_id:{token}"
        return self.tokenizer.token_text(self.context, token)

    def add(self, ids: list[int], entries: list) -> dict:
        """`entries[i]`: the TokenLogprobs of `ids[i]`, or None (the first prompt token)."""
        if self.kind == "chat":
            return {"content": [self._chat_entry(t, e) for t, e in zip(ids, entries)], "refusal": None}
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for token, entry in zip(ids, entries):
            name = self.text(token)
            out["tokens"].append(name)
            out["text_offset"].append(self.offset)
            out["token_logprobs"].append(None if entry is None else entry.logprob)
            out["top_logprobs"].append(None if entry is None else self._top_dict(entry))
            self.offset += len(name)
            self.context.append(token)
        return out

    def _top_dict(self, entry) -> dict[str, float]:
        """Text -> log-probability, most likely first; a token whose text an earlier (likelier)
        one already has, such as two halves of different multi-byte characters, is keyed
        `token_id:N` so that no value is lost or overwritten."""
        top: dict[str, float] = {}
        for token, logprob in entry.top_dict().items():
            key = self.text(token)
            top["token_id:%d" % token if key in top else key] = logprob
        return top

    def _chat_entry(self, token: int, entry) -> dict:
        top = [self._chat_token(t, lp) for t, lp in entry.top]
        item = {**self._chat_token(token, entry.logprob), "top_logprobs": top}
        self.context.append(token)
        return item

    def _chat_token(self, token: int, logprob: float) -> dict:
        text = self.text(token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def merge(parts: list[dict]) -> dict | None:
    """Several `add` results of one request as one object (None when there are none)."""
    if not parts:
        return None
    out = {key: [] for key in parts[0] if key != "refusal"}
    for part in parts:
        for key in out:
            out[key].extend(part[key])
    return {**out, "refusal": None} if "content" in out else out
