"""Check fastgrpo on this machine: the environment, every Triton kernel against its PyTorch reference, the engine,
the loss and the trainer end to end, and the benchmarks that matter as ratios measured in this run.

On a GPU the kernels run at real models' shapes (bf16 and fp32; fp8 KV pages on compute capability 8.9+), with the
CPU tests' tolerances: a kernel's worst error against the float64 reference may be at most 1.5x the same-dtype
PyTorch reference's plus a small share of the value's scale (fastgrpo/check/tolerance.py). Without CUDA the kernel
checks need Triton's interpreter (TRITON_INTERPRET=1: fp32, the CPU tests' small shapes); the rest runs on the CPU.

Every check prints PASS, FAIL (with the worst error or the error's first line) or SKIP (with why); the run writes
check-<device>-<date>.md and .json to --out-dir (check-full-... with --full, check-interpreter-... under the
interpreter), which benchmarks/results/ takes as they are, and exits 1 when any check failed.

    fastgrpo check                        # default --quick: a few minutes on one GPU
    fastgrpo check --full                 # the benchmarks at the sizes of their issues
    TRITON_INTERPRET=1 fastgrpo check --only kernels     # the kernels in Triton's interpreter, on a CPU
"""

import argparse
import gc
import math
import os
import time
import traceback
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field

import torch

SECTIONS = ("kernels", "engine", "loss", "train", "timings")


@dataclass
class Result:
    section: str
    name: str
    status: str  # PASS, FAIL or SKIP
    detail: str
    seconds: float = 0.0
    values: dict = field(default_factory=dict)

    def line(self) -> str:
        return f"  {self.status:4s}  {self.name}: {self.detail}" + (f"  ({self.seconds:.1f} s)" if self.seconds else "")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="the default: the timings at sizes that take minutes")
    size.add_argument("--full", action="store_true", help="the timings at the sizes of the benchmarks' issues")
    parser.add_argument("--only", nargs="+", choices=SECTIONS, metavar="SECTION",
                        help=f"run only these sections ({', '.join(SECTIONS)}); default: all")
    parser.add_argument("--device", choices=("cpu", "cuda"), help="default: cuda when available")
    parser.add_argument("--out-dir", default="benchmarks/results", help="where the .md and .json results go")


def run(args: argparse.Namespace) -> list[Result]:
    from fastgrpo import bench
    from fastgrpo.check import environment

    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("fastgrpo check: --device cuda: no CUDA device is available")
    if args.device == "cuda" and interpreted:
        raise SystemExit("fastgrpo check: --device cuda with TRITON_INTERPRET=1: the interpreter runs the kernels on "
                         "the CPU; unset TRITON_INTERPRET to check the GPU")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() and not interpreted else "cpu"))
    bench.check_out_dir(args.out_dir)
    mode = "full" if args.full else "quick"
    sections = args.only or SECTIONS
    start = time.perf_counter()
    env = environment.describe(device)
    _print_environment(env, device)
    if device.type == "cpu" and not interpreted:
        print("no CUDA device: the Triton kernels are not run (TRITON_INTERPRET=1 runs them in Triton's interpreter, "
              "fp32, small shapes); running the CPU checks")
    results: list[Result] = []
    LOST.clear()
    for section in sections:
        print(f"{section}:", flush=True)
        for result in _section(section, device, mode):
            print(result.line(), flush=True)
            results.append(result)
        lost = _release(device, section, f"the {section} section")
        if lost is not None:
            print(lost.line(), flush=True)
            results.append(lost)
    elapsed = time.perf_counter() - start
    failed = [r for r in results if r.status == "FAIL"]
    counts = {status: sum(r.status == status for r in results) for status in ("PASS", "FAIL", "SKIP")}
    summary = (f"{counts['PASS']} passed, {counts['FAIL']} failed, {counts['SKIP']} skipped in {elapsed / 60:.1f} min "
               f"({mode}, {env['device']})")
    json_path, md_path = _write(args.out_dir, env, results, summary, mode)
    print(f"{summary}; wrote {md_path} and {json_path}")
    if failed:
        names = "; ".join(f"{r.name}" for r in failed)
        raise SystemExit(f"fastgrpo check: {len(failed)} of {len(results)} checks failed: {names}")
    return results


# The check after which this process's CUDA context failed (a kernel's illegal access poisons it): the checks that
# would run in this process are skipped from then on; those in child processes (train, the timings' peers) run.
LOST: list[str] = []
IN_PROCESS = ("kernels", "engine", "loss")


def _section(section: str, device: torch.device, mode: str) -> Iterator[Result]:
    """The section's results; an exception outside its checks ends it with one FAIL, and the next section runs."""
    if LOST and section in IN_PROCESS:
        yield Result(section, section, "SKIP", f"the CUDA context failed after {LOST[0]}")
        return
    runs = SECTION_RUNS[section](device, mode)
    while True:
        start = time.perf_counter()
        try:
            result = next(runs)
        except StopIteration:
            return
        except Exception as error:  # noqa: BLE001
            yield _failure(section, f"{section} (the section stopped)", error, start, {})
            return
        yield result


def _release(device: torch.device, section: str, after: str) -> Result | None:
    """Free what the checks left cached (the child processes of later checks size their pools from free memory);
    on a CUDA context that failed, a FAIL naming the check `after` it (and LOST set)."""
    gc.collect()
    if device.type != "cuda" or LOST:
        return None
    start = time.perf_counter()
    try:
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
    except Exception as error:  # noqa: BLE001 (a failed context raises on every later call)
        LOST.append(after)
        return _failure(section, f"the CUDA context, after {LOST[0]}", error, start, {})
    return None


def _print_environment(env: dict, device: torch.device) -> None:
    from fastgrpo.check import environment

    if device.type == "cuda":
        print(f"{env['device']}: compute capability {env['capability']}, {env['multiprocessors']} SMs, "
              f"{env['memory_gib']} GiB; CUDA {env['cuda']}, driver {env['driver'] or 'unknown'}")
    else:
        print(f"{env['device']}, {env['cpu_threads']} torch threads"
              + (", Triton's interpreter (TRITON_INTERPRET=1)" if env["triton_interpreter"] else ""))
    print("  " + ", ".join(f"{name} {version or '-'}" for name, version in env["packages"].items()))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    try:
        for what, how in environment.choices(device, dtype):
            print(f"  {what}: {how}")
    except Exception as error:  # noqa: BLE001 (the checks below say more)
        print(f"  note: the paths chosen could not be read: {type(error).__name__}: {str(error).strip()[:200]}")
    for note in environment.version_notes(env["packages"]):
        print(f"  note: {note}")


def _guarded(section: str, name: str, fn, **values) -> Result:
    """fn() -> (detail, passed, more values) as a Result with `values`; an exception is a FAIL with its first line."""
    start = time.perf_counter()
    try:
        detail, passed, more = fn()
    except Exception as error:  # noqa: BLE001 (a check that raises failed; the next one still runs)
        return _failure(section, name, error, start, values)
    values.update(more, **({} if passed else {"error": detail}))
    return Result(section, name, "PASS" if passed else "FAIL", detail, time.perf_counter() - start, values)


def _failure(section: str, name: str, error: Exception, start: float, values: dict) -> Result:
    """A check that raised: FAIL with the exception's type, first line and where it was raised."""
    message = str(error).strip().splitlines()[0] if str(error).strip() else ""
    where = traceback.extract_tb(error.__traceback__)[-1]
    detail = f"{type(error).__name__}: {message} ({os.path.basename(where.filename)}:{where.lineno})"
    return Result(section, name, "FAIL", detail, time.perf_counter() - start, {**values, "error": detail})


# -- the sections: each yields its results as they finish --


def kernel_results(device: torch.device, mode: str) -> Iterator[Result]:
    from fastgrpo.check import environment, kernels

    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    if device.type == "cpu" and not interpreted:
        for kernel in kernels.KERNELS:
            yield Result("kernels", kernel, "SKIP", "no CUDA device (TRITON_INTERPRET=1 runs it on the CPU)")
        return
    sizes = kernels.INTERPRETED if device.type == "cpu" else kernels.REAL
    fp8 = environment.fp8_pages(device)
    for kernel, case, check in kernels.cases(device, sizes, fp8):
        def measured(check=check):
            m = check()
            detail = f"worst error {m.error:.2e}, limit {m.limit:.2e}" + (f" {m.note}" if m.note else "")
            finite = math.isfinite(m.error)  # (JSON has no infinity)
            return detail, m.error <= m.limit, {"worst_error": m.error if finite else None, "limit": m.limit}
        yield _guarded("kernels", f"{kernel} {case}", measured, kernel=kernel)
        lost = _release(device, "kernels", f"{kernel} {case}")
        if lost is not None:
            yield lost
            return
    if not fp8:
        why = "Triton's interpreter rounds fp32 -> e4m3 wrongly" if device.type == "cpu" else \
            "the GPU has no e4m3 conversions (compute capability < 8.9)"
        yield Result("kernels", "paged_attention and rope_store on fp8 pages", "SKIP", why)


def engine_results(device: torch.device, mode: str) -> Iterator[Result]:
    from fastgrpo.check import end_to_end

    checks = end_to_end.engine_checks(device)
    while True:  # each check as it finishes; an exception ends the section with a FAIL
        start = time.perf_counter()
        try:
            name, detail, ok = next(checks)
        except StopIteration:
            return
        except Exception as error:  # noqa: BLE001
            yield _failure("engine", "engine end to end", error, start, {})
            return
        yield Result("engine", name, "PASS" if ok else "FAIL", detail, time.perf_counter() - start,
                     {} if ok else {"error": detail})


def loss_results(device: torch.device, mode: str) -> Iterator[Result]:
    from fastgrpo.check import end_to_end

    if device.type == "cuda":  # Qwen2.5-0.5B's head
        runs = [((896, 151936), 2048, torch.bfloat16), ((896, 151936), 2048, torch.float32)]
    else:
        runs = [((128, 16384), 512, torch.float32)]
    for head, tokens, dtype in runs:
        def step(head=head, tokens=tokens, dtype=dtype):
            _, detail, ok = end_to_end.loss_check(device, head, tokens, dtype)
            return detail, ok, {}
        yield _guarded("loss", f"fused loss step = reference ({'bf16' if dtype == torch.bfloat16 else 'fp32'})", step)


def train_results(device: torch.device, mode: str) -> Iterator[Result]:
    from fastgrpo.check import end_to_end

    def step():
        _, detail, ok = end_to_end.train_check(device)
        return detail, ok, {}
    yield _guarded("train", "one `fastgrpo train` step", step)


def timing_results(device: torch.device, mode: str) -> Iterator[Result]:
    from fastgrpo.check import timings

    plan = timings.PLANS[(device.type, mode)]
    skipped: list[str] = []

    def loss():
        found, missing = timings.loss_rows(device, plan)
        skipped.extend(missing)
        for r in found:  # a peer that fails (out of memory, a compile error) is not fastgrpo's failure
            if "error" in r and r["method"] not in ("fastgrpo", "floor"):
                skipped.append(f"{r['method']}: skipped, {r['head']} N={r['tokens']} {r['mode']}: {r['error']}")
        errors = [f"{r['method']} {r['head']} N={r['tokens']} {r['mode']}: {r['error']}" for r in found
                  if "error" in r and r["method"] in ("fastgrpo", "floor")]
        if errors:
            return "; ".join(errors), False, {"rows": found}
        lines = []
        for row in found:
            if row["method"] != "fastgrpo":
                continue
            peers = [f"{name} {row[key]:.2f}" for name, key in (("/ floor", "time_vs_floor"), ("/ TRL", "time_vs_trl"),
                                                                ("/ torch", "time_vs_torch_lce"),
                                                                ("/ Liger", "time_vs_liger")) if row.get(key)]
            what = "loss step" if row["mode"] == "full" else "no-grad logprobs"
            lines.append(f"{what} {row['head']} N={row['tokens']} {row['dtype']}: {row['seconds'] * 1e3:.2f} ms, "
                         + ", ".join(peers))
        return "; ".join(lines), True, {"rows": found}

    yield _guarded("timings", "loss and logprobs vs the 3-GEMM floor and TRL", loss)
    for reason in skipped:  # loss.available's "<method>: skipped, <why>"
        method, why = reason.split(": skipped, ", 1)
        yield Result("timings", f"loss timings' {method} method", "SKIP", why)

    def decode():
        row = timings.decode_step(device, plan)
        detail = (f"{row['shape']} {row['dtype']}, {row['sequences']} sequences at context {row['context']:.0f}, "
                  f"{row['attention']} attention, {row['layers']} layers: {row['step_ms']:.2f} ms a step, floor "
                  f"{row['floor_ms']:.2f} ms ({(row['weight_bytes'] + row['kv_bytes']) / 1e9:.2f} GB at "
                  f"{row['bandwidth_gbs']:.0f} GB/s copy bandwidth): {row['vs_floor']:.2f}x the floor")
        if row["step_ms"] <= 0:  # the machine's noise exceeded the K steps' time
            detail = (f"the call of {2 * plan.decode_steps + 1} new tokens ({row['long_call_s']:.3f} s) was not slower "
                      f"than the call of {plan.decode_steps + 1} ({row['short_call_s']:.3f} s): too noisy to time")
        return detail, row["step_ms"] > 0, row

    if LOST:  # (this process's CUDA context: the other timings run in child processes)
        yield Result("timings", "decode step vs its bytes floor", "SKIP", f"the CUDA context failed after {LOST[0]}")
    else:
        yield _guarded("timings", "decode step vs its bytes floor", decode)

    def sampling():
        found = timings.sampling_rows(device, plan)
        errors = [f"{r['method']}: {r['error']}" for r in found if "error" in r]
        if errors:
            return "; ".join(errors), False, {"rows": found}
        engine, hf = found
        detail = (f"{engine['shape']} {engine['dtype']}, {engine['prompts']} x {engine['group_size']}, prompt "
                  f"{engine['prompt_len']}, {engine['max_new_tokens']} new tokens: {engine['tokens_per_s']:.0f} vs "
                  f"{hf['tokens_per_s']:.0f} tokens/s, {engine['speedup_vs_hf_generate']:.2f}x HF generate")
        return detail, True, {"rows": found}

    yield _guarded("timings", "sampling tokens/s vs HF generate", sampling)


SECTION_RUNS = {"kernels": kernel_results, "engine": engine_results, "loss": loss_results, "train": train_results,
                "timings": timing_results}


# -- the results file --


def _write(out_dir: str, env: dict, results: list[Result], summary: str, mode: str):
    from fastgrpo import bench
    from fastgrpo.check import environment
    from fastgrpo.check.kernels import extra_tolerances

    flat = {key: value for key, value in env.items() if key != "packages"}
    flat["packages"] = ", ".join(f"{name} {version}" for name, version in env["packages"].items() if version)
    flat["notes"] = "; ".join(environment.version_notes(env["packages"])) or None
    lines = [f"`fastgrpo check{' --full' if mode == 'full' else ''}`: {summary}.", "",
             "Kernels: worst error against the float64 reference; limit = 1.5 x the same-dtype PyTorch reference's "
             f"error + a share of the value's scale ({extra_tolerances()}). Timings: ratios of times measured in this "
             "run.", ""]
    for section in dict.fromkeys(r.section for r in results):
        lines += [f"## {section}", "", "| check | result | detail | seconds |", "|---|---|---|---|"]
        lines += [f"| {r.name} | {r.status} | {r.detail.replace('|', '/')} | {r.seconds:.1f} |"
                  for r in results if r.section == section]
        lines.append("")
    rows = [{**{k: v for k, v in asdict(r).items() if k != "values"}, **r.values} for r in results]
    # (named apart: a CPU's run under the interpreter, a --full run)
    suite = "check" + ("-interpreter" if env["triton_interpreter"] else "") + ("-full" if mode == "full" else "")
    return bench.write_results(out_dir, suite, flat, rows, "\n".join(lines))
