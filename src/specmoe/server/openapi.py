"""The API's OpenAPI document, served at /openapi.json: this server as it is, for the model it serves.

Written out by hand (the handlers validate bodies themselves, protocol.py) in OpenAI's
terms, narrowed to this server and this model: one model name, n = 1, the OpenAI fields
it does not implement only at their neutral value, `src_lang` / `tgt_lang` (with the
model's language codes) only for an encoder-decoder model (which does not chat), no text
prompts, chat or tokenizer endpoints for a model without a tokenizer, and the bounds the server checks
(max_tokens within the context and the server's --max-output-tokens, token ids within the
vocabulary, ...) in the schemas, with
the checks that tie one field to another as `if`/`then`. So a body the document allows is
answered, and one it does not allow gets a 4xx OpenAI error object. The one limit no
schema can state is a text's length in tokens: a prompt longer than the context is a 400
`context_length_exceeded`, and a max_tokens past what a prompt leaves ends the answer at
the context's end (finish_reason `length`).

Every answer is declared (bodies, each stream event, each error status and its headers),
so that a schema fuzzer checks the server against it: tests/test_server_fuzz.py runs
schemathesis over a real server. Left out: the web page's routes (/ and /ui/..., the
page's own; /ui/events never ends).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..engine.logprobs import MAX_LOGPROBS
from ..engine.translation import LANGUAGE_CODE
from . import metrics
from .protocol import _NEUTRAL as NEUTRAL_ONLY  # fields accepted only at the value that means "off"
from .protocol import CHAT_ROLES, MAX_BODY_BYTES, MAX_STOP_CHARS, MAX_STOP_STRINGS, SEED_RANGE


@dataclass(frozen=True)
class ServedModel:
    """What the document depends on: the model's name, context, vocabulary and tokenizer."""

    name: str
    max_model_len: int
    vocab_size: int  # a token-id prompt's ids: 0 .. vocab_size - 1
    tokenizer_vocab_size: int | None = None  # None: no tokenizer (no text prompts, chat or tokenizer endpoints)
    languages: tuple[str, ...] = ()  # an encoder-decoder model's language codes (src_lang, tgt_lang)
    seq2seq: bool = False  # the prompt is the encoder's source: it may fill the context
    api_key: bool = False  # /v1 and the tokenizer endpoints need `Authorization: Bearer KEY`
    max_output_tokens: int | None = None  # the most tokens one request may generate (None: the context's)

    @property
    def chats(self) -> bool:
        """Chat renders text, so it needs a tokenizer; an encoder-decoder model translates instead (app.py)."""
        return self.tokenizer_vocab_size is not None and not self.seq2seq


def served_model(engine, name: str, api_key: bool, max_output_tokens: int | None = None) -> ServedModel:
    tokenizer, seq2seq = engine.tokenizer, engine.config.seq2seq is not None
    languages = ()
    if seq2seq and tokenizer is not None:  # a language is a special token of the tokenizer (engine/translation.py)
        languages = tuple(t for t in tokenizer.special_tokens() if LANGUAGE_CODE.match(t))
    return ServedModel(name, engine.max_model_len, engine.config.vocab_size,
                       None if tokenizer is None else tokenizer.vocab_size, languages, seq2seq, api_key,
                       max_output_tokens)


# --- building blocks ------------------------------------------------------------------------


def _of(kind: str, **extra) -> dict:
    """A JSON type that may also be null (OpenAI's optional fields)."""
    return {"type": [kind, "null"], **extra}


def _closed(props: dict, optional: tuple[str, ...] = ()) -> dict:
    """An object of exactly these properties, all required but `optional`."""
    return {"type": "object", "properties": props, "required": [k for k in props if k not in optional],
            "additionalProperties": False}


def _array(items: dict, **extra) -> dict:
    return {"type": "array", "items": items, **extra}


def _ref(name: str) -> dict:
    return {"$ref": f"#/components/schemas/{name}"}


def _when(name: str, value: dict, then: dict) -> dict:
    """A check across fields: if `name` is present and matches `value`, the body must match `then`."""
    return {"if": {"properties": {name: value}, "required": [name]}, "then": then}


def _must_be(name: str, value) -> dict:
    return {"properties": {name: {"const": value}}, "required": [name]}


_INTEGER = {"type": "integer", "minimum": 0}
_STRING = {"type": "string"}
_NUMBER = {"type": "number"}


# --- requests -------------------------------------------------------------------------------


def _token_ids(m: ServedModel, **extra) -> dict:
    return _array({"type": "integer", "minimum": 0, "maximum": m.vocab_size - 1}, **extra)


def _max_tokens(m: ServedModel, minimum: int = 1) -> dict:
    most = m.max_model_len - 1 if m.max_output_tokens is None else min(m.max_model_len - 1, m.max_output_tokens)
    return _of("integer", minimum=minimum, maximum=most,
               description="at most the context less a one-token prompt and the most tokens this server "
                           "generates a request (specmoe serve --max-output-tokens); past what the prompt "
                           "leaves, the answer ends at the context's end (finish_reason `length`)")


def _stop() -> dict:
    text = {"type": "string", "minLength": 1, "maxLength": MAX_STOP_CHARS}
    return {"anyOf": [text, _array(text, maxItems=MAX_STOP_STRINGS), {"type": "null"}]}


def _sampling_fields(m: ServedModel) -> dict:
    return {
        "model": {"enum": [m.name, None]},
        "max_tokens": _max_tokens(m),
        "n": _of("integer", minimum=1, maximum=1),
        "seed": _of("integer", minimum=SEED_RANGE[0], maximum=SEED_RANGE[1] - 1),
        "stop": _stop(),
        "stream": _of("boolean"),
        "stream_options": _of("object", properties={"include_usage": _of("boolean")}, additionalProperties=False),
        "temperature": _of("number", minimum=0, maximum=2),
        "top_p": _of("number", exclusiveMinimum=0, maximum=1),
        "user": _of("string"),
        "frequency_penalty": {}, "presence_penalty": {}, "logit_bias": {},  # neutral only (_request)
        "top_k": _of("integer", minimum=-1, description="vLLM's extension; -1 or 0: no limit"),
        "ignore_eos": _of("boolean", description="vLLM's extension"),
        "specmoe_stats": _of("boolean", description="the answer carries the request's own engine statistics"),
    }


def _request(props: dict, required: str, checks: list[dict]) -> dict:
    for name, values in NEUTRAL_ONLY.items():
        if name in props:
            props[name] = {"enum": [*values, None], "description": "not implemented: only the neutral value"}
    # stream_options only with a stream (protocol._common)
    checks = [_when("stream_options", {"type": "object"}, _must_be("stream", True)), *checks]
    return {"type": "object", "properties": props, "required": [required], "additionalProperties": False,
            "allOf": checks}


def _prompt(m: ServedModel) -> dict:
    """A text or token ids, or a batch of one of either (unwrapped, as OpenAI's clients send it)."""
    longest = m.max_model_len if m.seq2seq else m.max_model_len - 1  # a decoder's prompt leaves one
    forms = [_token_ids(m, minItems=1, maxItems=longest)]
    if m.tokenizer_vocab_size is not None:
        forms.insert(0, {"type": "string", "minLength": 1})
    return {"anyOf": forms + [_array(form, minItems=1, maxItems=1) for form in forms]}


def _languages(m: ServedModel) -> dict:
    if not m.languages:  # a decoder-only model refuses them
        return {}
    code = {"enum": [*m.languages, None]}
    return {"src_lang": {**code, "description": "the prompt's language (a code of this model)"},
            "tgt_lang": {**code, "description": "the language to translate into"}}


def completion_request(m: ServedModel) -> dict:
    props = {
        **_sampling_fields(m),
        "prompt": _prompt(m),
        "max_tokens": _max_tokens(m, minimum=0),
        "logprobs": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": MAX_LOGPROBS},
                               {"enum": [False, None]}]},  # false: off, as some clients send it
        "best_of": {}, "suffix": {},
        "echo": _of("boolean"),
        **_languages(m),
    }
    return _request(props, "prompt", [
        _when("max_tokens", {"const": 0}, _must_be("echo", True)),  # 0 only to score an echoed prompt
    ])


_TEXT_PART = _closed({"type": {"const": "text"}, "text": _STRING})
_MESSAGE = _closed({"role": {"enum": list(CHAT_ROLES)},
                    "content": {"anyOf": [_STRING, _array(_TEXT_PART)]},
                    "name": _of("string")}, optional=("name",))


def chat_request(m: ServedModel) -> dict:
    props = {
        **_sampling_fields(m),
        "messages": _array(_MESSAGE, minItems=1),
        "max_completion_tokens": _max_tokens(m),
        "logprobs": _of("boolean"),
        "top_logprobs": _of("integer", minimum=0, maximum=MAX_LOGPROBS),
        "response_format": {}, "tools": {}, "tool_choice": {},
        "parallel_tool_calls": _of("boolean"),
    }
    return _request(props, "messages", [
        _when("top_logprobs", {"type": "integer"}, _must_be("logprobs", True)),
        _when("max_completion_tokens", {"type": "integer"}, {"properties": {"max_tokens": {"type": "null"}}}),
    ])


def tokenize_request(m: ServedModel) -> dict:
    return _closed({"model": {"enum": [m.name, None]}, "prompt": _STRING, "add_special_tokens": _of("boolean")},
                   optional=("model", "add_special_tokens"))


def detokenize_request(m: ServedModel) -> dict:
    ids = _array({"type": "integer", "minimum": 0, "maximum": m.tokenizer_vocab_size - 1})
    return _closed({"model": {"enum": [m.name, None]}, "tokens": ids}, optional=("model",))


# --- answers --------------------------------------------------------------------------------

ERROR = _closed({"error": _closed({"message": {"type": "string", "minLength": 1}, "type": _STRING,
                                   "param": _of("string"), "code": _of("string")})})
_USAGE = _closed({k: _INTEGER for k in ("prompt_tokens", "completion_tokens", "total_tokens")})
_FINISH = {"enum": ["stop", "length"]}
_OR_NULL = {"type": ["number", "null"]}
STATS = _closed({
    "policy": _STRING, "completion_tokens": _INTEGER, "steps": _INTEGER, "ttft_s": _OR_NULL,
    "decode_tokens_per_s": _OR_NULL, "tokens_per_step": _OR_NULL, "drafted": _INTEGER, "accepted": _INTEGER,
    "acceptance_rate": _OR_NULL, "transfer_bytes": _INTEGER, "transfer_bytes_per_token": _OR_NULL,
})
LEGACY_LOGPROBS = _closed({
    "tokens": _array(_STRING), "token_logprobs": _array(_OR_NULL), "text_offset": _array(_INTEGER),
    "top_logprobs": _array({"type": ["object", "null"], "additionalProperties": _NUMBER}),
})
_CHAT_TOKEN = {"token": _STRING, "logprob": _NUMBER, "bytes": _array({"type": "integer", "minimum": 0, "maximum": 255})}
CHAT_LOGPROBS = _closed({"content": _array(_closed({**_CHAT_TOKEN, "top_logprobs": _array(_closed(_CHAT_TOKEN))})),
                         "refusal": {"type": "null"}})


def _logprobs(kind: str) -> dict:
    return {"anyOf": [{"type": "null"}, _ref("ChatLogprobs" if kind == "chat" else "LegacyLogprobs")]}


def _choice(kind: str, finish: dict) -> dict:
    body = ({"message": _closed({"role": {"const": "assistant"}, "content": _STRING})} if kind == "chat"
            else {"text": _STRING})
    return _closed({"index": {"const": 0}, **body, "logprobs": _logprobs(kind), "finish_reason": finish})


def _answer(m: ServedModel, obj: str, choices: dict, *optional: str) -> dict:
    return _closed({"id": _STRING, "object": {"const": obj}, "created": _INTEGER, "model": {"const": m.name},
                    "choices": choices, "usage": _ref("Usage"), "specmoe_stats": _ref("Stats")},
                   optional=("specmoe_stats", *optional))


def _chunk(m: ServedModel, kind: str) -> dict:
    """A streamed chunk: text (or a chat delta) with its tokens' logprobs, the finish, or usage (no choices)."""
    finish = {"enum": ["stop", "length", None]}
    if kind == "chat":
        delta = _closed({"role": {"const": "assistant"}, "content": _STRING}, optional=("role", "content"))
        choice = _closed({"index": {"const": 0}, "delta": delta, "logprobs": _logprobs("chat"),
                          "finish_reason": finish})
        return _answer(m, "chat.completion.chunk", _array(choice, maxItems=1), "usage")
    return _answer(m, "text_completion", _array(_choice("completion", finish), maxItems=1), "usage")


def components(m: ServedModel) -> dict:
    schemas = {
        "Error": ERROR, "Usage": _USAGE, "Stats": STATS, "LegacyLogprobs": LEGACY_LOGPROBS,
        "ChatLogprobs": CHAT_LOGPROBS,
        "Completion": _answer(m, "text_completion", _array(_choice("completion", _FINISH), minItems=1, maxItems=1)),
        "CompletionChunk": _chunk(m, "completion"),
        "Model": _closed({"id": {"const": m.name}, "object": {"const": "model"}, "created": _INTEGER,
                          "owned_by": {"const": "specmoe"}, "max_model_len": {"const": m.max_model_len}}),
        "ModelList": _closed({"object": {"const": "list"}, "data": _array(_ref("Model"), minItems=1, maxItems=1)}),
    }
    if m.chats:
        schemas["ChatCompletion"] = _answer(m, "chat.completion", _array(_choice("chat", _FINISH), minItems=1,
                                                                          maxItems=1))
        schemas["ChatCompletionChunk"] = _chunk(m, "chat")
    out = {"schemas": schemas}
    if m.api_key:
        out["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    return out


# --- operations -----------------------------------------------------------------------------

_ERRORS = {
    400: "the body is malformed or does not fit (a field out of bounds, a prompt longer than the context); "
         "`param` names the field",
    401: "no or a wrong API key: send `Authorization: Bearer KEY`",
    404: "the body names another model",
    413: f"the body is larger than {MAX_BODY_BYTES} bytes",
    500: "the engine failed on this request (`engine_error`); the server keeps serving",
    503: "the server is overloaded, shutting down or its engine stopped: retry later or elsewhere",
}


def _error(status: int, description: str | None = None) -> dict:
    out = {"description": description or _ERRORS[status],
           "content": {"application/json": {"schema": _ref("Error")}}}
    if status == 401:
        out["headers"] = {"WWW-Authenticate": {"schema": {"const": "Bearer"}}}
    return out


def _json(description: str, schema: dict) -> dict:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _operation(m: ServedModel, op_id: str, summary: str, ok: dict, *errors: int, body: dict | None = None,
               protected: bool = True, **extra) -> dict:
    """One operation; `protected` ones sit behind the API key when the server has one."""
    responses = {"200": ok, **{str(s): _error(s) for s in errors}, **extra}
    out = {"operationId": op_id, "summary": summary, "responses": responses}
    if body is not None:
        out["requestBody"] = {"required": True, "content": {"application/json": {"schema": body}}}
    if protected and m.api_key:
        out["security"] = [{"bearer": []}]
        responses["401"] = _error(401)
    return out


def _stream_event(chunk: str) -> dict:
    """One server-sent event of a stream: a chunk, an error (the request failed mid-stream) or `[DONE]`."""
    data = {"type": "string", "contentMediaType": "application/json",
            "contentSchema": {"anyOf": [_ref(chunk), _ref("Error")]}}
    return {"type": "object", "required": ["data"], "properties": {"data": {"anyOf": [{"const": "[DONE]"}, data]}}}


def _generation(m: ServedModel, op_id: str, summary: str, request: dict, answer: str) -> dict:
    ok = {"description": "the answer; with `stream: true`, server-sent events: chunks, then `data: [DONE]`",
          "content": {"application/json": {"schema": _ref(answer)},
                      "text/event-stream": {"schema": _stream_event(answer + "Chunk")}}}
    return {"post": _operation(m, op_id, summary, ok, 400, 404, 413, 500, 503, body=request)}


def _tokenizer_paths(m: ServedModel) -> dict:
    info = _closed({"tokenizer_class": _STRING, "bos_token": _of("string"), "eos_token": _of("string"),
                    "chat_template": _of("string"), "model_max_length": {"const": m.max_model_len},
                    "vocab_size": {"const": m.tokenizer_vocab_size}})
    ids = _array({"type": "integer", "minimum": 0, "maximum": m.tokenizer_vocab_size - 1})
    tokenized = _closed({"count": _INTEGER, "max_model_len": {"const": m.max_model_len}, "tokens": ids})
    return {
        "/tokenizer_info": {"get": _operation(m, "tokenizerInfo", "The tokenizer (vLLM's endpoint)",
                                              _json("its special tokens, chat template and size", info))},
        "/tokenize": {"post": _operation(m, "tokenize", "Text to token ids (vLLM's endpoint)",
                                         _json("the ids", tokenized), 400, 404, 413, body=tokenize_request(m))},
        "/detokenize": {"post": _operation(m, "detokenize", "Token ids to text (vLLM's endpoint)",
                                           _json("the text", _closed({"prompt": _STRING})), 400, 404, 413,
                                           body=detokenize_request(m))},
    }


def _model_paths(m: ServedModel) -> dict:
    name = {"name": "name", "in": "path", "required": True, "schema": {"type": "string", "enum": [m.name]}}
    model = _operation(m, "getModel", "The served model by name", _json("its card", _ref("Model")))
    model["responses"]["404"] = _error(404, "this server serves another model")
    return {
        "/v1/models": {"get": _operation(m, "listModels", "The served model",
                                         _json("a list of one", _ref("ModelList")))},
        "/v1/models/{name}": {"parameters": [name], "get": model},
    }


def _operations_paths(m: ServedModel) -> dict:
    down = _closed({"status": {"enum": ["shutting_down", "error"]}, "error": _STRING}, optional=("error",))
    health = _operation(m, "health", "200 while the engine runs, else 503",
                        _json("the engine runs", _closed({"status": {"const": "ok"}})), protected=False,
                        **{"503": _json("shutting down, or the engine loop stopped (`error` says why)", down)})
    text = {"description": "Prometheus text", "content": {metrics.CONTENT_TYPE: {"schema": _STRING}}}
    return {"/health": {"get": health},
            "/metrics": {"get": _operation(m, "metrics", "Prometheus metrics", text, protected=False)}}


def document(m: ServedModel) -> dict:
    """The OpenAPI 3.1 document of a server serving `m`."""
    paths = {"/v1/completions": _generation(m, "createCompletion", "Create a completion", completion_request(m),
                                            "Completion")}
    if m.chats:
        paths["/v1/chat/completions"] = _generation(m, "createChatCompletion", "Create a chat completion",
                                                    chat_request(m), "ChatCompletion")
    paths.update(_model_paths(m))
    if m.tokenizer_vocab_size is not None:
        paths.update(_tokenizer_paths(m))
    paths.update(_operations_paths(m))
    return {
        "openapi": "3.1.0",
        "info": {"title": "specmoe", "version": "1", "description": "OpenAI-compatible completions and chat "
                 "completions, decoded with continuous batching (and self-assisted speculative decoding). "
                 "A method a path does not list is answered 405 with `Allow`; OPTIONS with 204 and `Allow`; "
                 "HEAD wherever GET is."},
        "components": components(m),
        "paths": paths,
    }
