"""Text <-> token ids with the checkpoint's own `tokenizer.json` (the `tokenizers` library).

A checkpoint without a tokenizer still works with token-id prompts.
"""

from __future__ import annotations

import json
from pathlib import Path

from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

from .errors import SpecMoEError


class Tokenizer:
    def __init__(self, model_dir: Path):
        cfg_path = model_dir / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        self._setup(HFTokenizer.from_file(str(model_dir / "tokenizer.json")), cfg)

    @classmethod
    def from_parts(cls, tokenizer: HFTokenizer, cfg: dict) -> Tokenizer:
        """From a built `tokenizers` tokenizer and tokenizer_config.json's keys (a GGUF file's vocabulary)."""
        self = cls.__new__(cls)
        self._setup(tokenizer, cfg)
        return self

    def _setup(self, tokenizer: HFTokenizer, cfg: dict) -> None:
        self._tok = tokenizer
        self.chat_template = cfg.get("chat_template")
        self.bos_token = _token_text(cfg.get("bos_token"))
        self.eos_token = _token_text(cfg.get("eos_token"))
        self.bos_id = self._tok.token_to_id(self.bos_token) if self.bos_token else None
        # Add BOS ourselves only when the config asks and the post-processor does not.
        self.add_bos = bool(cfg.get("add_bos_token", False)) and self.bos_id is not None
        # a translation model's default languages (NLLB's tokenizer names them so)
        self.src_lang, self.tgt_lang = cfg.get("src_lang"), cfg.get("tgt_lang")

    @classmethod
    def from_dir(cls, model_dir: Path) -> Tokenizer | None:
        return cls(model_dir) if (model_dir / "tokenizer.json").is_file() else None

    LOOKBACK = 4  # tokens of context that settle a token's text (a leading space, merged bytes)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; `add_special_tokens=False`: the text's own tokens only (no BOS)."""
        ids = self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens and self.add_bos and (not ids or ids[0] != self.bos_id):
            ids = [self.bos_id] + ids
        return ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)

    def token_text(self, context: list[int], token: int) -> str:
        """The text `token` adds after `context`, special tokens spelled out (a token's
        text alone may lack the space or the bytes its neighbours give it)."""
        window = list(context[-self.LOOKBACK:])
        before = self._tok.decode(window, skip_special_tokens=False)
        return self._tok.decode(window + [token], skip_special_tokens=False)[len(before):]

    def token_id(self, text: str) -> int | None:
        return self._tok.token_to_id(text)

    def special_tokens(self) -> list[str]:
        return sorted(t.content for t in self._tok.get_added_tokens_decoder().values() if t.special)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    def apply_chat_template(self, messages: list[dict]) -> str:
        if not self.chat_template:
            raise SpecMoEError("this model's tokenizer has no chat template; use generate with a plain prompt")
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise_template_error  # Hugging Face templates call it
        template = env.from_string(self.chat_template)
        return template.render(
            messages=messages, add_generation_prompt=True,
            bos_token=self.bos_token or "", eos_token=self.eos_token or "",
        )


def _raise_template_error(message: str):
    raise SpecMoEError(f"chat template: {message}")


def _token_text(value) -> str | None:
    if isinstance(value, dict):  # {"content": "<s>", ...} in older configs
        return value.get("content")
    return value
