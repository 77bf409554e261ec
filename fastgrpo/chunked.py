"""The pieces of fastgrpo's default head (the loops are fastgrpo.grpo_head's): chunk sizes, the chunk GEMMs, the row
passes as registered ops (the compile boundary) and a CPU's blocked no-grad pass.

Per chunk of C selected tokens x_c [C, H], lm_head W [V, H], optional bias b [V], temperature T:

    Z     = (x_c W^T + b) / T              fp32 [C, V]   GEMM 1 (bf16 operands, fp32 output on CUDA)
    lse, logp, entropy                     [C]           row statistics: one read of Z
    g, h  = dL/dlogp, dL/dentropy          [C]           the loss's per-token math, on C numbers (the caller's)
    dZ    = (g (onehot(y) - p) - h p (log p + H)) / T     one read of Z, one write of dZ (in the GEMM dtype)
    dX_c  = dZ W                           [C, H]        GEMM 2, complete per chunk
    dW   += dZ^T x_c,  db += sum_c dZ      fp32 [V, H]   GEMM 3, accumulated over chunks

So a forward+backward is 3 GEMMs of 2 C H V FLOPs per chunk, the floor of any exact method (a bare linear layer's
forward and backward), plus two passes over Z whose time is bytes / bandwidth. Nothing is recomputed and nothing
is reduced with atomics. The row passes run as Triton kernels on CUDA (fastgrpo/kernels/logit_rows.py) and in PyTorch
elsewhere, behind two torch.library ops; logits are formed in fp32 and never rounded to the input dtype before
the logsumexp.

With no gradient wanted (old/ref passes, evaluation) a chunk costs one GEMM and the row statistics. A CPU forms
and consumes its logits one vocab block at a time (cpu_row_stats), so the exp runs on logits still in cache; it
checks its sums' range on the host, so under torch.compile the no-grad pass takes the chunk loop instead.

`token_logprobs` with a gradient (the caller's g, h arrive only in the backward) keeps the recompute form: the
backward forms each chunk's Z again (4 GEMMs in all).

Extra memory of the gradient-in-forward path: the Z chunk (4 C V bytes; dZ is written over it in fp32, or to a
2 C V-byte buffer in bf16), the fp32 dW accumulator (4 V H) and dX (N H in the input dtype); with the defaults below
that is at most ~2 GiB of chunk on a GPU and max(32 MiB, 256 rows) on a CPU, plus the accumulator. A CPU's no-grad
pass holds one or two blocks of CPU_BLOCK_BYTES instead of a chunk.
"""

import os
from contextlib import contextmanager
from dataclasses import dataclass

import torch

# Chunk of logits per GEMM: on CUDA large enough that GEMM 3's fp32 dW read-modify-write (8 V H bytes per chunk)
# stays under its 2 C V H FLOPs (compute-bound from C ~ 1200 on an H100: 989e12 / 3.35e12 * 4 B), on a CPU small
# enough to stay near the caches, but never under CPU_MIN_CHUNK_TOKENS rows: a CPU GEMM packs the whole [V, H] weight
# for every call, a cost that only enough rows amortise (measured, 1 thread, H 1024, V 151936, fp32: 55-row chunks
# made token_logprobs 1.60x one GEMM and the loss's forward + backward 1.85x its 3 GEMMs; 256 rows, 1.13x and 1.40x).
# FASTGRPO_CHUNK_TOKENS overrides both.
CUDA_CHUNK_BYTES = 2 * 2**30
CPU_CHUNK_BYTES = 32 * 2**20
CPU_MIN_CHUNK_TOKENS = 256
# A CPU GEMM that writes a whole [C, V] chunk of logits splits its inner dimension H into blocks and re-reads and
# re-writes that output from memory once per block; formed in vocab blocks of ~2 MiB of logits, the output stays in a
# core's cache (measured, 1 thread, H 1024, V 32768, fp32: a [256, 32768] GEMM 246 ms, the same in blocks of 1024
# columns 213 ms). The no-grad pass forms each block in one reused buffer and takes its exp there, in cache, with
# chunks of CPU_STATS_CHUNK_TOKENS rows (the weight is read once per chunk): 0.80x the time of one GEMM over the
# tokens, where a [256, V] chunk and its passes took 1.05x.
CPU_BLOCK_BYTES = 2 * 2**20
CPU_STATS_CHUNK_TOKENS = 1024


_CHUNK_TOKENS = None  # set by `chunk_size` (fastgrpo train's loss_chunk_tokens)


@contextmanager
def chunk_size(tokens: int | None):
    """Within: chunks of `tokens` (None: the default sizes), over FASTGRPO_CHUNK_TOKENS."""
    global _CHUNK_TOKENS
    previous, _CHUNK_TOKENS = _CHUNK_TOKENS, tokens
    try:
        yield
    finally:
        _CHUNK_TOKENS = previous


def chunk_tokens(V: int, device: torch.device) -> int:
    """Tokens per chunk: fp32 logits of at most the device's CHUNK_BYTES (dZ in bf16 adds half of that on CUDA), and on
    a CPU at least CPU_MIN_CHUNK_TOKENS; `chunk_size` or FASTGRPO_CHUNK_TOKENS set it."""
    if _CHUNK_TOKENS is not None:
        return _CHUNK_TOKENS
    override = os.environ.get("FASTGRPO_CHUNK_TOKENS")
    if override:
        if not override.isdigit() or int(override) < 1:
            raise ValueError(f"FASTGRPO_CHUNK_TOKENS must be a positive integer, got {override!r}")
        return int(override)
    if device.type == "cuda":
        return max(128, CUDA_CHUNK_BYTES // (6 * V) // 128 * 128)
    return max(CPU_MIN_CHUNK_TOKENS, CPU_CHUNK_BYTES // (4 * V))


def stats_chunk_tokens(V: int, device: torch.device) -> int:
    """Tokens per chunk of a CPU's no-grad pass (cpu_row_stats, which holds only a vocab block of logits at a time):
    at least CPU_STATS_CHUNK_TOKENS, unless FASTGRPO_CHUNK_TOKENS says otherwise."""
    chunk = chunk_tokens(V, device)
    set_by_user = _CHUNK_TOKENS is not None or os.environ.get("FASTGRPO_CHUNK_TOKENS")
    return chunk if set_by_user else max(chunk, CPU_STATS_CHUNK_TOKENS)


@dataclass(frozen=True)
class HeadPlan:
    """The device-dependent choices of the chunk loops below, made once per call (`head_plan`): CUDA's, or a CPU's
    (any other device)."""

    device_type: str  # whose choices these are: "cuda" or "cpu"
    chunk: int  # rows of logits per chunk (chunk_tokens)
    upcast_weight: bool  # CPU: the weight upcast once for the GEMMs (gemm_weight); CUDA takes it as is
    fp32_output_gemm: bool  # CUDA: a chunk's fp32 logits from one GEMM of the input dtype (mm_fp32)
    reuse_buffers: bool  # CPU: two [chunk, V] buffers reused by every chunk (ChunkBuffers)
    dz_dtype: torch.dtype  # dZ, the operand of GEMMs 2 and 3: the input dtype on CUDA, >= fp32 on a CPU
    blocked_stats: bool  # CPU: the no-grad pass by vocab blocks (cpu_row_stats); CUDA: whole chunks


_EMULATED_DEVICE = None  # set by `emulate_device`


@contextmanager
def emulate_device(device_type: str | None):
    """Within: the chunk loops make `device_type`'s choices (head_plan) whatever device their tensors are on (None:
    their own). For measurements: fastgrpo.bench.memory_trace counts the CUDA branch's memory on fake CPU tensors. The
    row ops still run the kernels of the tensors' device, and a CPU has no bf16 x bf16 -> fp32 GEMM: on real CPU
    tensors CUDA's choices run in fp32 only."""
    global _EMULATED_DEVICE
    if device_type not in (None, "cuda", "cpu"):
        raise ValueError(f"device_type must be 'cuda', 'cpu' or None, got {device_type!r}")
    previous, _EMULATED_DEVICE = _EMULATED_DEVICE, device_type
    try:
        yield
    finally:
        _EMULATED_DEVICE = previous


def head_plan(x: torch.Tensor, V: int) -> HeadPlan:
    """The chunk loops' choices for the hidden states x [N, H] (their device and dtype) and a vocab of V: the device's,
    or emulate_device's."""
    device_type = "cuda" if (_EMULATED_DEVICE or x.device.type) == "cuda" else "cpu"
    cuda = device_type == "cuda"
    return HeadPlan(device_type, chunk_tokens(V, torch.device(device_type)), upcast_weight=not cuda,
                    fp32_output_gemm=cuda, reuse_buffers=not cuda,
                    dz_dtype=x.dtype if cuda else torch.promote_types(x.dtype, torch.float32), blocked_stats=not cuda)


def vocab_blocks(C: int, V: int) -> list[slice]:
    """A CPU's vocab blocks for C rows: ~CPU_BLOCK_BYTES of fp32 logits each, a multiple of 128 columns."""
    width = max(128, CPU_BLOCK_BYTES // (4 * max(C, 1)) // 128 * 128)
    return [slice(v, min(v + width, V)) for v in range(0, V, width)]


def _torch_version() -> tuple[int, int]:
    major, minor = torch.__version__.split(".")[:2]
    return int(major), int("".join(ch for ch in minor if ch.isdigit()) or 0)


# In-place fp32 addmm with bf16 operands (`torch.addmm(acc, a, b, out_dtype=fp32, out=acc)`) was wrong before
# PyTorch 2.10 (pytorch/pytorch#154086); older versions add a separate fp32 product instead.
INPLACE_FP32_ADDMM = _torch_version() >= (2, 10)
# torch.compile traces it from 2.13 on (a decomposition of addmm.dtype_out); 2.10-2.12 register CUDA kernels only
# (read in torch 2.11's sources, not run on a GPU), so a compiled graph takes the added product there.
COMPILED_FP32_ADDMM = _torch_version() >= (2, 13)


def mm_fp32(a, b_t, fp32_output: bool):
    """a [M, K] @ b_t.T -> [M, N], at least fp32, with fp32 accumulation: with `fp32_output` (CUDA's plan) one GEMM of
    the operands as they are writing fp32, no fp32 copy of b_t; else of upcast operands."""
    if a.dtype in (torch.float32, torch.float64):
        return a @ b_t.T
    if fp32_output:
        return torch.mm(a, b_t.T, out_dtype=torch.float32)
    return a.float() @ b_t.float().T


def addmm_fp32_(acc, a, b, inplace: bool = INPLACE_FP32_ADDMM):
    """acc += a @ b, acc fp32 (or fp64), a and b of the GEMM dtype (bf16 operands accumulate in fp32 on CUDA)."""
    if a.dtype == acc.dtype:
        return acc.addmm_(a, b)
    if inplace and (COMPILED_FP32_ADDMM or not torch.compiler.is_compiling()):
        return torch.addmm(acc, a, b, out_dtype=acc.dtype, out=acc)
    return acc.add_(torch.mm(a, b, out_dtype=acc.dtype))


def gemm_weight(x, weight, plan: HeadPlan):
    """The weight as the chunk GEMMs take it: as is on CUDA; upcast once on a CPU, which has no bf16 x bf16 -> fp32
    matmul (an extra fp32 copy of the weight, fine for the small models that train on a CPU)."""
    return weight.to(torch.promote_types(x.dtype, torch.float32)) if plan.upcast_weight else weight


@dataclass(frozen=True)
class LogitMap:
    """What the loss scores: z = softcap * tanh(scale * (x W^T + b) / softcap), or scale * (x W^T + b) with no cap.
    `scale` folds the model's logit scale and 1 / temperature, `softcap` is the model's cap / temperature (equal to
    capping first and dividing by the temperature after)."""

    scale: float = 1.0
    softcap: float | None = None

    @classmethod
    def of(cls, temperature: float, logit_scale: float = 1.0, logit_softcap: float | None = None) -> "LogitMap":
        return cls(logit_scale / temperature, None if logit_softcap is None else logit_softcap / temperature)


def chunk_logits(x_c, weight, bias, inv_t, out=None, fp32_output=False):
    """scale * (x_c W^T + b): [C, V], at least fp32; into `out` when given (a CPU's reused chunk buffer, of the
    weight's dtype), formed there in vocab blocks (vocab_blocks); else by one GEMM (mm_fp32 with `fp32_output`)."""
    if out is not None:
        x_c = x_c.to(out.dtype)  # [C, H]: a CPU upcasts bf16 rows (the weight is upcast once, gemm_weight)
        for cols in vocab_blocks(*out.shape):
            torch.mm(x_c, weight[cols].T, out=out[:, cols])
        z = out
    else:
        z = mm_fp32(x_c, weight, fp32_output)  # [C, V]
    if bias is not None:
        z += bias.to(z.dtype)
    if inv_t != 1.0:
        z *= inv_t
    return z


def unshifted_in_range(s: torch.Tensor) -> bool:
    """Whether the rows' sums s = sum_v exp(z_v) [C] allow the row passes without the max subtracted: every s far
    above the smallest normal number (an exp that underflows then weighs less than the sum's rounding) and at most
    finfo.max / 1024, so that t = sum_v exp(z_v) z_v stays finite too (a logit above 0 is at most log s, under 710
    in fp64; below 0, exp(z) |z| < 1)."""
    finfo = torch.finfo(s.dtype)
    return bool(((s >= finfo.tiny / finfo.eps) & (s <= finfo.max / 1024)).all())


# -- the row passes: registered ops, the compile boundary -------------------------------------------------------------
# torch.compile traces the chunk loops around them (GEMMs, the objective's gradient) as plain PyTorch; each op is one
# memory-bound pass over a chunk of logits: fastgrpo/kernels/logit_rows.py on CUDA, the PyTorch below on a CPU. No
# host sync leaves an op (the CPU's range check of the unshifted sums stays inside its kernel).


@torch.library.custom_op("fastgrpo::logit_row_stats", mutates_args=("scratch",))
def logit_row_stats(z: torch.Tensor, ids: torch.Tensor, softcap: float | None, entropy: bool,
                    scratch: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(lse [C], logp [C], entropy [C] or [0] unless asked) of the logits z [C, V] (>= fp32), capped by softcap
    (None: not capped), targets ids [C] int64 in [0, V). scratch: a CPU's reused [>= C, V] buffer of z's dtype
    (None: a new one; its contents are scratch afterwards). Plain PyTorch: zc = z, or softcap * tanh(z / softcap);
    lse = zc.logsumexp(-1); logp = zc.gather(-1, ids[:, None])[:, 0] - lse; entropy = -(p * log p).sum(-1)."""
    zc = z if softcap is None else torch.tanh(z / softcap).mul_(softcap)  # [C, V]
    e = torch.exp(zc) if scratch is None else torch.exp(zc, out=scratch[: z.shape[0]])  # [C, V]: exp(zc - m), m = 0
    s = e.sum(-1)  # [C]
    m = None
    # exp(zc) needs no max subtracted while every row's sum stays in range (unshifted_in_range): two passes over
    # Z saved; rows outside it (logits above ~80, or all far below 0) take the shifted form.
    if not unshifted_in_range(s):
        m = zc.amax(-1, keepdim=True)  # [C, 1]
        zc = zc - m
        torch.exp(zc, out=e)
        s = e.sum(-1)
    log_s = s.log()
    lse = log_s if m is None else m.view(-1) + log_s
    logp = zc.gather(1, ids[:, None]).view(-1) - log_s
    if not entropy:
        return lse, logp, z.new_empty(0)
    t = e.mul_(zc).sum(-1)  # [C] sum_v e (zc - m); a cascade sum (a bmm dot loses 1e-4 at 152k)
    return lse, logp, log_s - t / s


@logit_row_stats.register_fake
def _(z, ids, softcap, entropy, scratch):
    return z.new_empty(z.shape[0]), z.new_empty(z.shape[0]), z.new_empty(z.shape[0] if entropy else 0)


@logit_row_stats.register_kernel("cuda")
def _logit_row_stats_cuda(z, ids, softcap, entropy, scratch):
    from fastgrpo.kernels.logit_rows import logit_row_stats as triton_row_stats

    lse, logp, ent = triton_row_stats(z, ids, softcap=softcap)
    return lse, logp, ent if entropy else z.new_empty(0)


@torch.library.custom_op("fastgrpo::logit_row_grad_", mutates_args=("z", "out"))
def logit_row_grad_(z: torch.Tensor, ids: torch.Tensor, lse: torch.Tensor, entropy: torch.Tensor, g: torch.Tensor,
                    h: torch.Tensor | None, scale: float, softcap: float | None, out: torch.Tensor | None) -> None:
    """dZ = scale * d(sum_c g_c logp_c + h_c entropy_c) / dz [C, V], written over z (out None) or into out (another
    dtype; z is scratch then), for logit_row_stats's lse and entropy [C] (entropy unused when h is None):
    dZ = scale (g onehot(y) - p (g + h (log p + H))) (times the softcap's 1 - tanh^2)."""
    cap_grad = None
    if softcap is not None:
        th = z.div_(softcap).tanh_()
        cap_grad = 1 - th * th  # [C, V]
        th.mul_(softcap)
    log_p = z.sub_(lse[:, None].to(z.dtype))  # [C, V], in place
    if h is None:
        dz = log_p.exp_().mul_((-scale * g)[:, None].to(z.dtype))  # -g p
    else:
        coef = (log_p + entropy[:, None]).mul_(h[:, None]).add_(g[:, None]).neg_()  # -(g + h (log p + H))
        dz = log_p.exp_().mul_(coef).mul_(scale).nan_to_num_(0.0)  # 0 where p underflows
    dz.scatter_add_(1, ids[:, None], (scale * g)[:, None].to(dz.dtype))
    if cap_grad is not None:
        dz *= cap_grad
    if out is not None:
        out.copy_(dz)


@logit_row_grad_.register_fake
def _(z, ids, lse, entropy, g, h, scale, softcap, out):
    return None


@logit_row_grad_.register_kernel("cuda")
def _logit_row_grad_cuda(z, ids, lse, entropy, g, h, scale, softcap, out):
    from fastgrpo.kernels.logit_rows import logit_row_grad as triton_row_grad

    triton_row_grad(z, ids, lse, entropy, g.float().contiguous(), None if h is None else h.float().contiguous(),
                    scale=scale, softcap=softcap, out=z if out is None else out)


class LogitChunk:
    """One chunk of logits Z [C, V] and its row statistics (lse, logp, entropy [C]); `grad` writes dZ over Z or
    into a buffer of the GEMM dtype."""

    def __init__(self, z, ids, softcap, entropy, scratch=None):
        self.z, self.ids, self.softcap = z, ids, softcap
        self.lse, self.logp, self.entropy = logit_row_stats(z, ids, softcap, entropy, scratch)
        if not entropy:
            self.entropy = None

    def grad(self, g, h, scale, dtype):
        """dZ [C, V] of dtype for L = sum g logp + h entropy, times scale."""
        z = self.z
        out = None if dtype == z.dtype else torch.empty(z.shape, dtype=dtype, device=z.device)
        entropy = self.entropy if h is not None else self.lse  # (unread without h)
        logit_row_grad_(z, self.ids, self.lse, entropy, g.to(z.dtype), None if h is None else h.to(z.dtype), scale,
                        self.softcap, out)
        return z if out is None else out


class ChunkBuffers:
    """A CPU's two [chunk, V] fp32 (>= input dtype) buffers reused by every chunk of a call: Z and the row passes'
    scratch (a fresh 32 MiB buffer per chunk costs page faults on a CPU). CUDA: cuBLAS writes each chunk's Z and
    the Triton passes need no scratch (the caching allocator reuses the chunk's memory)."""

    def __init__(self, x, V, plan: HeadPlan):
        shape, dtype = (min(plan.chunk, x.shape[0]), V), torch.promote_types(x.dtype, torch.float32)
        empty = lambda: torch.empty(shape, dtype=dtype, device=x.device)
        self.z, self.scratch = (empty(), empty()) if plan.reuse_buffers else (None, None)
        self.fp32_output = plan.fp32_output_gemm

    def rows(self, x_c, w, bias, logits: LogitMap, ids, entropy=True) -> LogitChunk:
        """The chunk's logits and row statistics; entropy=False (no-grad passes that do not want it) saves a pass."""
        C = x_c.shape[0]
        z = chunk_logits(x_c, w, bias, logits.scale, None if self.z is None else self.z[:C], self.fp32_output)
        return LogitChunk(z, ids, logits.softcap, entropy, self.scratch)


def logprobs_no_grad(x, weight, bias, ids, logits: LogitMap, entropy=True):
    """x [N, H], ids [N] -> (logp [N], entropy [N] or None), at least fp32: one GEMM and the row statistics per
    chunk (on a CPU per vocab block of a chunk, cpu_row_stats)."""
    N = x.shape[0]
    out_dtype = torch.promote_types(x.dtype, torch.float32)
    logp = torch.empty(N, dtype=out_dtype, device=x.device)
    ent = torch.empty(N, dtype=out_dtype, device=x.device) if entropy else None
    plan = head_plan(x, weight.shape[0])
    w = gemm_weight(x, weight, plan)
    if plan.blocked_stats and not torch.compiler.is_compiling():  # (cpu_row_stats checks its sums' range on the host)
        cpu_row_stats(x, w, bias, ids, logits, plan, logp, ent)
    else:
        chunked_row_stats(x, w, bias, ids, logits, plan, logp, ent, slice(0, N))
    return logp, ent


def chunked_row_stats(x, w, bias, ids, logits: LogitMap, plan: HeadPlan, logp, ent, sl: slice):
    """logp[sl] (and ent[sl] when `ent` is given) written in place from chunks of plan.chunk rows of x[sl] and their
    whole rows of logits (the row ops: Triton on CUDA; on a CPU the passes that subtract the max when needed)."""
    step = plan.chunk
    buffers = ChunkBuffers(x[sl], w.shape[0], plan)
    for start in range(sl.start, sl.stop, step):
        part = slice(start, min(start + step, sl.stop))
        rows = buffers.rows(x[part], w, bias, logits, ids[part], ent is not None)
        logp[part] = rows.logp
        if ent is not None:
            ent[part] = rows.entropy
        del rows  # the chunk's logits go before the next chunk's arrive


def cpu_row_stats(x, w, bias, ids, logits: LogitMap, plan: HeadPlan, logp, ent=None):
    """A CPU's no-grad pass: logp [N] (and entropy [N] when `ent` is given) written in place, for x [N, H] and the
    weight w [V, H] of the GEMM dtype. Each chunk's logits are formed one vocab block at a time in one reused buffer
    and consumed there, in cache: the unshifted sums s = sum_v exp(z_v), t = sum_v exp(z_v) z_v and the target's
    logit add up over the blocks (logit_row_stats's argument: exact while every row's s stays in range); a chunk with a
    row out of range is computed again by chunked_row_stats."""
    N, V = x.shape[0], w.shape[0]
    chunk = stats_chunk_tokens(V, torch.device(plan.device_type))
    blocks = vocab_blocks(min(chunk, N), V)
    width = blocks[0].stop - blocks[0].start
    z_buf = torch.empty(min(chunk, N), width, dtype=w.dtype, device=x.device)  # [C, width]
    e_buf = torch.empty_like(z_buf) if ent is not None else None
    for start in range(0, N, chunk):
        sl = slice(start, min(start + chunk, N))
        x_c, ids_c = x[sl].to(w.dtype), ids[sl]  # [C, H], [C]
        C = x_c.shape[0]
        s, t, z_y = (x_c.new_zeros(C) for _ in range(3))  # [C] each
        for cols in blocks:
            z = chunk_logits(x_c, w[cols], None if bias is None else bias[cols], logits.scale,
                             out=z_buf[:C, : cols.stop - cols.start])  # [C, n]
            if logits.softcap is not None:
                z.div_(logits.softcap).tanh_().mul_(logits.softcap)
            local = ids_c - cols.start
            inside = (local >= 0) & (local < z.shape[1])
            z_y = torch.where(inside, z.gather(1, local.clamp(0, z.shape[1] - 1)[:, None]).view(-1), z_y)
            if ent is None:
                s += z.exp_().sum(-1)
            else:
                e = torch.exp(z, out=e_buf[:C, : z.shape[1]])
                s += e.sum(-1)
                t += e.mul_(z).sum(-1)
        if not unshifted_in_range(s):  # logits far from zero: this chunk again, by the shifted passes
            chunked_row_stats(x, w, bias, ids, logits, plan, logp, ent, sl)
            continue
        log_s = s.log()
        logp[sl] = z_y - log_s
        if ent is not None:
            ent[sl] = log_s - t / s


class HeadGrads:
    """dX, dW, db of the head, filled chunk by chunk from dZ (GEMMs 2 and 3)."""

    def __init__(self, x, weight, bias, need_dx=True, need_dw=True, need_db=True):
        self.x, self.weight, self.bias = x, weight, bias
        self.plan = head_plan(x, weight.shape[0])
        self.w = gemm_weight(x, weight, self.plan)
        self.buffers = ChunkBuffers(x, weight.shape[0], self.plan)
        acc_dtype = torch.promote_types(x.dtype, torch.float32)
        self.gemm_dtype = self.plan.dz_dtype  # dZ's dtype: the GEMM operands'
        self.dx = torch.empty_like(x) if need_dx else None  # [N, H]
        self.dw = torch.zeros(weight.shape, dtype=acc_dtype, device=x.device) if need_dw else None  # [V, H]
        self.db = torch.zeros(weight.shape[0], dtype=acc_dtype, device=x.device) if (
            need_db and bias is not None) else None  # [V]

    def chunks(self):
        N, step = self.x.shape[0], self.plan.chunk
        return [slice(start, start + step) for start in range(0, N, step)]

    def add(self, sl, dz):
        """dZ [C, V] of the chunk x[sl]."""
        if self.dx is not None:
            self.dx[sl] = (dz @ self.w).to(self.x.dtype)
        if self.dw is not None:
            addmm_fp32_(self.dw, dz.T, self.x[sl].to(dz.dtype))
        if self.db is not None:
            self.db += dz.sum(0, dtype=self.db.dtype)

    def result(self):
        """(dX, dW, db) in the inputs' dtypes, None where not wanted."""
        dw = None if self.dw is None else self.dw.to(self.weight.dtype)
        db = None if self.db is None else self.db.to(self.bias.dtype)
        return self.dx, dw, db
