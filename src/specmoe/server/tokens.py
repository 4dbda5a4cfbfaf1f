"""vLLM's tokenizer endpoints: GET /tokenizer_info, POST /tokenize, POST /detokenize.

lm-evaluation-harness's API models (`local-completions`) tokenize with them when they
answer (`tokenizer_backend=remote`, chosen automatically), so an evaluation needs no
local copy of the tokenizer and counts tokens exactly as the server does. This module
checks the bodies and builds the answers; app.py serves them.
"""

from __future__ import annotations

from .protocol import _get, _is_int, check_model, invalid


def need_tokenizer(tokenizer):
    if tokenizer is None:
        raise invalid("this model has no tokenizer (no tokenizer.json); send and read token ids")
    return tokenizer


def tokenizer_info(tokenizer, max_model_len: int) -> dict:
    tok = need_tokenizer(tokenizer)
    return {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": tok.bos_token, "eos_token": tok.eos_token,
            "chat_template": tok.chat_template, "model_max_length": max_model_len, "vocab_size": tok.vocab_size}


def tokenize(body: dict, tokenizer, max_model_len: int, model_name: str) -> dict:
    """{"prompt": text, "add_special_tokens": bool (default true)} -> the ids and their count."""
    _only(body, {"model", "prompt", "add_special_tokens"})
    check_model(body, model_name)  # as /v1 does: a client that names another model is told so
    text = _get(body, "prompt", lambda v: isinstance(v, str), "a string")
    if text is None:
        raise invalid("'prompt' is required: the text to tokenize", "prompt")
    special = _get(body, "add_special_tokens", lambda v: isinstance(v, bool), "a boolean", True)
    ids = need_tokenizer(tokenizer).encode(text, add_special_tokens=special)
    return {"count": len(ids), "max_model_len": max_model_len, "tokens": ids}


def detokenize(body: dict, tokenizer, model_name: str) -> dict:
    """{"tokens": [ids]} -> {"prompt": their text}."""
    _only(body, {"model", "tokens"})
    check_model(body, model_name)
    ids = _get(body, "tokens", lambda v: isinstance(v, list) and all(_is_int(t) for t in v), "an array of token ids")
    if ids is None:
        raise invalid("'tokens' is required: the token ids to turn into text", "tokens")
    tok = need_tokenizer(tokenizer)
    if any(not 0 <= t < tok.vocab_size for t in ids):
        raise invalid(f"'tokens' holds an id outside the vocabulary (0..{tok.vocab_size - 1})", "tokens")
    return {"prompt": tok.decode(ids)}


def _only(body: dict, allowed: set[str]) -> None:
    for key in body:
        if key not in allowed:
            raise invalid(f"Unrecognized request argument supplied: {key}", key)
