"""Servers for the tests, on loopback only: a free port, the app in this process,
waiting for a server subprocess to answer /health, `specmoe serve` in a subprocess
(`ServeProcess`), and a tiny checkpoint with a tokenizer and a chat template to serve."""

from __future__ import annotations

import json
import signal
import socket
import string
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

STARTUP_TIMEOUT_S = 180  # a cold start on 2 busy cores: imports and the model load
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
WORDS = "the quick brown fox jumps over a lazy dog while experts move once for many tokens".split()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def serve_in_process(engine, model_name: str, **app_options):
    """The app over `engine` (`create_app` options: api_key, ui), served by uvicorn on a
    thread of this process; yields its URL."""
    import uvicorn

    from specmoe.server.app import create_app
    from specmoe.server.command import bind

    sock = bind("127.0.0.1", 0)
    server = uvicorn.Server(uvicorn.Config(create_app(engine, model_name, **app_options), log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the in-process server did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


def wait_until_healthy(url: str, proc, log_path, timeout_s: float) -> None:
    """Until `url`/health answers 200; fails with the server's log if `proc` exits or time runs out."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while True:
        assert proc.poll() is None, f"the server exited with status {proc.returncode}:\n{log_path.read_text()}"
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, f"the server did not answer /health within {timeout_s} s:\n" \
            f"{log_path.read_text()}"
        time.sleep(0.2)


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
    from factories import make_checkpoint

    path = make_checkpoint("mixtral", directory / "tiny-mixtral")
    write_tokenizer(path, [" ".join(WORDS)] * 4)
    return path


class ServeProcess:
    """`specmoe serve --model DIR FLAGS...` in a subprocess on a free loopback port, ready once
    constructed (with `wait=False`, once `wait_until_ready()` returns: it starts meanwhile)."""

    def __init__(self, model_dir: Path | None, log_path: Path, *flags: str, wait: bool = True):
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = log_path
        model = ["--model", str(model_dir)] if model_dir else []  # None: the bundled demo model
        with open(log_path, "w") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "specmoe.cli", "serve", *model, "--port", str(port), "--device", "cpu", *flags],
                stdout=log, stderr=subprocess.STDOUT,
            )
        if wait:
            self.wait_until_ready()

    def wait_until_ready(self) -> None:
        try:
            wait_until_healthy(self.url, self.proc, self.log_path, STARTUP_TIMEOUT_S)
        except AssertionError:
            self.proc.kill()
            raise

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
