"""pytest-benchmark timings of the loss methods on small CPU shapes, on the harness of fastgrpo/bench/loss.py.

Outside the default test run (pyproject's testpaths is tests/); run with

    python -m pytest benchmarks/test_loss_bench.py --benchmark-only

`fastgrpo bench loss` is the suite of record (subprocess per method, peak memory, FLOP rates, ratios, results
files); this file gives pytest-benchmark's statistics and `--benchmark-compare` across commits.
"""

import importlib.util

import pytest
import torch

from fastgrpo.bench.loss import FLOORS, Case, Settings, floor_backward, floor_logits, forward_fn, loss_fn, make_inputs

pytest.importorskip("pytest_benchmark")

HEAD, TOKENS, BETA = "cpu-h128-v16384", 512, 0.04
SETTINGS = Settings(device="cpu", dtype="fp32", repeats=1, warmup=0, threads=1)
METHODS = ["fastgrpo", "reference", "torch_lce", *FLOORS] + [m for m, pkg in (("trl", "trl"),
                                                                                         ("liger", "liger_kernel"))
                                                if importlib.util.find_spec(pkg) is not None]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(SETTINGS.threads)  # a shared CPU: OpenMP spin-waits otherwise dominate
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("method", METHODS)
def test_forward(benchmark, method):
    inp = make_inputs(Case(HEAD, TOKENS, BETA, "forward"), SETTINGS)
    forward = forward_fn(method, BETA, torch.device("cpu"))
    with torch.no_grad():
        benchmark.pedantic(forward, args=(inp,), rounds=5, warmup_rounds=1)


@pytest.mark.parametrize("method", METHODS)
def test_full(benchmark, method):
    inp = make_inputs(Case(HEAD, TOKENS, BETA, "full"), SETTINGS)
    if method in FLOORS:  # the 3-GEMM floors keep z from their forward, floor4 recomputes it
        step = lambda: (floor_backward(inp, floor_logits(inp, method), method) if method != "floor4"
                        else (floor_logits(inp), floor_backward(inp)))
    else:
        loss = loss_fn(method, BETA, torch.device("cpu"))
        step = lambda: loss(inp).backward()

    def clear_grads():
        inp.hidden.grad = inp.weight.grad = None

    benchmark.pedantic(step, setup=clear_grads, rounds=5, warmup_rounds=1)


@pytest.mark.parametrize("method", [m for m in METHODS if m not in FLOORS])
def test_backward(benchmark, method):
    inp = make_inputs(Case(HEAD, TOKENS, BETA, "backward"), SETTINGS)
    loss = loss_fn(method, BETA, torch.device("cpu"))

    def forward():
        inp.hidden.grad = inp.weight.grad = None
        return (loss(inp),), {}

    benchmark.pedantic(lambda value: value.backward(), setup=forward, rounds=5, warmup_rounds=1)
