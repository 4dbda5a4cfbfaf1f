"""`specmoe serve` as the tests run it: a real server in a subprocess on a free loopback
port, on a tiny checkpoint that has a tokenizer and a chat template."""

from __future__ import annotations

import json
import signal
import socket
import string
import subprocess
import sys
import time
from pathlib import Path

import httpx
from factories import make_checkpoint

STARTUP_TIMEOUT_S = 180  # a cold start on 2 busy cores: imports and the model load
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
WORDS = "the quick brown fox jumps over a lazy dog while experts move once for many tokens".split()


def write_tokenizer(model_dir: Path, texts: list[str]) -> None:
    """A 128-token character-level BPE trained on `texts` (ids 0-3: <pad> <s> </s> <unk>, as the checkpoint's)."""
    from tokenizers import Tokenizer, decoders, models, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.decoder = decoders.Fuse()  # tokens are plain text pieces: decoding concatenates them
    alphabet = list(string.printable[:95])
    trainer = trainers.BpeTrainer(vocab_size=128, special_tokens=["<pad>", "<s>", "</s>", "<unk>"],
                                  initial_alphabet=alphabet, limit_alphabet=len(alphabet), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    assert tok.get_vocab_size() <= 128 and tok.token_to_id("</s>") == 2
    tok.save(str(model_dir / "tokenizer.json"))
    (model_dir / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True, "chat_template": CHAT_TEMPLATE,
    }))


def served_checkpoint(directory: Path) -> Path:
    """A tiny random Mixtral with a tokenizer, in `directory`/tiny-mixtral."""
    path = make_checkpoint("mixtral", directory / "tiny-mixtral")
    write_tokenizer(path, [" ".join(WORDS)] * 4)
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServeProcess:
    """`specmoe serve --model DIR FLAGS...` on a free loopback port, ready once constructed."""

    def __init__(self, model_dir: Path, log_path: Path, *flags: str):
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = log_path
        with open(log_path, "w") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "specmoe.cli", "serve", "--model", str(model_dir), "--port", str(port),
                 "--device", "cpu", *flags],
                stdout=log, stderr=subprocess.STDOUT,
            )
        self._wait_ready()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while True:
            if self.proc.poll() is not None:
                raise AssertionError(f"the server exited with status {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                self.proc.kill()
                raise AssertionError(f"the server did not answer /health within {STARTUP_TIMEOUT_S} s:\n{self.log()}")
            time.sleep(0.2)

    def log(self) -> str:
        return self.log_path.read_text()

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30) -> int:
        """Send `sig`, wait for the exit (killing after `timeout`); the exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"the server did not exit within {timeout} s of signal {sig}:\n{self.log()}")
