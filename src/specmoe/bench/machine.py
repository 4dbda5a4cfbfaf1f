"""What machine a benchmark ran on: recorded with every result, printed with every table."""

from __future__ import annotations

import datetime as _dt
import platform

import torch

from ..kernels.cpu import usable_cores


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"



def machine_info(device: str | None = None) -> dict:

    info = {
        "cpu": cpu_name(),
        "cores": usable_cores(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "date": _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat(),
        "device": device or ("cuda" if torch.cuda.is_available() else "cpu"),
        "torch_threads": torch.get_num_threads(),
    }
    if info["device"] == "cuda" and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:
        pass
    return info


def threads_label(threads) -> str:
    """What a run computed on: a run on one thread says so (benchmarks default to every usable
    core, as users run them); text (a table's own column) is kept as it is."""
    if isinstance(threads, str):
        return threads
    return "one thread (--threads 1)" if threads == 1 else f"{threads} threads"


def describe(machine: dict, threads: int | str | None = None) -> str:
    """The machine line of a section. `threads`: what the run's engines and anchors computed
    on (the document's --threads); where neither it nor the machine's compute_threads is
    recorded (older documents), torch's thread count as it was read."""
    gpu = f", GPU {machine['gpu']}" if machine.get("gpu") else ""
    threads = machine.get("compute_threads", threads)
    how = threads_label(threads) if threads else f"torch threads: {machine.get('torch_threads', '?')}"
    return (f"{machine['cpu']} ({machine['cores']} cores, {how}){gpu}; torch {machine['torch']}, "
            f"Python {machine['python']}; {machine['platform']}; {machine['date']}")
