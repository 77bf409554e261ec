"""Benchmark harness shared by the suites: environment record, peak memory, result files.

Every row a suite writes carries the device, library versions and date, so a results file stands on its own.
"""

import datetime
import json
import os
import platform
import re
from contextlib import contextmanager
from pathlib import Path

import torch


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    with open("/proc/cpuinfo") as cpuinfo:
        for line in cpuinfo:
            if line.startswith("model name"):
                return f"CPU {line.split(':', 1)[1].strip()} x{os.cpu_count()}"
    return f"CPU {platform.processor() or platform.machine()} x{os.cpu_count()}"


def environment(device: torch.device) -> dict:
    import transformers

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return {
        "device": device_name(device),
        "torch": torch.__version__,
        "triton": triton_version,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "date": datetime.date.today().isoformat(),
    }


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


def results_stem(suite: str, env: dict) -> str:
    device = re.sub(r"[^A-Za-z0-9]+", "-", env["device"]).strip("-").lower()
    return f"{suite}-{device}-{env['date']}"


def write_results(out_dir: str | Path, suite: str, env: dict, rows: list[dict], table: str) -> tuple[Path, Path]:
    """`<suite>-<device>-<date>.json` (env + rows) and `.md` (env + table) in out_dir."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = out_dir / results_stem(suite, env)
    json_path, md_path = stem.with_suffix(".json"), stem.with_suffix(".md")
    json_path.write_text(json.dumps({"suite": suite, "environment": env, "rows": rows}, indent=2) + "\n")
    header = ", ".join(f"{key} {value}" for key, value in env.items() if value is not None)
    md_path.write_text(f"# {suite}\n\n{header}\n\n{table}\n")
    return json_path, md_path


def markdown_table(rows: list[dict], columns: list[tuple[str, str, str]]) -> str:
    """columns: (title, row key, format spec)."""
    lines = ["| " + " | ".join(title for title, _, _ in columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        cells = [format(row[key], spec) if row.get(key) is not None else "-" for _, key, spec in columns]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
