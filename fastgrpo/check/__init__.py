"""`fastgrpo check`: does fastgrpo compute the right numbers on this machine, and how fast is it here?

    environment.py   the device, the versions, which paths the loss and the engine take and why
    kernels.py       every Triton kernel against its PyTorch reference at real shapes (tolerance.py: the tests' rule)
    end_to_end.py    the engine (greedy = HF generate, fused layers, CUDA graphs), a loss step, a `fastgrpo train` step
    timings.py       the benchmarks that matter, as ratios measured in the same run
    command.py       the command: runs them, prints PASS / FAIL / SKIP, writes one results file, exits non-zero on a
                     failure
"""
