"""Benchmark harness shared by the suites: dtypes and model shapes, environment record, timing, one process per
method, result files (peak memory comes from fastgrpo.memory).

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
from pathlib import Path

import torch

from fastgrpo.memory import PeakMemory

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# Config-only model folders (config.json, no weights; package data) of real models' shapes: MODELS / "qwen2.5-7b"
MODELS = Path(__file__).with_name("models")
SHAPES = {  # Qwen2 model shapes (random weights) of the sampling and TRL-step suites
    "tiny": dict(vocab_size=4096, hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
                 num_key_value_heads=2),
    # a model whose forward costs almost nothing: what is left of a decode step is the sampler's own overhead
    "negligible": dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                       num_key_value_heads=1),
    "qwen2.5-1.5b": dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                         num_attention_heads=12, num_key_value_heads=2, tie_word_embeddings=True, rope_theta=1e6),
}  # fmt: skip


def add_device_arguments(parser: argparse.ArgumentParser, shape: str | None = None) -> None:
    """--device and --dtype, which every suite takes, and with `shape` (its help text) --shape."""
    parser.add_argument("--device", choices=("cpu", "cuda"), help="default: cuda when available")
    parser.add_argument("--dtype", choices=tuple(DTYPES), help="default: bf16 on cuda, fp32 on cpu")
    if shape is not None:
        parser.add_argument("--shape", choices=tuple(SHAPES), help=shape)


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


def start_run(args: argparse.Namespace) -> str:
    """The checks every suite runs before measuring anything: the device (`--device`, default cuda when available;
    returned) and `--out-dir`."""
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is available")
    check_out_dir(args.out_dir)
    return device


def check_out_dir(out_dir: str | Path) -> None:
    """Refuses --out-dir before any benchmark runs when it is a file, lies under one, or cannot be written."""
    path = Path(out_dir)
    existing = next(p for p in [path, *path.absolute().parents] if p.exists())
    if not existing.is_dir():
        raise SystemExit(f"--out-dir {out_dir} must be a folder, but {existing} is a file")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise SystemExit(f"--out-dir {out_dir}: {existing} is not writable")


def failed(row: dict) -> bool:
    return "error" in row


def write_results(out_dir: str | Path, suite: str, env: dict, rows: list[dict], table: str) -> tuple[Path, Path]:
    """`<suite>-<device>-<date>.json` (env + rows) and `.md` (env + table) in out_dir. A run in which a method failed
    never replaces earlier results: it takes the first free name of `<stem>`, `<stem>-2`, `<stem>-3`, ..."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = out_dir / results_stem(suite, env)
    if not rows or any(map(failed, rows)):
        stem = _free_stem(stem)
    json_path, md_path = stem.with_suffix(".json"), stem.with_suffix(".md")
    json_path.write_text(json.dumps({"suite": suite, "environment": env, "rows": rows}, indent=2) + "\n")
    header = ", ".join(f"{key} {value}" for key, value in env.items() if value is not None)
    md_path.write_text(f"# {suite}\n\n{header}\n\n{table}\n")
    return json_path, md_path


def _free_stem(stem: Path) -> Path:
    candidate, number = stem, 1
    while candidate.with_suffix(".json").exists() or candidate.with_suffix(".md").exists():
        number += 1
        candidate = stem.with_name(f"{stem.name}-{number}")
    return candidate


def publish(out_dir: str | Path, suite: str, env: dict, rows: list[dict], title: str, table: str) -> None:
    """A suite's ending: print the title, the table and each failed method's error, write the results files, and
    exit non-zero when no method produced a result."""
    print(title)
    print(table)
    for row in rows:
        if failed(row):
            print(f"{row['method']} failed: {row['error']}")
    json_path, md_path = write_results(out_dir, suite, env, rows, f"{title}\n\n{table}")
    print(f"wrote {json_path} and {md_path}")
    exit_if_all_failed(rows, json_path)


def exit_if_all_failed(rows: list[dict], json_path: Path) -> None:
    """A run in which no method produced a result exits non-zero (its errors stay on record in json_path)."""
    if all(map(failed, rows)):
        raise SystemExit(f"every method failed ({len(rows)} runs); their errors are in {json_path}")


def markdown_table(rows: list[dict], columns: list[tuple[str, str, str]]) -> str:
    """columns: (title, row key, format spec)."""
    lines = ["| " + " | ".join(title for title, _, _ in columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        cells = [format(row[key], spec) if row.get(key) is not None else "-" for _, key, spec in columns]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
