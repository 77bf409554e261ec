"""Benchmark harness shared by the suites: environment record, peak memory, timing, one process per method, result
files.

Every row a suite writes carries the device, library versions and date, so a results file stands on its own.
"""

import argparse
import datetime
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
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


def time_call(fn, device: torch.device, *, repeats: int, warmup: int, setup=None, warmup_peaks: bool = False):
    """(median seconds of `repeats` runs after `warmup` runs, peak bytes, last result) of `fn(setup())`.

    Only `fn` is timed (CUDA events on a GPU, perf_counter on a CPU); the peak is the growth above the level after
    `setup`, the maximum over the timed runs (and the warm-up runs with `warmup_peaks`: on a CPU the allocator keeps
    some freed pages resident, so later runs can grow the resident set less than the work needs)."""
    seconds, peaks, result = [], [], None
    for i in range(warmup + repeats):
        result = None  # free the previous run's outputs before the next setup
        state = setup() if setup is not None else None
        with PeakMemory(device).measure() as memory:
            if device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                result = fn(state)
                end.record()
                end.synchronize()
                elapsed = start.elapsed_time(end) / 1e3
            else:
                begin = time.perf_counter()
                result = fn(state)
                elapsed = time.perf_counter() - begin
        if i >= warmup:
            seconds.append(elapsed)
        if i >= warmup or warmup_peaks:
            peaks.append(memory.peak_bytes)
    return statistics.median(seconds), max(peaks), result


def run_in_child(module: str, method: str, payload: str, env: dict | None = None) -> tuple[object, str | None]:
    """`python -m <module> --one <method> <payload>` in a fresh process, so that no method sees another's caches,
    compiled kernels or memory peaks: (its last stdout line as JSON, None), or (None, its last stderr line)."""
    out = subprocess.run([sys.executable, "-m", module, "--one", method, payload], capture_output=True, text=True,
                         env=env)
    if out.returncode != 0:
        return None, (out.stderr.strip().splitlines() or ["no output"])[-1]
    return json.loads(out.stdout.strip().splitlines()[-1]), None


def suite_main(argv: list[str] | None, doc: str, add_arguments, run, one) -> None:
    """A suite's entry point: `--one METHOD PAYLOAD` is the child of `run_in_child` and prints `one(method, payload)`
    as JSON; anything else is the suite's own command line."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--one"]:
        print(json.dumps(one(argv[1], argv[2])))
        return
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    run(parser.parse_args(argv))


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
