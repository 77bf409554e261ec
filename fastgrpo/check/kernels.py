"""Every Triton kernel of the package against its PyTorch reference, three ways (tolerance.py): the reference in
float64 on the inputs rounded to the dtype, the reference in the dtype, the kernel in the dtype.

    logit_row_stats   lse, logp, entropy of fp32 logit rows (softcap or not)       the loss's row pass
    logit_row_grad    the logit gradient, into fp32 or bf16                       the loss's gradient pass
    paged_attention   prefill, decode and mixed batches over KV pages; sliding windows with sinks, softcaps, head dims
                      128 to 512, fp8 pages
    add_rms_norm, rope_store, silu_mul   the engine's fused decode layers (rope_store into fp8 pages too)
    fused_sample      greedy, temperature, top-k over a real vocabulary

On a GPU the shapes are real models' (Qwen2.5-7B's heads and MLP, Qwen's 151936-token vocabulary, gpt-oss's and
Gemma's attention), in bf16 and fp32; fp8 pages where the GPU converts e4m3 (compute capability 8.9+). Under
Triton's interpreter (TRITON_INTERPRET=1 on a CPU) the shapes are the CPU tests' small ones, fp32 only: the
interpreter returns garbage for tl.dot on bf16 and rounds fp32 -> e4m3 wrongly just below a power of two.

Each kernel is called through its module's attribute (`logit_rows.logit_row_stats`, ...), so what runs is what the
package exports at that moment.
"""

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from fastgrpo.check.tolerance import EXTRA_TOL, max_error, no_worse_limit, row_grad_limit, ulp

KERNELS = ("logit_row_stats", "logit_row_grad", "paged_attention", "add_rms_norm", "rope_store", "silu_mul",
           "fused_sample")
SOFTCAP = 30.0  # Gemma 2's final_logit_softcapping
BOUNDARY = 1e-6  # a sampled token may differ from PyTorch's only where u W lies this close (relative) to a cdf step


@dataclass(frozen=True)
class AttentionCase:
    name: str
    group: int  # query heads per KV head
    head_dim: int
    seqs: tuple[tuple[int, int], ...]  # (context length, new tokens) per sequence
    window: int | None = None
    softcap: float | None = None
    sinks: bool = False
    fp8: bool = False
    dtypes: tuple[torch.dtype, ...] = (torch.bfloat16,)


@dataclass(frozen=True)
class Sizes:
    """The shapes of one run: a real model's on a GPU, the CPU tests' under the interpreter."""

    rows: int  # logit rows
    vocab: int
    tokens: int  # decode ops: tokens, hidden and MLP width; rope: query and KV heads of head_dim
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    sample_rows: int
    sample_vocab: int
    kv_heads_attention: int
    block_size: int
    attention: tuple[AttentionCase, ...]
    dtypes: tuple[torch.dtype, ...]


def _decode_seqs(count: int, longest: int, seed: int = 0) -> tuple[tuple[int, int], ...]:
    g = torch.Generator().manual_seed(seed)
    return tuple((int(n), 1) for n in torch.randint(1, longest + 1, (count,), generator=g))


# Prefill, chunked prefill and decode in one batch, lengths off every tile and page size.
_MIXED = ((700, 300), (512, 512), (1, 1), (33, 33)) + _decode_seqs(16, 1500, seed=1)
REAL = Sizes(
    rows=1024, vocab=151936, tokens=512, hidden=3584, intermediate=18944, heads=28, kv_heads=4, head_dim=128,
    sample_rows=512, sample_vocab=151936, kv_heads_attention=4, block_size=16, dtypes=(torch.bfloat16, torch.float32),
    attention=(
        AttentionCase("decode, 64 sequences, Qwen2.5-7B heads", 7, 128, _decode_seqs(64, 2048),
                      dtypes=(torch.bfloat16, torch.float32)),
        AttentionCase("prefill + decode, Qwen2.5-7B heads", 7, 128, _MIXED, dtypes=(torch.bfloat16, torch.float32)),
        AttentionCase("sliding window 128 + sinks, gpt-oss heads", 8, 64, _MIXED, window=128, sinks=True),
        AttentionCase("softcap 50, Gemma 2 heads (256)", 2, 256, _MIXED, softcap=50.0),
        AttentionCase("sliding window 512, head_dim 512 (Gemma 4 global)", 8, 512, _MIXED[:6], window=512),
        AttentionCase("prefill + decode, Qwen2.5-7B heads", 7, 128, _MIXED, fp8=True),
    ),
)  # fmt: skip
INTERPRETED = Sizes(
    rows=7, vocab=4099, tokens=5, hidden=96, intermediate=1100, heads=6, kv_heads=2, head_dim=16, sample_rows=16,
    sample_vocab=2 * 2048 + 333, kv_heads_attention=2, block_size=4, dtypes=(torch.float32,),
    attention=(
        AttentionCase("prefill + decode", 3, 16, ((40, 1), (9, 9), (21, 5), (3, 1)), dtypes=(torch.float32,)),
        AttentionCase("sliding window 8 + sinks", 2, 16, ((40, 1), (21, 13)), window=8, sinks=True,
                      dtypes=(torch.float32,)),
        AttentionCase("softcap 20", 2, 32, ((17, 17), (30, 1)), softcap=20.0, dtypes=(torch.float32,)),
    ),
)  # fmt: skip


@dataclass
class Measured:
    error: float  # the kernel's worst error against the float64 truth
    limit: float
    note: str = ""


Case = tuple[str, str, Callable[[], Measured]]  # (kernel, case name, run)


def cases(device: torch.device, sizes: Sizes, fp8: bool) -> list[Case]:
    """Every kernel check at these sizes; `fp8`: the device converts e4m3."""
    out: list[Case] = []
    for softcap in (None, SOFTCAP):
        cap = "" if softcap is None else f", softcap {softcap:g}"
        out.append(("logit_row_stats", f"fp32 [{sizes.rows} x {sizes.vocab}]{cap}",
                    lambda softcap=softcap: _row_stats(device, sizes, softcap)))
        for out_dtype in sizes.dtypes:
            out.append(("logit_row_grad", f"fp32 -> {_name(out_dtype)} [{sizes.rows} x {sizes.vocab}]{cap}",
                        lambda softcap=softcap, d=out_dtype: _row_grad(device, sizes, softcap, d)))
    for case in sizes.attention:
        if case.fp8 and not fp8:
            continue
        for dtype in case.dtypes:
            pages = "fp8 pages, " if case.fp8 else ""
            out.append(("paged_attention", f"{_name(dtype)} {pages}{case.name}",
                        lambda case=case, dtype=dtype: _attention(device, sizes, case, dtype)))
    for dtype in sizes.dtypes:
        d = _name(dtype)
        for residual in (True, False):
            out.append(("add_rms_norm", f"{d} [{sizes.tokens} x {sizes.hidden}]{'' if residual else ', no residual'}",
                        lambda dtype=dtype, residual=residual: _add_rms_norm(device, sizes, dtype, residual)))
        heads = f"{sizes.heads} q / {sizes.kv_heads} kv heads of {sizes.head_dim}"
        for qk_norm in (False, True):
            out.append(("rope_store", f"{d} {sizes.tokens} tokens, {heads}{', q/k norms' if qk_norm else ''}",
                        lambda dtype=dtype, qk_norm=qk_norm: _rope_store(device, sizes, dtype, qk_norm, False)))
        if fp8 and dtype == torch.bfloat16:
            out.append(("rope_store", f"{d} into fp8 pages, {heads}",
                        lambda dtype=dtype: _rope_store(device, sizes, dtype, False, True)))
        out.append(("silu_mul", f"{d} [{sizes.tokens} x 2 x {sizes.intermediate}]",
                    lambda dtype=dtype: _silu_mul(device, sizes, dtype)))
        for temperature, top_k in ((0.0, 0), (1.0, 0), (0.7, 50)):
            how = "greedy" if temperature == 0 else f"temperature {temperature:g}"
            how += f", top-k {top_k}" if top_k else ""
            out.append(("fused_sample", f"{d} logits [{sizes.sample_rows} x {sizes.sample_vocab}], {how}",
                        lambda dtype=dtype, t=temperature, k=top_k: _sample(device, sizes, dtype, t, k)))
    return out


def _name(dtype: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]


def _generator(device: torch.device, seed: int) -> torch.Generator:
    return torch.Generator(device).manual_seed(seed)


def _worst(*pairs: tuple[float, float]) -> Measured:
    """The output nearest its limit (the largest error / limit) among (error, limit) pairs."""
    error, limit = max(pairs, key=lambda pair: pair[0] / pair[1] if pair[1] > 0 else math.inf)
    return Measured(error, limit)


def _three_way(fast: torch.Tensor, same: torch.Tensor, truth: torch.Tensor, dtype: torch.dtype) -> tuple[float, float]:
    if not torch.isfinite(fast).all():
        return math.inf, no_worse_limit(same, truth, dtype)
    return max_error(fast, truth), no_worse_limit(same, truth, dtype)


# -- the loss's row passes --


def _logits(device, sizes: Sizes, seed: int):
    """z [C, V] fp32 with a row stride of V + 3 (not contiguous); ids [C] with the first and last columns among them;
    the upstream gradients g, h [C]."""
    g = _generator(device, seed)
    C, V = sizes.rows, sizes.vocab
    z = (torch.randn(C, V + 3, generator=g, device=device) * 4.0)[:, :V]
    ids = torch.randint(0, V, (C,), generator=g, device=device)
    ids[0], ids[-1] = 0, V - 1
    return z, ids, torch.randn(C, generator=g, device=device), torch.randn(C, generator=g, device=device)


def _row_reference(z, ids, g, h, softcap, scale, dtype):
    """(lse, logp, entropy, scale * d(g logp + h entropy)/dz) in `dtype`, by autograd: the kernels' docstring."""
    z = z.detach().to(dtype).requires_grad_()
    zc = softcap * torch.tanh(z / softcap) if softcap else z
    lsm = zc.log_softmax(-1)
    logp = lsm.gather(-1, ids[:, None])[:, 0]
    entropy = -(lsm.exp() * lsm).sum(-1)
    (grad,) = torch.autograd.grad((g.to(dtype) * logp).sum() + (h.to(dtype) * entropy).sum(), z)
    return zc.logsumexp(-1).detach(), logp.detach(), entropy.detach(), grad * scale


def _row_stats(device, sizes: Sizes, softcap) -> Measured:
    from fastgrpo.kernels import logit_rows

    z, ids, g, h = _logits(device, sizes, seed=0)
    truth = _row_reference(z, ids, g, h, softcap, 1.0, torch.float64)[:3]
    same = _row_reference(z, ids, g, h, softcap, 1.0, torch.float32)[:3]
    fast = logit_rows.logit_row_stats(z, ids, softcap=softcap)
    return _worst(*(_three_way(f, s, t, torch.float32) for f, s, t in zip(fast, same, truth, strict=True)))


def _row_grad(device, sizes: Sizes, softcap, out_dtype) -> Measured:
    from fastgrpo.kernels import logit_rows

    z, ids, g, h = _logits(device, sizes, seed=1)
    scale = 1.0 / 0.7  # a temperature's
    truth = _row_reference(z, ids, g, h, softcap, scale, torch.float64)
    same = _row_reference(z, ids, g, h, softcap, scale, torch.float32)
    lse, _, entropy = logit_rows.logit_row_stats(z, ids, softcap=softcap)
    out = logit_rows.logit_row_grad(z, ids, lse, entropy, g, h, scale=scale, softcap=softcap,
                                    out=torch.empty(z.shape, dtype=out_dtype, device=device))
    if not torch.isfinite(out).all():
        return Measured(math.inf, 0.0, "non-finite values")
    limit = row_grad_limit(same[3], truth[3], truth[0], g, ids, scale)
    if out_dtype == torch.float32:
        return Measured(max_error(out, truth[3]), limit)
    # One rounding of an fp32 value within the fp32 limit: the error beyond one ulp of out's dtype, against that limit.
    beyond = ((out.double() - truth[3]).abs() - ulp(truth[3], out_dtype)).max().item()
    note = f"(beyond one {_name(out_dtype)} ulp; error {max_error(out, truth[3]):.2e})"
    return Measured(max(beyond, 0.0), limit, note)


# -- paged attention --


def _paged_inputs(device, sizes: Sizes, case: AttentionCase, seed: int):
    """Scattered pages of random float64 K/V (a forked group's shared prefix aside), block tables, queries."""
    g = torch.Generator().manual_seed(seed)
    block = sizes.block_size
    needs = [-(-ctx // block) for ctx, _ in case.seqs]
    num_blocks = sum(needs) + 1
    order = torch.randperm(num_blocks, generator=g).tolist()
    tables = [[order.pop() for _ in range(n)] for n in needs]
    width = max(needs)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    kv_heads = sizes.kv_heads_attention
    shape = (num_blocks, block, kv_heads, case.head_dim)
    k, v = (torch.randn(shape, generator=g, dtype=torch.float64) for _ in range(2))
    q_lens = [q for _, q in case.seqs]
    q = torch.randn(sum(q_lens), case.group * kv_heads, case.head_dim, generator=g, dtype=torch.float64)
    sinks = torch.randn(case.group * kv_heads, generator=g) * 2 if case.sinks else None
    context_lens = torch.tensor([c for c, _ in case.seqs], dtype=torch.int32)
    query_starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    to = lambda t: t.to(device)
    return to(q), to(k), to(v), to(block_tables), to(context_lens), to(query_starts), q_lens, \
        None if sinks is None else to(sinks)


def _attention(device, sizes: Sizes, case: AttentionCase, dtype) -> Measured:
    from fastgrpo.kernels import paged_attention as kernel
    from fastgrpo.sampling.attention import Variant, quantize_kv, reference_paged_attention

    q, k, v, tables, context_lens, query_starts, q_lens, sinks = _paged_inputs(device, sizes, case, seed=2)
    variant = Variant(window=case.window, softcap=case.softcap, sinks=sinks)
    scale = case.head_dim**-0.5
    k_scale = v_scale = None
    if case.fp8:  # e4m3 pages with a power of two per KV head over its largest value (as kv_scales bounds them)
        k_scale, v_scale = (2.0 ** (t.abs().amax(dim=(0, 1, 3)) / 448).log2().ceil().float() for t in (k, v))
        k_d, v_d = (quantize_kv(t.flatten(0, 1), s).view(t.shape) for t, s in ((k, k_scale), (v, v_scale)))
        truth_k, truth_v = (t.double() * s.double()[:, None] for t, s in ((k_d, k_scale), (v_d, v_scale)))
    else:
        k_d, v_d = k.to(dtype), v.to(dtype)
        truth_k, truth_v = k_d.double(), v_d.double()
    q_d = q.to(dtype)
    extra = dict(max_query_len=max(q_lens), variant=variant)
    truth = reference_paged_attention(q_d.double(), truth_k, truth_v, tables, context_lens, query_starts, scale,
                                      **extra)
    same = reference_paged_attention(q_d, k_d, v_d, tables, context_lens, query_starts, scale, k_scale=k_scale,
                                     v_scale=v_scale, **extra)
    tiles = kernel.tiles_for(case.group, max(q_lens), dtype, case.head_dim)
    tile_seqs, tile_starts = kernel.attention_tiles(q_lens, tiles.block_m // case.group)
    as_i32 = lambda values: torch.tensor(values, dtype=torch.int32, device=device)
    fast = kernel.paged_attention(q_d, k_d, v_d, tables, context_lens, query_starts, as_i32(tile_seqs),
                                  as_i32(tile_starts), scale, tiles, k_scale=k_scale, v_scale=v_scale,
                                  window=case.window, softcap=case.softcap, sinks=sinks)
    return _worst(_three_way(fast, same, truth, dtype))


# -- the fused decode layers' elementwise kernels, against the PyTorch ops they replace --


def _rms_norm(x, weight, eps):
    """transformers' LlamaRMSNorm / Qwen3RMSNorm: fp32 (float64 stays float64), back to x's dtype, times the weight."""
    h = x.to(torch.promote_types(x.dtype, torch.float32))
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def _add_rms_norm(device, sizes: Sizes, dtype, residual: bool) -> Measured:
    from fastgrpo.kernels import decode_ops

    g = _generator(device, 3)
    x, r = (torch.randn(sizes.tokens, sizes.hidden, generator=g, device=device).to(dtype) for _ in range(2))
    w = (1 + 0.1 * torch.randn(sizes.hidden, generator=g, device=device)).to(dtype)
    eps = 1e-6

    def reference(x, r, w):
        summed = x + r if residual else x
        return _rms_norm(summed, w, eps), summed

    truth = reference(x.double(), r.double(), w.double())
    same = reference(x, r, w)
    fast = decode_ops.add_rms_norm(x, r if residual else None, w, eps)
    return _worst(*(_three_way(f, s, t, dtype) for f, s, t in zip(fast, same, truth, strict=True)))


def _rope_store(device, sizes: Sizes, dtype, qk_norm: bool, fp8: bool) -> Measured:
    from fastgrpo.kernels import decode_ops
    from fastgrpo.sampling.attention import FP8
    from fastgrpo.sampling.decode_layers import rotate_half

    g = _generator(device, 4)
    T, Hq, Hkv, D = sizes.tokens, sizes.heads, sizes.kv_heads, sizes.head_dim
    qkv = torch.randn(T, (Hq + 2 * Hkv) * D, generator=g, device=device).to(dtype)
    angles = torch.rand(T, D // 2, generator=g, device=device) * 6
    cos, sin = (torch.cat([f(angles)] * 2, -1).to(dtype) for f in (torch.cos, torch.sin))
    norms = [(1 + 0.1 * torch.randn(D, generator=g, device=device)).to(dtype) for _ in range(2)] if qk_norm else None
    slots = torch.randperm(2 * T, generator=torch.Generator().manual_seed(5))[:T].to(device)
    page = sizes.block_size
    eps = 1e-6

    def reference(qkv, cos, sin, norms):  # FusedDecoder's torch ops
        q, k, v = qkv.split([Hq * D, Hkv * D, Hkv * D], dim=-1)
        q, k, v = q.view(T, Hq, D), k.view(T, Hkv, D), v.view(T, Hkv, D)
        if norms is not None:
            q, k = _rms_norm(q, norms[0], eps), _rms_norm(k, norms[1], eps)
        q = q * cos[:, None] + rotate_half(q) * sin[:, None]
        k = k * cos[:, None] + rotate_half(k) * sin[:, None]
        return q, k, v

    truth = reference(qkv.double(), cos.double(), sin.double(), None if norms is None else [n.double() for n in norms])
    same = reference(qkv, cos, sin, norms)
    cache_dtype = FP8 if fp8 else dtype
    caches = [torch.zeros(-(-2 * T // page), page, Hkv, D, dtype=cache_dtype, device=device) for _ in range(2)]
    scales = None
    if fp8:  # a power of two per KV head over the largest key (value) of the truth
        scales = [2.0 ** (t.abs().amax(dim=(0, 2)) / 448).log2().ceil().float() for t in truth[1:]]
    q = decode_ops.rope_store(qkv, cos, sin, *(norms or (None, None)), *caches, slots, Hq, eps,
                              *(scales or (None, None)))
    k_out, v_out = (c.flatten(0, 1)[slots] for c in caches)
    pairs = [_three_way(q, same[0], truth[0], dtype)]
    if fp8:  # in the pages' units (k / k_scale): within half an e4m3 step (one rounding) + the bf16 input's error
        for out, t, scale in zip((k_out, v_out), truth[1:], scales, strict=True):
            t8 = t / scale.double()[:, None]
            allowed = 0.5 * _e4m3_step(t8) + 2**-7 * t8.abs()
            pairs.append((((out.double() - t8).abs() / allowed).max().item(), 1.0))
    else:
        pairs += [_three_way(k_out, same[1], truth[1], dtype), _three_way(v_out, same[2], truth[2], dtype)]
    return _worst(*pairs)


def _e4m3_step(x: torch.Tensor) -> torch.Tensor:
    """The spacing of float8_e4m3fn at |x| (3 significand bits; subnormals below 2^-6 step by 2^-9)."""
    _, exp = torch.frexp(x.abs().clamp(min=2**-6))  # |x| = m 2^exp, m in [0.5, 1): spacing 2^(exp - 1 - 3)
    return torch.ldexp(torch.ones_like(x), exp - 4)


def _silu_mul(device, sizes: Sizes, dtype) -> Measured:
    from fastgrpo.kernels import decode_ops

    gate_up = (torch.randn(sizes.tokens, 2 * sizes.intermediate, generator=_generator(device, 6), device=device) * 3
               ).to(dtype)
    reference = lambda t: torch.nn.functional.silu(t.chunk(2, -1)[0]) * t.chunk(2, -1)[1]
    return _worst(_three_way(decode_ops.silu_mul(gate_up), reference(gate_up), reference(gate_up.double()), dtype))


# -- the fused sampler --


def _sample(device, sizes: Sizes, dtype, temperature: float, top_k: int) -> Measured:
    from fastgrpo.kernels import sampling as kernel
    from fastgrpo.sampling.params import SamplingParams
    from fastgrpo.sampling.sampler import logit_floor, processed_logits, sample, uniforms

    R, V = sizes.sample_rows, sizes.sample_vocab
    logits = (torch.randn(R, V, generator=_generator(device, 7), device=device) * 4).to(dtype)
    params = SamplingParams(temperature=temperature, top_k=top_k)
    u = None if params.greedy else uniforms(7, torch.arange(R, device=device), torch.full((R,), 2, device=device))
    tokens, logprobs = kernel.fused_sample(logits, temperature, u, logit_floor(logits, params))
    want, _ = sample(logits.float(), params, u)
    rows = torch.arange(R, device=device)
    z64 = processed_logits(logits.double(), params, None)
    truth = z64.log_softmax(-1)[rows, tokens]
    same = processed_logits(logits.float(), params, None).log_softmax(-1)[rows, tokens]
    error, limit = _three_way(logprobs, same, truth, torch.float32)
    differ = (tokens != want).nonzero()[:, 0].tolist()
    if params.greedy and differ:
        return Measured(math.inf, limit, f"greedy tokens differ from torch.argmax in {len(differ)} of {R} rows")
    for row in differ:  # allowed only at a step of the cdf that u W lies on (rounding decides it either way)
        weights = (z64[row] - z64[row].max()).exp()
        cdf = weights.cumsum(0)
        low, high = sorted((int(tokens[row]), int(want[row])))
        target = u[row].item() * cdf[-1].item()
        if abs(cdf[low].item() - target) > BOUNDARY * cdf[-1].item() or cdf[high - 1] - cdf[low] > BOUNDARY * cdf[-1]:
            return Measured(math.inf, limit, f"row {row}: token {int(tokens[row])}, PyTorch's sampler "
                                             f"{int(want[row])}, u W {target:.6g} not at a cdf step between them")
    note = f"(tokens equal to PyTorch's in {R - len(differ)} of {R} rows, the rest at a cdf step)" if differ else ""
    return Measured(error, limit, note)


def extra_tolerances() -> str:
    """The rule's constants, for the report."""
    return ", ".join(f"{_name(d)} {t:g}" for d, t in EXTRA_TOL.items() if d != torch.float64)
