"""Peak memory probes: the CUDA allocator's peak on a GPU, the resident set's peak on a CPU (Linux `/proc`).

Shared by the trainer's step metrics and the benchmark harness.
"""

from contextlib import contextmanager

import torch


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def reset_peak_memory(device: torch.device) -> int:
    """Start a new peak window; returns the memory in use now (bytes): CUDA allocated, or resident set (Linux)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        return torch.cuda.memory_allocated(device)
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")  # reset the peak RSS to the current RSS
    return _status_kib("VmRSS") * 1024


def peak_memory(device: torch.device) -> int:
    """Peak bytes in use since the last reset_peak_memory."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device)
    return _status_kib("VmHWM") * 1024


class PeakMemory:
    """Peak memory above the level at entry: CUDA allocator peak on a GPU, resident set peak on a CPU (Linux).

    On a CPU the allocator keeps freed pages resident, so measure one method per process for clean figures.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.peak_bytes = 0

    @contextmanager
    def measure(self):
        base = reset_peak_memory(self.device)
        yield self
        self.peak_bytes = peak_memory(self.device) - base
