"""What an encoder-decoder request feeds each stack (NLLB's convention):

    encoder   [src_lang] text </s>        (a token-id prompt: the source ids as given)
    decoder   [decoder_start] [tgt_lang]  then the generated tokens

The language codes are special tokens of the model's tokenizer (`eng_Latn`, `fra_Latn`,
...); defaults come from its tokenizer_config.json (`src_lang`, `tgt_lang`). For a model
without a tokenizer the target language may be given as its token id.
"""

from __future__ import annotations

import re

from ..base.errors import SpecMoEError
from ..base.model_config import ModelConfig

LANGUAGE_CODE = re.compile(r"^[a-z]{3}_[A-Z][a-z]{3}$")  # NLLB's: ISO 639-3 _ ISO 15924


def language_id(tokenizer, code: str | int | None, flag: str) -> int | None:
    if code is None or (isinstance(code, int) and not isinstance(code, bool)):
        return code
    if tokenizer is None:
        raise SpecMoEError(f"{flag} {code}: this model has no tokenizer.json to look the code up in; "
                           "pass the language token's id instead")
    special = tokenizer.special_tokens()
    token = tokenizer.token_id(code) if code in special else None  # a language is a special token, not a word piece
    if token is None:
        codes = [t for t in special if LANGUAGE_CODE.match(t)]
        raise SpecMoEError(f"{flag} {code} is not a language of this model; its language codes: "
                           f"{', '.join(codes) or 'none'}")
    return token


def check_languages(config: ModelConfig, src_lang, tgt_lang) -> None:
    if config.seq2seq is None and (src_lang is not None or tgt_lang is not None):
        raise SpecMoEError(f"--src-lang / --tgt-lang are for encoder-decoder (translation) models; "
                           f"{config.architecture} is decoder-only: leave them out")


def translation_ids(config: ModelConfig, tokenizer, prompt, src_lang=None, tgt_lang=None,
                    encode=None) -> tuple[list[int], list[int]]:
    """(source ids, decoder prompt) of one request; `encode` turns a token-id prompt into
    checked ids."""
    s = config.seq2seq
    if tokenizer is not None:
        src_lang = src_lang if src_lang is not None else tokenizer.src_lang
        tgt_lang = tgt_lang if tgt_lang is not None else tokenizer.tgt_lang
    src, tgt = language_id(tokenizer, src_lang, "--src-lang"), language_id(tokenizer, tgt_lang, "--tgt-lang")
    if isinstance(prompt, str):
        if not prompt:
            raise SpecMoEError("empty source text: give at least one character to translate")
        if tokenizer is None:
            raise SpecMoEError("this model has no tokenizer.json: pass the source as token ids")
        eos = config.eos_token_ids[0] if config.eos_token_ids else s.decoder_start_token_id
        source = ([] if src is None else [src]) + tokenizer.encode(prompt, add_special_tokens=False) + [eos]
    else:
        source = encode(prompt)
    return source, [s.decoder_start_token_id] + ([] if tgt is None else [tgt])
