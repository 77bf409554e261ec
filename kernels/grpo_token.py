"""The per-token GRPO objective, its metrics and its gradient w.r.t. the policy logprobs, in one row kernel.

One program per completion row b (length T, mask m_t). With lr_t = logp_t - old_t (0 on-policy) and the row weight
w_b that folds the loss type's normalisation (see `row_weights` in fastgrpo.loss):

    token level:     c1_t = exp(lr_t)
    sequence level:  c1_t = exp(sum_t m_t lr_t / max(sum_t m_t, 1))          (GSPO; one ratio per row)
    clip family:     c2 = clamp(c1, 1 - eps_low, 1 + eps_high);  c1d = min(c1, delta) if delta else c1
                     l_t = -min(c1d A_t, c2 A_t)
    cispo:           l_t = -min(c1, eps_high).detach() A_t logp_t
    sapo:            tau = tau_pos if A_t > 0 else tau_neg;  l_t = -4 sigmoid(tau (c1 - 1)) / tau A_t
    kl (beta != 0):  k_t = exp(ref_t - logp_t) - (ref_t - logp_t) - 1, times c1 with the bias correction
                     l_t += beta k_t
    loss = sum_b w_b sum_t m_t l_t

Plain-PyTorch equivalent: `fastgrpo.reference.grpo_loss` (TRL 1.16's `GRPOTrainer._compute_loss`). The gradient
follows torch's autograd conventions exactly: `min` splits a tie evenly between its arguments and `clamp` passes
the gradient on its closed interval.
"""

import torch
import triton
import triton.language as tl

from fastgrpo.loss_config import CLIP_LOSS_TYPES, LOSS_TYPES

# The policy term's formula as a constexpr int at the launcher boundary: the clip family's loss types share one
# formula (they differ only in the row weights), cispo and sapo have their own.
_CLIP, _CISPO, _SAPO = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)
POLICY_TERM = {**dict.fromkeys(CLIP_LOSS_TYPES, _CLIP.value), "cispo": _CISPO.value, "sapo": _SAPO.value}
assert POLICY_TERM.keys() == set(LOSS_TYPES), "every loss type needs a policy term"
# Per-row outputs, in this order: weighted loss, sum m*kl, sum m*low, sum m*high, sum m*region (cispo: clipped).
NUM_ROW_STATS = 5
# A row is streamed in chunks of at most MAX_BLOCK_T tokens: 1024 with 4 warps spills 4 B on sm_80, 512 does not.
MAX_BLOCK_T, NUM_WARPS = 512, 4


@triton.jit
def _grpo_token_kernel(
    Logp, Old, Ref, Adv, Mask, RowW,  # [B, T] fp32 (Adv [B] or [B, T]), RowW [B]
    DLogp, RowStats,  # DLogp [B, T] fp32: d loss / d logp;  RowStats [NUM_ROW_STATS, B]
    B, T, eps_low, eps_high, delta, beta, tau_pos, tau_neg,
    POLICY_TERM: tl.constexpr, SEQUENCE_LEVEL: tl.constexpr, HAS_OLD: tl.constexpr, HAS_KL: tl.constexpr,
    BIAS_CORRECTION: tl.constexpr, HAS_DELTA: tl.constexpr, ADV_PER_TOKEN: tl.constexpr, BLOCK_T: tl.constexpr,
):
    b = tl.program_id(0)
    row = b.to(tl.int64) * T
    # Python floats can arrive as fp64 (torch.compile); the math is fp32.
    eps_low, eps_high = tl.cast(eps_low, tl.float32), tl.cast(eps_high, tl.float32)
    delta, beta = tl.cast(delta, tl.float32), tl.cast(beta, tl.float32)
    tau_pos, tau_neg = tl.cast(tau_pos, tl.float32), tl.cast(tau_neg, tl.float32)
    w_row = tl.load(RowW + b)
    if not ADV_PER_TOKEN:
        adv_row = tl.load(Adv + b)

    # -- pass 1 (sequence level): one importance ratio per row --
    log_w_row = 0.0
    length = 1.0
    if SEQUENCE_LEVEL:
        lr_sum = 0.0
        count = 0.0
        for t0 in range(0, T, BLOCK_T):
            offs = t0 + tl.arange(0, BLOCK_T)
            in_row = offs < T
            m = tl.load(Mask + row + offs, mask=in_row, other=0.0)
            if HAS_OLD:
                lr = tl.load(Logp + row + offs, mask=in_row, other=0.0) - tl.load(Old + row + offs, mask=in_row,
                                                                                   other=0.0)
                lr_sum += tl.sum(tl.where(m != 0.0, lr * m, 0.0))
            count += tl.sum(m)
        length = tl.maximum(count, 1.0)
        log_w_row = lr_sum / length

    # -- pass 2: per-token loss, its gradient, the metrics --
    loss = 0.0
    kl_sum = 0.0
    low_sum = 0.0
    high_sum = 0.0
    region_sum = 0.0
    seq_grad = 0.0  # sequence level: sum_t w m_t dl_t/dc1 (the ratio is shared by the row)
    for t0 in range(0, T, BLOCK_T):
        offs = t0 + tl.arange(0, BLOCK_T)
        in_row = offs < T
        m = tl.load(Mask + row + offs, mask=in_row, other=0.0)
        valid = m != 0.0
        logp = tl.load(Logp + row + offs, mask=in_row, other=0.0)
        if ADV_PER_TOKEN:
            adv = tl.load(Adv + row + offs, mask=in_row, other=0.0)
        else:
            adv = tl.zeros((BLOCK_T,), dtype=tl.float32) + adv_row
        if SEQUENCE_LEVEL:
            log_w = tl.zeros((BLOCK_T,), dtype=tl.float32) + log_w_row
        elif HAS_OLD:
            log_w = logp - tl.load(Old + row + offs, mask=in_row, other=0.0)
        else:
            log_w = tl.zeros((BLOCK_T,), dtype=tl.float32)
        c1 = tl.exp(log_w)

        if POLICY_TERM == _CISPO:
            c_cap = tl.minimum(c1, eps_high)
            per_token = -c_cap * adv * logp
            d_direct = -c_cap * adv
            d_c1 = tl.zeros((BLOCK_T,), dtype=tl.float32)
            clipped = (c1 > eps_high) & (adv > 0.0)
            low_sum += tl.sum(tl.where(valid & clipped, m, 0.0))
        elif POLICY_TERM == _SAPO:
            tau = tl.where(adv > 0.0, tau_pos, tau_neg)
            gate = tl.sigmoid(tau * (c1 - 1.0))
            per_token = -gate * 4.0 / tau * adv
            d_c1 = -4.0 * gate * (1.0 - gate) * adv
            d_direct = tl.zeros((BLOCK_T,), dtype=tl.float32)
        else:
            c2 = tl.minimum(tl.maximum(c1, 1.0 - eps_low), 1.0 + eps_high)
            d_c2 = ((c1 >= 1.0 - eps_low) & (c1 <= 1.0 + eps_high)).to(tl.float32)
            if HAS_DELTA:
                c1d = tl.minimum(c1, delta)
                d_c1d = (c1 <= delta).to(tl.float32)
            else:
                c1d = c1
                d_c1d = tl.full((BLOCK_T,), 1.0, dtype=tl.float32)
            u = c1d * adv
            v = c2 * adv
            per_token = -tl.minimum(u, v)
            share_u = tl.where(u < v, 1.0, tl.where(u == v, 0.5, 0.0))  # torch.minimum's backward
            d_c1 = -(share_u * d_c1d + (1.0 - share_u) * d_c2) * adv
            d_direct = tl.zeros((BLOCK_T,), dtype=tl.float32)
            is_low = (c1d < 1.0 - eps_low) & (adv < 0.0)
            is_high = (c1d > 1.0 + eps_high) & (adv > 0.0)
            low_sum += tl.sum(tl.where(valid & is_low, m, 0.0))
            high_sum += tl.sum(tl.where(valid & is_high, m, 0.0))
            region_sum += tl.sum(tl.where(valid & (is_low | is_high), m, 0.0))

        if HAS_KL:
            diff = tl.load(Ref + row + offs, mask=in_row, other=0.0) - logp
            e = tl.exp(diff)
            kl = e - diff - 1.0
            d_kl = 1.0 - e  # d kl / d logp
            if BIAS_CORRECTION:
                d_direct += beta * d_kl * c1
                d_c1 += beta * kl
                kl = kl * c1
            else:
                d_direct += beta * d_kl
            per_token += beta * kl
            kl_sum += tl.sum(tl.where(valid, kl * m, 0.0))

        wm = w_row * m
        loss += tl.sum(tl.where(valid, per_token * wm, 0.0))
        if SEQUENCE_LEVEL:
            seq_grad += tl.sum(tl.where(valid, d_c1 * wm, 0.0))
            grad = d_direct * wm
        else:
            grad = (d_c1 * c1 + d_direct) * wm
        tl.store(DLogp + row + offs, tl.where(valid, grad, 0.0), mask=in_row)

    # -- pass 3 (sequence level): d c1 / d logp_t = c1 m_t / length (on-policy too: old = logp.detach()) --
    if SEQUENCE_LEVEL:
        g_row = seq_grad * tl.exp(log_w_row) / length
        for t0 in range(0, T, BLOCK_T):
            offs = t0 + tl.arange(0, BLOCK_T)
            in_row = offs < T
            m = tl.load(Mask + row + offs, mask=in_row, other=0.0)
            grad = tl.load(DLogp + row + offs, mask=in_row, other=0.0)
            tl.store(DLogp + row + offs, grad + tl.where(m != 0.0, g_row * m, 0.0), mask=in_row)

    tl.store(RowStats + b, loss)
    tl.store(RowStats + B + b, kl_sum)
    tl.store(RowStats + 2 * B + b, low_sum)
    tl.store(RowStats + 3 * B + b, high_sum)
    tl.store(RowStats + 4 * B + b, region_sum)


def grpo_token_forward(logps, old_logps, ref_logps, advantages, mask, row_weights, opts):
    """logps/old/ref/mask [B, T] fp32 contiguous, advantages [B] or [B, T] fp32, row_weights [B] fp32.

    `opts` is a `fastgrpo.loss.LossConfig`. Returns (d loss / d logps [B, T], row stats [NUM_ROW_STATS, B]).
    """
    B, T = logps.shape
    d_logps = torch.empty_like(logps)
    row_stats = torch.empty(NUM_ROW_STATS, B, device=logps.device, dtype=torch.float32)
    if B == 0:
        return d_logps, row_stats
    _grpo_token_kernel[(B,)](
        logps, old_logps, ref_logps, advantages, mask, row_weights, d_logps, row_stats,
        B, T, opts.epsilon_low, opts.epsilon_high, 0.0 if opts.delta is None else opts.delta, opts.beta,
        opts.sapo_temperature_pos, opts.sapo_temperature_neg,
        POLICY_TERM=POLICY_TERM[opts.loss_type], SEQUENCE_LEVEL=opts.importance_sampling_level == "sequence",
        HAS_OLD=old_logps is not None, HAS_KL=opts.beta != 0.0, BIAS_CORRECTION=opts.use_bias_correction_kl,
        HAS_DELTA=opts.delta is not None, ADV_PER_TOKEN=advantages.dim() == 2,
        BLOCK_T=min(MAX_BLOCK_T, triton.next_power_of_2(max(T, 16))), num_warps=NUM_WARPS,
    )
    return d_logps, row_stats


class GRPOTokenLossFunction(torch.autograd.Function):
    """(logps [B, T], old, ref, advantages, mask, row_weights, opts) -> (loss [], row_stats [NUM_ROW_STATS, B])."""

    @staticmethod
    def forward(ctx, logps, old_logps, ref_logps, advantages, mask, row_weights, opts):
        d_logps, row_stats = grpo_token_forward(logps, old_logps, ref_logps, advantages, mask, row_weights, opts)
        ctx.save_for_backward(d_logps)
        ctx.mark_non_differentiable(row_stats)
        return row_stats[0].sum(), row_stats

    @staticmethod
    def backward(ctx, grad_loss, _grad_stats):
        (d_logps,) = ctx.saved_tensors
        return d_logps * grad_loss, None, None, None, None, None, None
