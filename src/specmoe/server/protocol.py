"""The OpenAI wire format: request bodies in, validated requests out; errors and responses.

Validation is explicit (no framework magic) so that every bad body gets a 4xx with an
OpenAI-style error object that names the offending field, and nothing a client sends can
reach the engine unchecked. Like OpenAI, unknown fields are rejected; a few OpenAI
fields this server does not implement are accepted at their neutral value only
(e.g. `presence_penalty: 0`), so that clients that always send them keep working.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass

from ..base.errors import SpecMoEError
from ..engine.logprobs import MAX_LOGPROBS
from ..engine.sampling import SamplingParams

MAX_BODY_BYTES = 1 << 20  # request bodies above this get 413
MAX_STOP_STRINGS = 4  # as OpenAI
MAX_STOP_CHARS = 1000  # streaming checks each new tail against every stop string
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
# The most tokens one request may generate (specmoe serve --max-output-tokens): what one request
# can cost. A chat without max_tokens filled the demo model's context (1,016 tokens, 3.5 s on 2
# cores, past a client's 10 s when the machine was busy); 512 answers in about 1.7 s there.
DEFAULT_MAX_OUTPUT_TOKENS = 512
SEED_RANGE = (-(2**63), 2**64)  # what torch.Generator.manual_seed takes
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
# what a GET route takes: HEAD wherever GET is (RFC 9110); uvicorn sends a HEAD answer without its body
READ_METHODS = ["GET", "HEAD"]

# Fields OpenAI defines that are accepted only at the value that means "off".
_NEUTRAL = {
    "best_of": (1,),
    "frequency_penalty": (0,),
    "presence_penalty": (0,),
    "logit_bias": ({},),
    "suffix": ("",),
    "response_format": ({"type": "text"},),
    "tools": ([],),
    "tool_choice": ("none",),
}
_COMMON_FIELDS = {
    "model", "max_tokens", "n", "seed", "stop", "stream", "stream_options", "temperature", "top_p", "user",
    "frequency_penalty", "presence_penalty", "logit_bias", "logprobs",
    "top_k", "ignore_eos",  # extensions (vLLM names)
    "specmoe_stats",  # extension: the answer carries the request's own engine statistics
}
COMPLETION_FIELDS = _COMMON_FIELDS | {"prompt", "best_of", "echo", "suffix",
                                      "src_lang", "tgt_lang"}  # extensions: an encoder-decoder model translates
CHAT_FIELDS = _COMMON_FIELDS | {
    "messages", "max_completion_tokens", "top_logprobs", "response_format", "tools", "tool_choice",
    "parallel_tool_calls",
}


class APIError(Exception):
    """An error answered to the client as `{"error": {message, type, param, code}}`."""

    TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
             405: "invalid_request_error", 413: "invalid_request_error", 503: "server_error", 500: "server_error"}

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        kind = self.TYPES.get(self.status, "invalid_request_error" if self.status < 500 else "server_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


def invalid(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param, code)


# --- the body --------------------------------------------------------------------------------


def _reject_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


def _number(text: str) -> float | int:
    """A JSON number with a fraction or exponent; an integral one (`16.0`, `1e3`) is an integer, as
    JSON Schema counts it (the document's `integer` fields take it, like pydantic's and vLLM's)."""
    value = float(text)
    return int(value) if value.is_integer() else value


def parse_json(raw: bytes) -> dict:
    """Bytes -> a JSON object, or a 400 that says what is wrong with them."""
    try:
        body = json.loads(raw, parse_constant=_reject_constant, parse_float=_number)
    except (ValueError, RecursionError) as exc:  # RecursionError: absurdly deep nesting
        detail = "nested too deeply" if isinstance(exc, RecursionError) else str(exc)
        raise invalid(f"the request body is not valid JSON: {detail}") from None
    if not isinstance(body, dict):
        raise invalid(f"the request body must be a JSON object, got {_kind(body)}")
    _check_unicode(body)
    return body


def _check_unicode(body: dict) -> None:
    """A `\\ud800` escape without its pair is valid JSON but no text: the tokenizer cannot take it."""
    try:
        json.dumps(body, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as exc:
        raise invalid(f"the request body holds an unpaired UTF-16 surrogate escape "
                      f"(\\u{ord(exc.object[exc.start]):04x}): send text as valid Unicode") from None


def _kind(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return "an object"


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _get(body: dict, key: str, check, what: str, default=None):
    """body[key] if present and not null (then it must pass `check`), else `default`."""
    value = body.get(key)
    if value is None:
        return default
    if not check(value):
        raise invalid(f"'{key}' must be {what}, got {_kind(value)}: {_short(value)}", key)
    return value


def _short(value) -> str:
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _check_fields(body: dict, allowed: set[str]) -> None:
    for key in body:
        if key not in allowed:
            raise invalid(f"Unrecognized request argument supplied: {key}", key)
    for key, neutral in _NEUTRAL.items():
        value = body.get(key)
        if key in allowed and value is not None and not any(_same(value, n) for n in neutral):
            raise invalid(
                f"'{key}'={_short(value)} is not supported by this server; omit it or send {_short(neutral[0])}", key
            )


def _same(a, b) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    return a == b


# --- requests --------------------------------------------------------------------------------


@dataclass(frozen=True)
class GenerateRequest:
    """One validated completion or chat request, before its prompt is tokenized."""

    kind: str  # "completion" | "chat"
    prompt: str | list[int]
    max_tokens: int | None  # None: as many as the context leaves
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop: tuple[str, ...]
    ignore_eos: bool
    stream: bool
    include_usage: bool
    logprobs: int | None = None  # the chosen token's log-probability and this many alternatives; None: off
    echo: bool = False  # completions: the prompt (and, with logprobs, its log-probabilities) comes back first
    specmoe_stats: bool = False  # the answer (the last chunk of a stream) carries `specmoe_stats`
    src_lang: str | None = None  # an encoder-decoder model: the prompt's language and the one to translate into
    tgt_lang: str | None = None
    max_tokens_param: str = "max_tokens"  # the field max_tokens came in (chat: or max_completion_tokens)

    @property
    def prompt_param(self) -> str:
        return "messages" if self.kind == "chat" else "prompt"

    def sampling_params(self, prompt_len: int, max_model_len: int,
                        max_output_tokens: int | None = None) -> SamplingParams:
        """Sampling params with max_tokens checked against the context the prompt leaves and
        the server's `max_output_tokens` (None: no limit but the context)."""
        room = max_model_len - prompt_len  # the engine needs prompt + output <= context
        if room < 1:
            raise invalid(
                f"This model's maximum context length is {max_model_len} tokens. However, your "
                f"{self.prompt_param} is {prompt_len} tokens long. Please shorten it.",
                self.prompt_param, "context_length_exceeded",
            )
        cap = max_output_tokens if max_output_tokens is not None else max_model_len
        max_tokens = self.max_tokens
        if max_tokens is None:  # chat: as many as the context leaves, up to the server's limit
            max_tokens = min(room, cap) if self.kind == "chat" else min(COMPLETION_DEFAULT_MAX_TOKENS, room, cap)
        elif max_tokens > max_model_len - 1:  # more than any prompt leaves: the document's maximum
            raise invalid(
                f"'{self.max_tokens_param}' must be at most {min(max_model_len - 1, cap)}, got {max_tokens}: this "
                f"model's maximum context length is {max_model_len} tokens and a prompt takes at least one",
                self.max_tokens_param, "context_length_exceeded",
            )
        elif max_tokens > cap:  # the document's maximum too: what one request may cost
            raise invalid(
                f"'{self.max_tokens_param}' must be at most {cap}, got {max_tokens}: this server generates at "
                f"most {cap} tokens a request (specmoe serve --max-output-tokens); ask for fewer",
                self.max_tokens_param,
            )
        # more than this prompt leaves: the answer ends where the context does (finish_reason "length"),
        # as a request for exactly that many would; the document cannot know a prompt's tokens
        max_tokens = min(max_tokens, room)
        # an echoed prompt with logprobs is scored; max_tokens=0 (echo only) is a scoring request
        prompt_logprobs = self.logprobs if self.echo and self.logprobs is not None else None
        if max_tokens == 0 and prompt_logprobs is None:
            prompt_logprobs = 0
        try:
            return SamplingParams(
                max_tokens=max_tokens, temperature=float(self.temperature), top_p=float(self.top_p),
                top_k=self.top_k, seed=self.seed, stop=self.stop, ignore_eos=self.ignore_eos,
                logprobs=self.logprobs, prompt_logprobs=prompt_logprobs,
            )
        except SpecMoEError as exc:  # every field was checked above; this is a safety net
            raise invalid(str(exc)) from None


def check_model(body: dict, served: str) -> None:
    name = _get(body, "model", lambda v: isinstance(v, str), "a string")
    if name is not None and name != served:
        raise APIError(404, f"The model `{name}` does not exist; this server serves `{served}`.", "model",
                       "model_not_found")


def _common(body: dict, kind: str, max_tokens_key: str = "max_tokens", echo: bool = False) -> dict:
    n = _get(body, "n", _is_int, "an integer", 1)
    if n != 1:
        raise invalid(f"'n'={n} is not supported: this server returns one choice per request (n=1)", "n")
    max_tokens = _get(body, max_tokens_key, _is_int, "an integer")
    if max_tokens is not None and max_tokens < (0 if echo else 1):
        raise invalid(f"'{max_tokens_key}' must be at least 1 (0 only with 'echo': true, to score the prompt), "
                      f"got {max_tokens}", max_tokens_key)
    temperature = _get(body, "temperature", _is_number, "a number", 1.0)
    if not 0 <= temperature <= 2:
        raise invalid(f"'temperature' must be between 0 and 2, got {temperature}", "temperature")
    top_p = _get(body, "top_p", _is_number, "a number", 1.0)
    if not 0 < top_p <= 1:
        raise invalid(f"'top_p' must be greater than 0 and at most 1, got {top_p}", "top_p")
    top_k = _get(body, "top_k", _is_int, "an integer", 0)
    if top_k < -1:
        raise invalid(f"'top_k' must be -1 or 0 (no limit) or a positive integer, got {top_k}", "top_k")
    seed = _get(body, "seed", _is_int, "an integer")
    if seed is not None and not SEED_RANGE[0] <= seed < SEED_RANGE[1]:
        raise invalid(f"'seed' must be between {SEED_RANGE[0]} and {SEED_RANGE[1] - 1}", "seed")
    stop = _get(body, "stop", lambda v: isinstance(v, (str, list)), "a string or an array of strings", [])
    stop = [stop] if isinstance(stop, str) else stop
    if len(stop) > MAX_STOP_STRINGS or any(not isinstance(s, str) or not s for s in stop):
        raise invalid(f"'stop' must be a non-empty string or up to {MAX_STOP_STRINGS} non-empty strings", "stop")
    if any(len(s) > MAX_STOP_CHARS for s in stop):
        raise invalid(f"a stop string may have at most {MAX_STOP_CHARS} characters", "stop")
    stream = _get(body, "stream", lambda v: isinstance(v, bool), "a boolean", False)
    options = _get(body, "stream_options", lambda v: isinstance(v, dict), "an object")
    include_usage = False
    if options is not None:
        if not stream:
            raise invalid("'stream_options' is only allowed when 'stream' is true", "stream_options")
        for key in options:
            if key != "include_usage":
                raise invalid(f"Unrecognized stream option: {key}", f"stream_options.{key}")
        include_usage = _get(options, "include_usage", lambda v: isinstance(v, bool), "a boolean", False)
    _get(body, "user", lambda v: isinstance(v, str), "a string")
    ignore_eos = _get(body, "ignore_eos", lambda v: isinstance(v, bool), "a boolean", False)
    specmoe_stats = _get(body, "specmoe_stats", lambda v: isinstance(v, bool), "a boolean", False)
    return dict(
        kind=kind, max_tokens=max_tokens, max_tokens_param=max_tokens_key, temperature=temperature, top_p=top_p,
        top_k=max(top_k, 0), seed=seed, stop=tuple(stop), ignore_eos=ignore_eos, stream=stream,
        include_usage=include_usage, specmoe_stats=specmoe_stats,
    )


def _top_k(body: dict, key: str) -> int | None:
    """A count of alternatives per token: an integer from 0 to MAX_LOGPROBS, or null."""
    k = _get(body, key, _is_int, f"an integer from 0 to {MAX_LOGPROBS}")
    if k is not None and not 0 <= k <= MAX_LOGPROBS:
        raise invalid(f"'{key}' must be between 0 and {MAX_LOGPROBS}, got {k}", key)
    return k


def parse_completion(body: dict, served_model: str) -> GenerateRequest:
    _check_fields(body, COMPLETION_FIELDS)
    echo = _get(body, "echo", lambda v: isinstance(v, bool), "a boolean", False)
    logprobs = None if body.get("logprobs") is False else _top_k(body, "logprobs")
    if body.get("prompt") is None:
        raise invalid("you must provide a prompt (a string or an array of token ids)", "prompt")
    prompt = body["prompt"]
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, list):
        if not all(_is_int(t) for t in prompt):
            raise invalid("'prompt' must be a string or an array of token ids; this server takes one prompt "
                          "per request (send batches as separate requests)", "prompt")
    elif not isinstance(prompt, str):
        raise invalid(f"'prompt' must be a string or an array of token ids, got {_kind(prompt)}", "prompt")
    if not prompt:
        raise invalid("'prompt' is empty: give at least one character or token id", "prompt")
    fields = _common(body, "completion", echo=echo)
    languages = {key: _get(body, key, lambda v: isinstance(v, str), "a language code string such as eng_Latn")
                 for key in ("src_lang", "tgt_lang")}
    check_model(body, served_model)
    return GenerateRequest(prompt=prompt, logprobs=logprobs, echo=echo, **fields, **languages)


def parse_chat(body: dict, served_model: str, tokenizer) -> GenerateRequest:
    _check_fields(body, CHAT_FIELDS)
    messages = _parse_messages(body.get("messages"))
    _get(body, "parallel_tool_calls", lambda v: isinstance(v, bool), "a boolean")
    if body.get("max_completion_tokens") is not None and body.get("max_tokens") is not None:
        raise invalid("give 'max_completion_tokens' or 'max_tokens', not both", "max_tokens")
    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    fields = _common(body, "chat", max_tokens_key=key)
    check_model(body, served_model)
    if tokenizer is None:
        raise invalid("this model has no tokenizer, so it cannot chat; use /v1/completions with token ids",
                      "messages")
    return GenerateRequest(prompt=render_chat(tokenizer, messages), logprobs=_chat_logprobs(body), **fields)


def _chat_logprobs(body: dict) -> int | None:
    """Chat asks with `logprobs: true` and `top_logprobs: k` (OpenAI's chat format)."""
    wanted = _get(body, "logprobs", lambda v: isinstance(v, bool), "a boolean", False)
    k = _top_k(body, "top_logprobs")
    if k is not None and not wanted:
        raise invalid("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    return (k or 0) if wanted else None


def _parse_messages(messages) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise invalid("'messages' must be a non-empty array of {role, content} objects", "messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages.{i}"
        if not isinstance(m, dict):
            raise invalid(f"'{where}' must be an object with 'role' and 'content'", where)
        for key in m:
            if key not in ("role", "content", "name"):
                raise invalid(f"Unrecognized message field supplied: {key}", f"{where}.{key}")
        role = m.get("role")
        if role not in CHAT_ROLES:
            raise invalid(f"'{where}.role' must be one of {', '.join(CHAT_ROLES)}, got {_short(role)}",
                          f"{where}.role")
        content = m.get("content")
        if isinstance(content, list):  # content parts: only text
            parts = []
            for j, part in enumerate(content):
                if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)
                        and set(part) == {"type", "text"}):
                    raise invalid(f"'{where}.content.{j}' must be {{\"type\": \"text\", \"text\": ...}}; "
                                  "this server takes text only", f"{where}.content.{j}")
                parts.append(part["text"])
            content = "".join(parts)
        if not isinstance(content, str):
            raise invalid(f"'{where}.content' must be a string or an array of text parts", f"{where}.content")
        name = _get(m, "name", lambda v: isinstance(v, str), "a string")
        message = {"role": role, "content": content}
        if name is not None:
            message["name"] = name
        out.append(message)
    return out


def fallback_chat_prompt(messages: list[dict]) -> str:
    """The template for models without one: a `role: content` line per message, then `assistant:`."""
    return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"


def render_chat(tokenizer, messages: list[dict]) -> str:
    if not getattr(tokenizer, "chat_template", None):
        return fallback_chat_prompt(messages)
    try:
        return tokenizer.apply_chat_template(messages)
    except Exception as exc:  # a template's own checks (role order, ...) or a template error
        raise invalid(f"the model's chat template rejected these messages: {exc}", "messages") from None


# --- responses -------------------------------------------------------------------------------


def new_id(kind: str) -> str:
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def response(kind: str, rid: str, model: str, text: str, finish_reason: str, use: dict,
             logprobs: dict | None = None) -> dict:
    created = int(time.time())
    if kind == "chat":
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
                  "finish_reason": finish_reason}
        return {"id": rid, "object": "chat.completion", "created": created, "model": model,
                "choices": [choice], "usage": use}
    choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [choice], "usage": use}


def chunk(kind: str, rid: str, model: str, *, text: str | None = None, finish_reason: str | None = None,
          role: bool = False, use: dict | None = None, logprobs: dict | None = None) -> dict:
    """One streamed chunk: a text delta (with its tokens' logprobs), a finish reason, the chat
    role opener, or usage (no choices)."""
    created = int(time.time())
    obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
    out = {"id": rid, "object": obj, "created": created, "model": model}
    if use is not None:
        return {**out, "choices": [], "usage": use}
    if kind == "chat":
        delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
        out["choices"] = [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}]
    else:
        out["choices"] = [{"index": 0, "text": text or "", "logprobs": logprobs, "finish_reason": finish_reason}]
    return out


def sse(obj) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"
