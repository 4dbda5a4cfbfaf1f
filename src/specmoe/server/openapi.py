"""The API's OpenAPI document, served at /openapi.json: what this server accepts and answers.

Written out by hand (the handlers validate bodies themselves, protocol.py) in OpenAI's
terms, narrowed to this server where it differs (one model, n = 1, the OpenAI fields it
does not implement only at their neutral value). A body the schema allows may still be
refused with a 4xx when it does not fit (max_tokens beyond the context, a token id
outside the vocabulary); a body it does not allow is always refused with a 4xx. Either way the answer is an OpenAI error object, never a 5xx:
tests/test_server_fuzz.py holds the server to that with bodies generated from this
document.
"""

from __future__ import annotations

from ..engine.logprobs import MAX_LOGPROBS
from .protocol import _NEUTRAL as NEUTRAL_ONLY  # fields accepted only at the value that means "off"
from .protocol import CHAT_ROLES, MAX_STOP_STRINGS

_NULLABLE = ("null",)


def _of(kind: str, **extra) -> dict:
    """A JSON type that may also be null (OpenAI's optional fields)."""
    return {"type": [kind, *_NULLABLE], **extra}


def _request(props: dict, required: str) -> dict:
    for name, values in NEUTRAL_ONLY.items():
        if name in props:
            props[name] = {"enum": [*values, None], "description": "not implemented: only the neutral value"}
    return {"type": "object", "properties": props, "required": [required], "additionalProperties": False}


def _sampling_fields(model_name: str) -> dict:
    return {
        "model": {"type": "string", "enum": [model_name]},
        "max_tokens": _of("integer", minimum=1),
        "n": _of("integer", minimum=1, maximum=1),
        "seed": _of("integer"),
        "stop": {"anyOf": [{"type": "string", "minLength": 1},
                           {"type": "array", "items": {"type": "string", "minLength": 1}, "maxItems": MAX_STOP_STRINGS},
                           {"type": "null"}]},
        "stream": _of("boolean"),
        "stream_options": _of("object", properties={"include_usage": {"type": "boolean"}},
                              additionalProperties=False),
        "temperature": _of("number", minimum=0, maximum=2),
        "top_p": _of("number", exclusiveMinimum=0, maximum=1),
        "user": _of("string"),
        "frequency_penalty": _of("number", minimum=-2, maximum=2),
        "presence_penalty": _of("number", minimum=-2, maximum=2),
        "logit_bias": _of("object", additionalProperties={"type": "number"}),
        "top_k": _of("integer", minimum=-1),  # vLLM's extension
        "ignore_eos": _of("boolean"),  # vLLM's extension
        "specmoe_stats": _of("boolean", description="the answer carries the request's own engine statistics"),
    }


def completion_request(model_name: str) -> dict:
    props = {
        **_sampling_fields(model_name),
        "prompt": {"anyOf": [{"type": "string", "minLength": 1},
                             {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}]},
        "max_tokens": _of("integer", minimum=0, description="0 only with echo: scores the prompt"),
        "logprobs": _of("integer", minimum=0, maximum=MAX_LOGPROBS),
        "best_of": _of("integer", minimum=1),
        "echo": _of("boolean"),
        "suffix": _of("string"),
        "src_lang": _of("string", description="an encoder-decoder model: the prompt's language (NLLB code)"),
        "tgt_lang": _of("string", description="an encoder-decoder model: the language to translate into"),
    }
    return _request(props, "prompt")


_TEXT_PART = {"type": "object", "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
              "required": ["type", "text"], "additionalProperties": False}
_MESSAGE = {
    "type": "object",
    "properties": {"role": {"enum": list(CHAT_ROLES)},
                   "content": {"anyOf": [{"type": "string"}, {"type": "array", "items": _TEXT_PART}]},
                   "name": {"type": "string"}},
    "required": ["role", "content"], "additionalProperties": False,
}


def chat_request(model_name: str) -> dict:
    props = {
        **_sampling_fields(model_name),
        "messages": {"type": "array", "items": _MESSAGE, "minItems": 1},
        "max_completion_tokens": _of("integer", minimum=1),
        "logprobs": _of("boolean"),
        "top_logprobs": _of("integer", minimum=0, maximum=MAX_LOGPROBS),
        "response_format": _of("object"),
        "tools": _of("array"),
        "tool_choice": {"anyOf": [{"type": "string"}, {"type": "object"}, {"type": "null"}]},
        "parallel_tool_calls": _of("boolean"),
    }
    return _request(props, "messages")


ERROR = {
    "type": "object", "required": ["error"], "additionalProperties": False,
    "properties": {"error": {
        "type": "object", "required": ["message", "type", "param", "code"], "additionalProperties": False,
        "properties": {"message": {"type": "string", "minLength": 1}, "type": {"type": "string"},
                       "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}},
    }},
}
_USAGE = {"type": "object", "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
          "properties": {k: {"type": "integer", "minimum": 0}
                         for k in ("prompt_tokens", "completion_tokens", "total_tokens")}}
_FINISH = {"enum": ["stop", "length"]}


def _answer(obj: str, choice: dict) -> dict:
    return {"type": "object", "required": ["id", "object", "created", "model", "choices", "usage"],
            "properties": {"id": {"type": "string"}, "object": {"const": obj}, "created": {"type": "integer"},
                           "model": {"type": "string"}, "usage": _USAGE,
                           "choices": {"type": "array", "minItems": 1, "maxItems": 1, "items": choice}}}


COMPLETION = _answer("text_completion", {"type": "object", "required": ["index", "text", "finish_reason"],
                                         "properties": {"text": {"type": "string"}, "finish_reason": _FINISH}})
CHAT_COMPLETION = _answer("chat.completion", {
    "type": "object", "required": ["index", "message", "finish_reason"],
    "properties": {"message": {"type": "object", "required": ["role", "content"],
                               "properties": {"role": {"const": "assistant"}, "content": {"type": "string"}}},
                   "finish_reason": _FINISH}})


def _post(summary: str, request: dict, answer: dict) -> dict:
    error = {"description": "an OpenAI error object", "content": {"application/json": {"schema": ERROR}}}
    return {"post": {
        "summary": summary,
        "requestBody": {"required": True, "content": {"application/json": {"schema": request}}},
        "responses": {
            "200": {"description": "the completion; with stream=true, server-sent events of chunks ending "
                                   "with `data: [DONE]`",
                    "content": {"application/json": {"schema": answer}, "text/event-stream": {}}},
            "4XX": error, "5XX": error,
        },
    }}


def document(model_name: str) -> dict:
    """The OpenAPI 3.1 document of a server serving `model_name`."""
    return {
        "openapi": "3.1.0",
        "info": {"title": "specmoe", "version": "1", "description": "OpenAI-compatible completions and chat "
                 "completions, decoded with continuous batching (and self-assisted speculative decoding)."},
        "components": {"securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
        "paths": {
            "/v1/completions": _post("Create a completion", completion_request(model_name), COMPLETION),
            "/v1/chat/completions": _post("Create a chat completion", chat_request(model_name), CHAT_COMPLETION),
            "/v1/models": {"get": {"summary": "The served model", "responses": {"200": {"description": "a list"}}}},
            "/health": {"get": {"summary": "200 while the engine runs, else 503",
                                "responses": {"200": {"description": "ok"}, "503": {"description": "down"}}}},
            "/metrics": {"get": {"summary": "Prometheus metrics", "responses": {"200": {"description": "text"}}}},
        },
    }
