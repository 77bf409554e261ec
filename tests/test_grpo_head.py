"""The default path's gradient-in-forward contract (fastgrpo.grpo_head): the gradient follows the loss through
scaling, sums, accumulation and retained graphs; long sequences take two passes; no-grad passes run one GEMM."""

import pytest
import torch
from helpers import assert_no_worse, leaf, make_problem
from loss_helpers import check, run
from torch.utils._python_dispatch import TorchDispatchMode

from fastgrpo import chunked
from fastgrpo.loss import LossConfig, fused_grpo_loss, token_logprobs
from fastgrpo.loss_config import LOSS_TYPES

GRADS = ("d_hidden", "d_weight", "d_bias")


def _grads(p, config, combine, dtype=torch.float64):
    """Gradients of combine(loss, x) w.r.t. hidden, weight, bias on the default path."""
    x, w, b = leaf(p["hidden"], dtype), leaf(p["weight"], dtype), leaf(p["bias"], dtype)
    loss, _ = fused_grpo_loss(x, w, p["ids"], p["mask"], p["adv"], bias=b, old_logps=p["old"],
                              ref_logps=p["ref"] if config.beta else None, config=config)
    combine(loss, x)
    return dict(zip(GRADS, (x.grad, w.grad, b.grad), strict=True))


@pytest.fixture(autouse=True)
def default_backend(monkeypatch):
    monkeypatch.setenv("FASTGRPO_BACKEND", "chunked")


CONFIG = LossConfig(loss_type="dapo", beta=0.04, epsilon_high=0.28)


def test_scaled_loss_scales_every_gradient():
    p = make_problem()
    once = _grads(p, CONFIG, lambda loss, x: loss.backward())
    twice = _grads(p, CONFIG, lambda loss, x: (2 * loss).backward())
    for name in GRADS:
        torch.testing.assert_close(twice[name], 2 * once[name], rtol=1e-12, atol=0)


def test_loss_plus_another_term():
    p = make_problem()
    alone = _grads(p, CONFIG, lambda loss, x: loss.backward())
    both = _grads(p, CONFIG, lambda loss, x: (loss + (x**2).sum()).backward())
    x = p["hidden"].double()
    torch.testing.assert_close(both["d_hidden"], alone["d_hidden"] + 2 * x, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(both["d_weight"], alone["d_weight"], rtol=0, atol=0)


def test_retain_graph_second_backward_accumulates_the_same_gradient():
    p = make_problem()
    once = _grads(p, CONFIG, lambda loss, x: loss.backward())
    twice = _grads(p, CONFIG, lambda loss, x: (loss.backward(retain_graph=True), loss.backward()))
    for name in GRADS:
        torch.testing.assert_close(twice[name], 2 * once[name], rtol=1e-12, atol=0)
    # Without retain_graph the saved gradients are freed, and autograd says so.
    x = leaf(p["hidden"], torch.float64)
    loss, _ = fused_grpo_loss(x, leaf(p["weight"], torch.float64), p["ids"], p["mask"], p["adv"], config=CONFIG,
                              ref_logps=p["ref"], old_logps=p["old"])
    loss.backward()
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        loss.backward()


@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_micro_batch_accumulation_equals_one_batch(loss_type):
    """Two half batches (dapo: normalised by the whole batch's tokens; grpo: each halved) accumulate the gradient of
    the whole batch."""
    p = make_problem()
    config = LossConfig(loss_type=loss_type, beta=0.04)
    x, w = leaf(p["hidden"], torch.float64), leaf(p["weight"], torch.float64)
    items = p["mask"].sum() if loss_type == "dapo" else None
    loss, _ = fused_grpo_loss(x, w, p["ids"], p["mask"], p["adv"], old_logps=p["old"], ref_logps=p["ref"],
                              config=config, num_items_in_batch=items)
    loss.backward()
    whole = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    B = p["mask"].shape[0]
    for half in (slice(0, B // 2), slice(B // 2, B)):
        part, _ = fused_grpo_loss(x[half], w, p["ids"][half], p["mask"][half], p["adv"][half],
                                  old_logps=p["old"][half], ref_logps=p["ref"][half], config=config,
                                  num_items_in_batch=items)
        (part if loss_type == "dapo" else part / 2).backward()
    torch.testing.assert_close(x.grad, whole[0], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(w.grad, whole[1], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_sequence_longer_than_a_chunk_takes_two_passes(monkeypatch, loss_type):
    """Sequence-level ratios with chunks of 4 tokens: rows of up to 9 tokens run two passes, and loss, gradients and
    metrics still match the float64 reference."""
    monkeypatch.setenv("FASTGRPO_CHUNK_TOKENS", "4")
    config = LossConfig(loss_type=loss_type, importance_sampling_level="sequence", beta=0.04, epsilon_high=0.28,
                        max_completion_length=16)
    check(monkeypatch, "chunked", torch.float32, make_problem(), config)
    p = make_problem()
    with CountMatmuls() as counter:  # a second pass forms a long row's logits again: more than 3 GEMMs of FLOPs
        run(monkeypatch, "chunked", torch.float32, p, config)
    (N, H), V = p["hidden"][p["mask"] != 0].shape, p["weight"].shape[0]
    assert counter.flops > 3 * 2 * N * H * V


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_chunk_size_does_not_change_the_result(monkeypatch, level):
    p = make_problem()
    config = LossConfig(loss_type="grpo", importance_sampling_level=level, beta=0.04, temperature=0.7)
    results = []
    for tokens in ("3", "7", "100000"):
        monkeypatch.setenv("FASTGRPO_CHUNK_TOKENS", tokens)
        results.append(run(monkeypatch, "chunked", torch.float64, p, config)[0])
    for other in results[1:]:
        for name in results[0]:
            torch.testing.assert_close(other[name], results[0][name], rtol=1e-10, atol=1e-13)


class CountMatmuls(TorchDispatchMode):
    """Matmul calls, and the FLOPs of the 2-D ones (2 M K N)."""

    def __init__(self):
        super().__init__()
        self.count = self.flops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        packet = func.overloadpacket
        if packet in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.addmm_, torch.ops.aten.bmm):
            self.count += 1
            if packet is not torch.ops.aten.bmm:
                a, b = args[-2:] if packet is torch.ops.aten.mm else args[1:3]
                self.flops += 2 * a.shape[0] * a.shape[1] * b.shape[1]
        return func(*args, **(kwargs or {}))


def test_no_grad_runs_one_gemm_of_flops_in_vocab_blocks(monkeypatch):
    """A CPU forms logits in vocab blocks (here several per chunk): more calls, the FLOPs of one GEMM (no-grad)
    and of three (training) over the valid tokens."""
    monkeypatch.setattr(chunked, "CPU_BLOCK_BYTES", 1)  # 128-column blocks
    p = make_problem()  # V 150: blocks of 128 and 22 columns
    N, (V, H) = int((p["mask"] != 0).sum()), p["weight"].shape
    gemm = 2 * N * H * V
    x, w = leaf(p["hidden"], torch.float32), leaf(p["weight"], torch.float32)
    args, kwargs = (p["ids"], p["mask"], p["adv"]), dict(old_logps=p["old"], ref_logps=p["ref"], config=CONFIG)
    with torch.no_grad(), CountMatmuls() as counter:
        fused_grpo_loss(x, w, *args, **kwargs)
    assert counter.flops == gemm and counter.count > 1
    with CountMatmuls() as counter:
        loss, _ = fused_grpo_loss(x, w, *args, **kwargs)
        loss.backward()
    assert counter.flops == 3 * gemm


def test_no_grad_runs_one_gemm_per_chunk_and_training_three(monkeypatch):
    monkeypatch.setenv("FASTGRPO_CHUNK_TOKENS", "8")
    p = make_problem()
    chunks = -(-int((p["mask"] != 0).sum()) // 8)
    x, w = leaf(p["hidden"], torch.float32), leaf(p["weight"], torch.float32)
    args = (p["ids"], p["mask"], p["adv"])
    kwargs = dict(old_logps=p["old"], ref_logps=p["ref"], config=CONFIG)
    with torch.no_grad(), CountMatmuls() as counter:
        fused_grpo_loss(x, w, *args, **kwargs)
        token_logprobs(x, w, p["ids"].clamp(min=0))
    assert counter.count == chunks + -(-p["ids"].numel() // 8)
    with CountMatmuls() as counter:  # frozen head and hidden states (an old/ref pass outside no_grad)
        fused_grpo_loss(x.detach(), w.detach(), *args, **kwargs)
    assert counter.count == chunks
    with CountMatmuls() as counter:
        loss, _ = fused_grpo_loss(x, w, *args, **kwargs)
        loss.backward()
    assert counter.count == 3 * chunks  # logits, dX, dW per chunk; the backward only scales
    with CountMatmuls() as counter:  # LoRA-style frozen head: no dW GEMM
        loss, _ = fused_grpo_loss(x, w.detach(), *args, **kwargs)
        loss.backward()
    assert counter.count == 2 * chunks


@pytest.mark.parametrize("offset", [74.0, 85.0])
def test_large_logits_keep_the_loss_finite(monkeypatch, offset):
    """Logits near the top of exp's fp32 range (a uniform shift: the log-softmax, so old/ref logps, unchanged): the
    training path's unshifted passes give way to the shifted ones before the entropy's sum of exp(z) z overflows."""
    p = make_problem()
    p["bias"] = p["bias"] + offset
    check(monkeypatch, "chunked", torch.float32, p, LossConfig(loss_type="dapo", beta=0.04, entropy_coef=0.01))


def test_no_grad_loss_equals_the_training_loss():
    p = make_problem()
    x, w = leaf(p["hidden"], torch.float64), leaf(p["weight"], torch.float64)
    kwargs = dict(old_logps=p["old"], ref_logps=p["ref"], config=CONFIG)
    with torch.no_grad():
        frozen, frozen_metrics = fused_grpo_loss(x, w, p["ids"], p["mask"], p["adv"], **kwargs)
    loss, metrics = fused_grpo_loss(x, w, p["ids"], p["mask"], p["adv"], **kwargs)
    torch.testing.assert_close(loss.detach(), frozen, rtol=1e-12, atol=0)
    assert metrics.keys() == frozen_metrics.keys()


@pytest.mark.parametrize("bad", [float("nan"), float("-inf")])
def test_non_finite_old_and_ref_logps_on_masked_positions_do_not_reach_the_loss(bad):
    p = make_problem()
    padded = {k: p[k].masked_fill(p["mask"] == 0, bad) for k in ("old", "ref")}
    assert (p["mask"] == 0).any()
    got = _grads({**p, **padded}, CONFIG, lambda loss, x: loss.backward())
    want = _grads(p, CONFIG, lambda loss, x: loss.backward())
    for name in GRADS:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=0)


@pytest.mark.parametrize("inplace", [True, False])
def test_fp32_accumulation_of_bf16_products_both_branches(inplace):
    """addmm_fp32_'s two forms (in-place out_dtype addmm from torch 2.10, an added fp32 product before) give the same
    fp32 accumulator; CPU has no bf16 x bf16 -> fp32 GEMM, so the branches run on meta tensors for shapes and
    dtypes, and the fp32 result is checked against fp32 operands."""
    acc = torch.zeros(5, 3, device="meta")
    out = chunked.addmm_fp32_(acc, torch.empty(5, 7, dtype=torch.bfloat16, device="meta"),
                              torch.empty(7, 3, dtype=torch.bfloat16, device="meta"), inplace=inplace)
    assert out.dtype == torch.float32 and out.shape == (5, 3)
    a, b = torch.randn(5, 7), torch.randn(7, 3)
    acc = torch.ones(5, 3)
    chunked.addmm_fp32_(acc, a, b, inplace=inplace)
    torch.testing.assert_close(acc, 1 + a @ b)
    assert chunked.INPLACE_FP32_ADDMM == (tuple(int(v) for v in torch.__version__.split(".")[:2]) >= (2, 10))


def test_a_compiled_graph_before_torch_2_13_adds_the_fp32_product(monkeypatch):
    """torch 2.10-2.12 trace no addmm.dtype_out (no decomposition): under torch.compile the added product runs."""
    def no_inplace_addmm(*args, **kwargs):
        raise AssertionError("addmm with out_dtype traced")

    monkeypatch.setattr(chunked, "COMPILED_FP32_ADDMM", False)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    monkeypatch.setattr(torch, "addmm", no_inplace_addmm)
    acc = torch.zeros(5, 3, device="meta")
    out = chunked.addmm_fp32_(acc, torch.empty(5, 7, dtype=torch.bfloat16, device="meta"),
                              torch.empty(7, 3, dtype=torch.bfloat16, device="meta"), inplace=True)
    assert out is acc
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: False)
    with pytest.raises(AssertionError, match="traced"):  # eager: the in-place form
        chunked.addmm_fp32_(acc, torch.empty(5, 7, dtype=torch.bfloat16, device="meta"),
                            torch.empty(7, 3, dtype=torch.bfloat16, device="meta"), inplace=True)


def test_bf16_cpu_path_no_worse_than_torch(monkeypatch):
    p = make_problem()
    rounded = {k: (v.to(torch.bfloat16).double() if k in ("hidden", "weight", "bias") else v) for k, v in p.items()}
    truth, _ = run(monkeypatch, "reference", torch.float64, rounded, CONFIG)
    same, _ = run(monkeypatch, "reference", torch.bfloat16, p, CONFIG)
    fast, _ = run(monkeypatch, "chunked", torch.bfloat16, p, CONFIG)
    for name in truth:
        assert_no_worse(f"bf16/{name}", fast[name], same[name], truth[name], torch.bfloat16)


@pytest.mark.parametrize("softcap", [None, 2.5])
@pytest.mark.parametrize("with_entropy", [False, True])
def test_cuda_row_kernels_match_the_cpu_kernels(with_entropy, softcap):
    """The row ops' CUDA kernels (Triton, here under TRITON_INTERPRET=1 in fp32) give what their CPU kernels give:
    statistics, and dZ written over Z."""
    pytest.importorskip("triton")
    torch.manual_seed(0)
    z, ids = torch.randn(5, 300) * 3, torch.randint(0, 300, (5,))
    g, h = torch.randn(5), (torch.randn(5) if with_entropy else None)
    cpu = chunked.logit_row_stats(z, ids, softcap, True, None)
    cuda = chunked._logit_row_stats_cuda(z, ids, softcap, True, None)
    for name, a, b in zip(("lse", "logp", "entropy"), cuda, cpu, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=name)
    dz_cpu, dz_cuda = z.clone(), z.clone()
    chunked.logit_row_grad_(dz_cpu, ids, cpu[0], cpu[2], g, h, 0.7, softcap, None)
    chunked._logit_row_grad_cuda(dz_cuda, ids, cpu[0], cpu[2], g, h, 0.7, softcap, None)
    torch.testing.assert_close(dz_cuda, dz_cpu, rtol=1e-5, atol=1e-6)


def _three_way(monkeypatch, p, config, importance_weights=None, dtype=torch.float32):
    """The default path vs float64 truth and the same-dtype reference: loss and gradients (hidden, weight, bias)."""
    def once(backend, dt, problem):
        monkeypatch.setenv("FASTGRPO_BACKEND", backend)
        x, w, b = leaf(problem["hidden"], dt), leaf(problem["weight"], dt), leaf(problem["bias"], dt)
        loss, metrics = fused_grpo_loss(x, w, problem["ids"], problem["mask"], problem["adv"], bias=b,
                                        old_logps=problem["old"], ref_logps=problem["ref"] if config.beta else None,
                                        config=config, importance_weights=importance_weights)
        loss.backward()
        return {"loss": loss.detach(), "d_hidden": x.grad, "d_weight": w.grad, "d_bias": b.grad}, metrics

    rounded = {k: (v.to(dtype).double() if k in ("hidden", "weight", "bias") else v) for k, v in p.items()}
    truth, truth_metrics = once("reference", torch.float64, rounded)
    same, _ = once("reference", dtype, p)
    fast, metrics = once("chunked", dtype, p)
    for name in truth:
        assert_no_worse(f"{name}", fast[name], same[name], truth[name], dtype)
    assert metrics.keys() == truth_metrics.keys()
    return truth


HEAD_OPTIONS = [
    dict(entropy_coef=0.05),
    dict(entropy_coef=-0.02, importance_sampling_level="sequence"),
    dict(logit_softcap=3.0, temperature=0.8),
    dict(logit_scale=0.5, beta=0.04),
    dict(logit_softcap=2.0, logit_scale=1.5, entropy_coef=0.1, importance_sampling_level="sequence", beta=0.04),
]


@pytest.mark.parametrize("chunk", ["4", "100000"])
@pytest.mark.parametrize("options", HEAD_OPTIONS, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()))
@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "cispo"])
def test_entropy_bonus_and_logit_transforms_match_float64(monkeypatch, options, loss_type, chunk):
    monkeypatch.setenv("FASTGRPO_CHUNK_TOKENS", chunk)
    _three_way(monkeypatch, make_problem(), LossConfig(loss_type=loss_type, **options))


@pytest.mark.parametrize("shape", ["token", "sequence"])
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_importance_weights_match_float64(monkeypatch, shape, level):
    """The sampler's truncated IS correction: [B, T] (token modes) or [B] (sequence modes) weights."""
    p = make_problem()
    B, T = p["mask"].shape
    weights = torch.rand(B, T) * 2 if shape == "token" else torch.rand(B) * 2
    truth = _three_way(monkeypatch, p, LossConfig(loss_type="grpo", importance_sampling_level=level, beta=0.04),
                       importance_weights=weights)
    plain = _three_way(monkeypatch, p, LossConfig(loss_type="grpo", importance_sampling_level=level, beta=0.04))
    assert not torch.allclose(truth["d_hidden"], plain["d_hidden"]), "the weights must matter"


@pytest.mark.parametrize("softcap", [None, 2.5])
def test_token_logprobs_with_logit_transforms(monkeypatch, softcap):
    p = make_problem()
    ids = p["ids"].clamp(min=0)
    kwargs = dict(temperature=0.9, logit_scale=1.3, logit_softcap=softcap, return_entropy=True)
    outs = {}
    for backend, dtype in (("reference", torch.float64), ("reference", torch.float32), ("chunked", torch.float32)):
        monkeypatch.setenv("FASTGRPO_BACKEND", backend)
        x, w = leaf(p["hidden"], dtype), leaf(p["weight"], dtype)
        logp, ent = token_logprobs(x, w, ids, **kwargs)
        (logp.sum() + 0.3 * ent.sum()).backward()
        outs[backend, dtype] = {"logp": logp.detach(), "entropy": ent.detach(), "d_hidden": x.grad,
                                "d_weight": w.grad}
    for name in outs["chunked", torch.float32]:
        assert_no_worse(name, outs["chunked", torch.float32][name], outs["reference", torch.float32][name],
                        outs["reference", torch.float64][name], torch.float32)


def test_entropy_coef_needs_entropies_in_grpo_loss():
    from fastgrpo.loss import grpo_loss

    p = make_problem()
    with pytest.raises(ValueError, match="entropies is required"):
        grpo_loss(p["old"].clone().requires_grad_(), p["mask"], p["adv"], config=LossConfig(entropy_coef=0.1))


def test_bad_importance_weights_and_softcap_are_named():
    p = make_problem()
    x, w = leaf(p["hidden"], torch.float32), leaf(p["weight"], torch.float32)
    with pytest.raises(ValueError, match="importance_weights must have shape"):
        fused_grpo_loss(x, w, p["ids"], p["mask"], p["adv"], config=LossConfig(), importance_weights=torch.ones(3))
    with pytest.raises(ValueError, match="logit_softcap must be None or a finite number > 0"):
        LossConfig(logit_softcap=0.0)


# -- the CUDA branch's choices on another device (chunked.emulate_device, for memory traces) ------------------------


class _OpLog(TorchDispatchMode):
    """Each op and its tensor outputs' shapes and dtypes (not their device)."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        outputs = out if isinstance(out, (tuple, list)) else [out]
        self.ops.append((str(func), [(tuple(t.shape), t.dtype) for t in outputs if isinstance(t, torch.Tensor)]))
        return out


def _fake_head(device: str, emulate: str | None, no_grad_pass: bool = True, N=5000, H=64, V=151936):
    """(the plan, every op) of the chunk loops of a no-grad pass and a gradient pass (HeadGrads) on fake bf16 tensors
    of `device`, a real vocab: nothing is allocated."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    logits = chunked.LogitMap()
    with FakeTensorMode(), chunked.emulate_device(emulate), _OpLog() as log:
        x = torch.empty(N, H, dtype=torch.bfloat16, device=device)
        w = torch.empty(V, H, dtype=torch.bfloat16, device=device)
        ids = torch.zeros(N, dtype=torch.long, device=device)
        if no_grad_pass:  # (a CPU's checks its sums on the host: not on fake tensors)
            chunked.logprobs_no_grad(x, w, None, ids, logits)
        grads = chunked.HeadGrads(x, w, None)
        for sl in grads.chunks():
            rows = grads.buffers.rows(x[sl], grads.w, None, logits, ids[sl])
            grads.add(sl, rows.grad(torch.ones_like(rows.logp), None, 1.0, grads.gemm_dtype))
        grads.result()
    return grads.plan, log.ops


CUDA_PLAN = chunked.HeadPlan("cuda", chunk=2**31 // (6 * 151936) // 128 * 128, upcast_weight=False,
                             fp32_output_gemm=True, reuse_buffers=False, dz_dtype=torch.bfloat16, blocked_stats=False)


def test_emulated_cuda_head_makes_the_cuda_branch_choices():
    """emulate_device("cuda") on CPU tensors gives the plan of CUDA tensors (its chunk size, the weight as is, per-chunk
    fp32 logits from bf16 operands, no reused buffers, dZ in bf16), and the loops follow it."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():  # (a CPU build makes fake CUDA tensors, but no views of them)
        cuda_x = torch.empty(5000, 64, dtype=torch.bfloat16, device="cuda")
    cpu_x = torch.empty(5000, 64, dtype=torch.bfloat16)
    assert chunked.head_plan(cuda_x, 151936) == CUDA_PLAN and CUDA_PLAN.chunk == 2304
    with chunked.emulate_device("cuda"):
        assert chunked.head_plan(cpu_x, 151936) == CUDA_PLAN
    assert chunked.head_plan(cpu_x, 151936) == chunked.HeadPlan(
        "cpu", chunk=256, upcast_weight=True, fp32_output_gemm=False, reuse_buffers=True, dz_dtype=torch.float32,
        blocked_stats=True)
    plan, ops = _fake_head("cpu", "cuda")
    assert plan == CUDA_PLAN
    gemms = [outputs for op, outputs in ops if op == "aten.mm.dtype"]  # GEMM 1: fp32 logits from bf16 operands
    assert gemms == [[((2304, 151936), torch.float32)], [((2304, 151936), torch.float32)],
                     [((392, 151936), torch.float32)]] * 2  # the no-grad pass, then the gradient's
    made = {(op.split(".")[1], *output) for op, outputs in ops for output in outputs}
    assert ("_to_copy", (151936, 64), torch.float32) not in made  # the weight as is
    assert ("empty", (2304, 151936), torch.bfloat16) in made  # dZ in bf16
    _, cpu_ops = _fake_head("cpu", None, no_grad_pass=False)
    assert "aten.mm.dtype" not in {op for op, _ in cpu_ops}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="fake CUDA tensors take views only in a CUDA build")
def test_emulated_cuda_head_runs_the_ops_of_cuda_tensors():
    cuda_plan, cuda_ops = _fake_head("cuda", None)
    plan, ops = _fake_head("cpu", "cuda")
    assert plan == cuda_plan == CUDA_PLAN and len(ops) > 50 and ops == cuda_ops


def test_emulated_cuda_head_computes_the_same_loss():
    """CUDA's choices on real (fp64) CPU tensors give the CPU branch's loss and gradients."""
    p = make_problem()
    config = LossConfig(beta=0.04)
    plain = _grads(p, config, lambda loss, x: loss.backward())
    with chunked.emulate_device("cuda"):
        emulated = _grads(p, config, lambda loss, x: loss.backward())
    for name in GRADS:
        torch.testing.assert_close(emulated[name], plain[name], rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="device_type must be"):
        with chunked.emulate_device("tpu"):
            pass
