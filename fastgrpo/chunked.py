"""The chunked PyTorch path: the fused kernels' function (see fastgrpo.kernels.logprob) with bounded memory.

Used on CPU, and on CUDA when deterministic algorithms are requested. Tokens are processed in chunks whose fp32
logits take at most `CHUNK_BYTES`; the backward recomputes each chunk's logits instead of storing them. Logits are
formed in fp32 (bf16 inputs are upcast chunk by chunk), so nothing is rounded to bf16 before the logsumexp.
"""

import torch

# Logit bytes per chunk; a chunk's peak is about three times this (logits, probabilities, their gradient).
CHUNK_BYTES = 32 * 2**20


def _chunk_tokens(V: int) -> int:
    return max(1, CHUNK_BYTES // (4 * V))


def _mm_fp32(a, b_t):
    """a [M, K] @ b_t.T -> fp32 [M, N] with fp32 accumulation, without an fp32 copy of b_t on CUDA."""
    if a.dtype == torch.float32 or a.dtype == torch.float64:
        return a @ b_t.T
    if a.is_cuda:
        return torch.mm(a, b_t.T, out_dtype=torch.float32)
    return a.float() @ b_t.float().T


def _matmul_weight(x, weight):
    """The weight as the chunk matmuls take it: as is on CUDA; upcast once on CPU, which has no bf16 x bf16 -> fp32
    matmul (an extra fp32 copy of the weight, fine for the small models that train on a CPU)."""
    return weight if x.is_cuda else weight.to(torch.promote_types(x.dtype, torch.float32))


def _chunk_logits(x_c, weight, bias, inv_t):
    z = _mm_fp32(x_c, weight)  # [C, V]
    if bias is not None:
        z = z + bias.to(z.dtype)
    return z.mul_(inv_t)


class ChunkedLinearLogprobFunction(torch.autograd.Function):
    """(x [N, H], weight [V, H], bias [V] | None, ids [N], temperature) -> (logp [N], entropy [N]), >= fp32."""

    @staticmethod
    def forward(ctx, x, weight, bias, ids, temperature):
        N, V = x.shape[0], weight.shape[0]
        out_dtype = torch.promote_types(x.dtype, torch.float32)
        logp, ent, lse = (torch.empty(N, dtype=out_dtype, device=x.device) for _ in range(3))
        w = _matmul_weight(x, weight)
        chunk = _chunk_tokens(V)
        for start in range(0, N, chunk):
            sl = slice(start, start + chunk)
            z = _chunk_logits(x[sl], w, bias, 1.0 / temperature)  # [C, V]
            lse[sl] = torch.logsumexp(z, dim=-1)  # [C]
            z -= lse[sl, None]  # log-softmax, in place; centred so the entropy has no cancellation
            logp[sl] = z.gather(-1, ids[sl, None]).squeeze(-1)
            ent[sl] = -(z.exp() * z).sum(-1)
        ctx.save_for_backward(x, weight, bias, ids, lse, ent)
        ctx.temperature = temperature
        return logp, ent

    @staticmethod
    def backward(ctx, grad_logp, grad_ent):
        x, weight, bias, ids, lse, ent = ctx.saved_tensors
        N, V = x.shape[0], weight.shape[0]
        inv_t = 1.0 / ctx.temperature
        acc_dtype = torch.promote_types(x.dtype, torch.float32)
        w = _matmul_weight(x, weight)
        need_dx, need_dw = ctx.needs_input_grad[:2]
        dx = torch.empty_like(x) if need_dx else None
        dw = torch.zeros(weight.shape, dtype=acc_dtype, device=x.device) if need_dw else None
        db = None if bias is None else torch.zeros(V, dtype=acc_dtype, device=x.device)
        chunk = _chunk_tokens(V)
        for start in range(0, N, chunk):
            sl = slice(start, start + chunk)
            log_p = _chunk_logits(x[sl], w, bias, inv_t).sub_(lse[sl, None])  # [C, V]
            p = log_p.exp()
            dz = torch.zeros_like(log_p)
            if grad_logp is not None:
                g = grad_logp[sl, None].to(acc_dtype)  # [C, 1]
                dz -= g * p
                dz.scatter_add_(-1, ids[sl, None], g)
            if grad_ent is not None:
                # dH/dz = -p (log p + H): z - E_p[z] written without the cancellation of two large terms
                dz -= grad_ent[sl, None].to(acc_dtype) * p * (log_p + ent[sl, None])
            dz *= inv_t
            if db is not None:
                db += dz.sum(0)
            if x.is_cuda and x.dtype != acc_dtype:
                dz = dz.to(x.dtype)  # tensor-core operands; dW still accumulates in fp32 below
                if need_dx:
                    dx[sl] = dz @ weight
                if need_dw:
                    torch.addmm(dw, dz.T, x[sl], out_dtype=torch.float32, out=dw)
            else:
                if need_dx:
                    dx[sl] = (dz @ w).to(x.dtype)
                if need_dw:
                    dw.addmm_(dz.T, x[sl].to(acc_dtype))
        return (dx, None if dw is None else dw.to(weight.dtype), None if db is None else db.to(bias.dtype), None,
                None)
