"""How close a fast path must be to its reference: the rule of the test suite and of `fastgrpo check`, in one place.

Three ways: the reference in float64 on the inputs rounded to the dtype (the truth), the same reference in the dtype,
the fast path in the dtype. The fast path may be no worse than the reference in its own dtype, plus EXTRA_TOL of the
value's scale:

    |fast - truth|_max <= 1.5 |same - truth|_max + EXTRA_TOL[dtype] * max(|truth|_max, 1)
"""

import torch

# Allowed error of a fast path beyond the same-dtype torch reference's own error, relative to the value's scale.
# fp32: both are ~1e-6 off float64; the kernels' different summation order adds a few ulps over V terms.
# bf16: the fast paths keep fp32 logits where torch rounds them to bf16, so they are usually *closer* to float64.
EXTRA_TOL = {torch.float64: 1e-10, torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 2e-2}


def max_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return (got.double() - want.double()).abs().max().item() if got.numel() else 0.0


def no_worse_limit(same_dtype_ref: torch.Tensor, truth: torch.Tensor, dtype: torch.dtype) -> float:
    """The most a fast path in `dtype` may be off `truth` (the module docstring's rule)."""
    scale = truth.double().abs().max().clamp(min=1.0).item() if truth.numel() else 1.0
    return 1.5 * max_error(same_dtype_ref, truth) + EXTRA_TOL[dtype] * scale


def row_grad_limit(same: torch.Tensor, truth: torch.Tensor, lse: torch.Tensor, g: torch.Tensor, ids: torch.Tensor,
                   scale: float) -> float:
    """The logit gradient's limit (kernels/logit_rows.py, fp32): 1.5x fp32 torch's error + EXTRA_TOL, plus the error
    p = exp(z - lse) inherits from lse. lse [C] is an fp32 scalar per row, off by up to 2^-24 |lse|, which is p's
    relative error (torch keeps the row max apart from log s and does not pay it; it matters only for |lse| >> 1, e.g.
    6e-4 relative at |lse| = 1e4). truth, same [C, V]; g, ids [C]; the gradient's p-part is what that error scales."""
    V = truth.shape[1]
    hit = (ids >= 0) & (ids < V)
    onehot = torch.zeros_like(truth).scatter_(1, ids.clamp(0, V - 1)[:, None], 1.0)
    soft = truth - onehot * (g.double() * scale * hit)[:, None]  # -scale p (g + h (log p + H))
    return (1.5 * max_error(same, truth) + EXTRA_TOL[torch.float32] * truth.abs().max().clamp(min=1.0).item()
            + 2.0 * 2**-24 * lse.double().abs().max().item() * soft.abs().max().item())


def ulp(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The spacing of `dtype` (bf16, fp16) at each value of x, as float64, subnormals included."""
    digits = {torch.bfloat16: 8, torch.float16: 11}[dtype]  # significand bits
    e_min = int(torch.tensor(torch.finfo(dtype).tiny).log2())  # the smallest normal is 2^e_min
    _, exp = torch.frexp(x.double())  # |x| = mant 2^exp, mant in [0.5, 1): spacing 2^(exp - digits)
    exp = torch.where(x == 0, e_min + 1, exp)  # (frexp(0) has exponent 0; 0's neighbour is the smallest subnormal)
    return torch.ldexp(torch.ones_like(x, dtype=torch.float64), exp.clamp(min=e_min + 1) - digits)


def describe_mismatch(name: str, got: torch.Tensor, want: torch.Tensor, limit: float) -> str:
    diff = (got.double() - want.double()).abs()
    bad = (diff > limit).nonzero()[:5].tolist()
    return (f"{name}: max err {diff.max().item():.3e}, mean err {diff.mean().item():.3e}, limit {limit:.3e}, "
            f"first mismatches at {bad}: got {[got[tuple(i)].item() for i in bad]} want "
            f"{[want[tuple(i)].item() for i in bad]}")
