"""Device-memory peaks of fastgrpo's training micro-batch and decode step, as bytes of live tensors.

`BytesMoved` (at the end) counts instead the bytes each op reads and writes, for the decode step's per-layer traffic
(`count_decode_bytes`).

`LiveBytes` counts the storages of live tensors at the dispatcher: every op's new output storage is added (once, by its
nbytes; views and in-place results add nothing) and subtracted when the storage is freed. It works on real tensors
and on FakeTensorMode tensors (whose meta storages have an nbytes but no memory), so the same code measures

* `trace_train_step` / `trace_decode_step`: one micro-batch or one decode step at real shapes (a 7B model, thousands
  of tokens) on fake CPU tensors: nothing is allocated, a trace takes seconds;
* `measure_trainer_step`: one `Trainer.train_step` of a real (small) model on the CPU, per phase.

What a count is: bytes of tensor storages, as a caching allocator's `memory_allocated` would see them before its
rounding (to 512 B blocks on CUDA); not the allocator's slack or fragmentation, the CUDA context, kernels' internal
workspaces (cuBLAS, flash-attention splits), or host memory. What the fake traces assume and emulate:

* Data-dependent host reads cannot run on fake tensors; they are answered as a full micro-batch would answer them
  (`_AssumeValid`): every element of a mask is nonzero (`nonzero` returns numel rows: every completion token is
  scored, the worst case), `all()` is True and `any()` False (fastgrpo's input checks pass, the loss's unshifted
  sums are in range), `torch.equal` False and `torch.allclose` True (the engine's probe of positions passes).
  Transformers cannot read a fake padding mask, so without mask_free_attention it builds the [b, 1, L, L] boolean
  mask and SDPA converts it to an additive one per call, as it does on a GPU for a padded
  micro-batch (an unpadded one would skip the mask and take the flash kernel with GQA, without the repeated K/V
  copies that a masked call makes); with it (the default, as in training) the right-padding check's `all()` is True
  and SDPA runs with is_causal and no mask, as it does for the trainer's right-padded micro-batches.
* Fake tensors live on the CPU (a CPU build cannot run a backward on fake CUDA tensors), so device-dependent code
  takes its CPU branch. SDPA on the CPU dispatches to `_scaled_dot_product_flash_attention_for_cpu`, whose outputs
  are [b, heads, L, d] and a [b, heads, L] logsumexp, as a GPU's flash / memory-efficient kernels: no [L, L]
  probabilities. fastgrpo's fused loss takes its CPU branch (chunks of `chunk_tokens(V, cpu)` rows, two reused fp32
  [chunk, V] buffers, an fp32 copy of the lm_head weight, dZ in fp32); `head="cuda"` makes it take its CUDA branch
  instead (fastgrpo.chunked.emulate_device: CUDA chunk size, no weight copy, per-chunk fp32 Z and a dZ in the input
  dtype).
* AdamW runs with foreach=True (PyTorch's default for CUDA parameters; its per-parameter temporaries exist together).
  bitsandbytes' AdamW8bit and Linear4bit run as they are (their ops have fake kernels), with two workarounds: the
  quantization maps (1 KiB real tensors) are built outside fake mode, and a 4-bit layer's weight is a fake uint8
  parameter carrying a real bitsandbytes QuantState (Params4bit cannot wrap a FakeTensor), made by
  bitsandbytes.functional.quantize_4bit itself (NF4, blocks of 64, double quantization; each layer holds its own
  copy of the 1 KiB blockwise map there, where a GPU shares one). The fake kernel of
  `bitsandbytes::gemm_4bit` shows only its output: for more than 1536 rows bitsandbytes' CUDA kernel dequantizes the
  weight (and the nested absmax) into temporaries before an F.linear, which `_AssumeValid` allocates the same way.
* With offload_activations the checkpointed layer inputs that ActivationOffload copies to the host are not counted
  (its `host_copies` are host memory on a GPU; on a CPU they are plain clones); the copies back to the device in the
  backward are.

The tracer reaches fastgrpo through public seams only: the trainer's `phase_hooks`, PolicyLoss's `hidden` and `loss`,
ActivationOffload's `host_copies`, fastgrpo.chunked.emulate_device and fastgrpo.sampling.attention.register_backend.
"""

import contextlib
import dataclasses
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakTensorKeyDictionary

from fastgrpo.memory import LiveBytes, storage_bytes
from fastgrpo.sampling.state import RecurrentState, StateStep, slots_for  # noqa: F401 - the tracer's counter (tests import it here)
from fastgrpo.sizes import GiB

aten = torch.ops.aten


# -- fake runs ------------------------------------------------------------------------------------------------------

BNB_CUDA_FUSED_MAX_ROWS = 1536  # bitsandbytes/backends/cuda/ops.py _gemm_4bit_custom_max_m: dequant + F.linear above


class _AssumeValid(TorchDispatchMode):
    """Answers the reads of values that fake tensors do not have, as a full micro-batch would (module docstring), and
    allocates the temporaries of bitsandbytes' CUDA 4-bit GEMM that its fake kernel does not show. Entered inside
    LiveBytes (above it on the mode stack), so what it allocates is counted."""

    def __init__(self):
        super().__init__()
        self._known = WeakTensorKeyDictionary()  # 0-dim results of all() / any(): their assumed value

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch._subclasses.fake_tensor import DataDependentOutputException

        kwargs = kwargs or {}
        if func is aten.nonzero.default:  # every element nonzero
            x = args[0]
            return torch.empty(x.numel(), x.dim(), dtype=torch.long, device=x.device)
        if func is aten._local_scalar_dense.default:
            try:
                return func(*args, **kwargs)  # a constant (a tensor of a Python number) has its value
            except DataDependentOutputException:
                if args[0] in self._known:
                    return self._known[args[0]]
                raise
        if func.namespace == "bitsandbytes" and func.__name__ == "gemm_4bit":
            return self._gemm_4bit(func, *args, **kwargs)
        if func is aten.equal.default:  # the engine's probe: the model's output depends on positions
            return False
        if func is aten.allclose.default:  # and is the same with positions 0, 1, ... as without position_ids
            return True
        out = func(*args, **kwargs)
        if func.overloadpacket in (aten.all, aten.any) and isinstance(out, torch.Tensor) and out.dim() == 0:
            self._known[out] = func.overloadpacket is aten.all
        return out

    @staticmethod
    def _gemm_4bit(func, A, B, shapeB, absmax, blocksize, quant_type, bias=None, absmax_8bit=None, absmax_code=None,
                   absmax_offset=None):
        if A.numel() // A.shape[-1] <= BNB_CUDA_FUSED_MAX_ROWS:
            return func(A, B, shapeB, absmax, blocksize, quant_type, bias=bias, absmax_8bit=absmax_8bit,
                        absmax_code=absmax_code, absmax_offset=absmax_offset)
        # bitsandbytes' _dequant_linear_fallback: the nested absmax dequantized in fp32 and offset (two temporaries),
        # the weight dequantized in A's dtype, then F.linear
        temporaries = []
        if absmax_8bit is not None:
            absmax_dq = torch.empty_like(absmax_8bit, dtype=torch.float32)
            temporaries += [absmax_dq, absmax_dq + absmax_offset]
        weight = torch.empty(shapeB, dtype=A.dtype, device=A.device)
        return torch.nn.functional.linear(A, weight, bias)


def _fake_mode():
    """A FakeTensorMode that does not memoize the fake tensors it wraps op outputs in: the memo's weak references
    to parameters stop `Module.to` (which swaps fake parameters) when peft casts its adapters."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    fake = FakeTensorMode(allow_non_fake_inputs=True)
    converter = fake.fake_tensor_converter
    memo = converter.set_tensor_memo

    def set_tensor_memo(t, v):
        if t.device.type != "meta":  # real tensors converted to fake keep theirs
            memo(t, v)

    converter.set_tensor_memo = set_tensor_memo
    return fake


def _bnb_qmaps():
    """bitsandbytes' 8-bit quantization map, built for real once: its construction reads values (.tolist())."""
    import bitsandbytes as bnb

    if "dynamic" not in bnb.functional.name2qmap:
        with _no_fake():
            bnb.functional.name2qmap["dynamic"] = bnb.functional.create_dynamic_map()
    return bnb


def _load_config(model_config):
    if isinstance(model_config, (str, Path)):
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(str(model_config))
    return model_config


def _quantize_4bit(model: torch.nn.Module, dtype: torch.dtype) -> int:
    """Replaces every nn.Linear and transformers Conv1D (GPT-2) but the output head by a bitsandbytes Linear4bit
    (QLoRA's NF4, blocks of 64, double quantization, computing in `dtype`, as fastgrpo.train.quantization.four_bit
    asks for; a Conv1D's [in, out] weight transposed, as transformers' bitsandbytes loading does). Experts' 3-D
    weights are not linear layers and stay as they are. Inside fake mode; returns the number of layers replaced."""
    from fastgrpo.train.shapes import is_linear, linear_shape

    bnb = _bnb_qmaps()
    head = model.get_output_embeddings()
    targets = [(name, module) for name, module in model.named_modules()
               if is_linear(module) and type(module) is not bnb.nn.Linear4bit and module is not head]
    for name, linear in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        in_features, out_features = linear_shape(linear)
        with _no_fake():  # its Params4bit on the real meta device
            layer = bnb.nn.Linear4bit(in_features, out_features, bias=False, compute_dtype=dtype,
                                      compress_statistics=True, quant_type="nf4", quant_storage=torch.uint8,
                                      device="meta")
        weight = linear.weight.detach()
        weight = weight if isinstance(linear, torch.nn.Linear) else weight.t()  # [out, in]
        packed, state = bnb.functional.quantize_4bit(weight, blocksize=64, compress_statistics=True,
                                                     quant_type="nf4", quant_storage=torch.uint8)
        weight = torch.nn.Parameter(packed, requires_grad=False)
        # What Params4bit would hold: bitsandbytes and peft read these attributes.
        weight.quant_state, weight.quant_type, weight.blocksize = state, "nf4", 64
        weight.compress_statistics, weight.quant_storage, weight.bnb_quantized = True, torch.uint8, True
        layer.weight = weight
        layer.bias = linear.bias
        layer.quant_state = state
        layer.support_avx512bf16_for_cpu = False  # no CPU-only repacking of the weight in eval mode (decode)
        setattr(parent, child, layer)
    return len(targets)


@contextlib.contextmanager
def _no_fake():
    """The active fake mode, if any, off for the block."""
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes():
        yield


def _quant_tensors(model: torch.nn.Module) -> list[torch.Tensor]:
    """The tensors of bitsandbytes quantization states (not parameters or buffers, but weights all the same)."""
    out = []
    for p in model.parameters():
        state = getattr(p, "quant_state", None)
        while state is not None:
            parts = (state.absmax, state.code, getattr(state, "offset", None))
            out += [t for t in parts if isinstance(t, torch.Tensor)]
            state = getattr(state, "state2", None)
    return out


def _weights(model: torch.nn.Module) -> list[torch.Tensor]:
    return [*model.parameters(), *model.buffers(), *_quant_tensors(model)]


@dataclasses.dataclass
class _Built:
    model: torch.nn.Module  # the peft model with use_peft
    fake: object  # the FakeTensorMode it lives in
    offload: object | None


def _build(config, dtype, *, use_peft, lora_r, lora_alpha, lora_dropout, load_in_4bit, gradient_checkpointing,
           offload_activations, attn_implementation, live: LiveBytes | None, mlp_tile_tokens: int | None = None,
           recompute_lora_inputs: bool = False, mask_free_attention: bool = False,
           recompute_norms: bool = False, lora_experts: bool | None = None) -> _Built:
    """fastgrpo.train.loading.load_policy on fake tensors: the model from its config (nothing allocated), 4-bit linears,
    SDPA without a mask for right-padded batches (mask_free_attention), gradient checkpointing (and offload),
    use_cache off, then LoRA as load_policy adds it (fastgrpo.train.lora.add_adapters: every linear layer but the
    head and the routers, and with lora_experts an MoE's experts), then the tiled MLP, LoRA inputs kept as they come
    and recomputed norms (fastgrpo.train.tiling.apply_layer_memory_options, as load_policy calls it)."""
    from transformers import AutoModelForCausalLM

    fake = _fake_mode()
    kwargs = {} if attn_implementation is None else {"attn_implementation": attn_implementation}
    with fake:
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, **kwargs)
        if load_in_4bit:
            _quantize_4bit(model, dtype)
        if mask_free_attention:
            from fastgrpo.train.tiling import use_mask_free_sdpa

            use_mask_free_sdpa(model)
        offload = None
        if gradient_checkpointing:
            if hasattr(model, "activation_checkpointing_enable"):
                model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
            else:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            if offload_activations:
                from fastgrpo.train.offload import ActivationOffload

                # its host copies are not device memory
                host_copies = contextlib.nullcontext if live is None else live.uncounted
                offload = ActivationOffload(torch.device("cpu"), host_copies=host_copies)
                offload.install(model)
        elif offload_activations:
            raise ValueError("offload_activations needs gradient_checkpointing")
        model.config.use_cache = False
        if use_peft:
            from fastgrpo.train.lora import add_adapters

            model = add_adapters(_lora_config(lora_r, lora_alpha, lora_dropout, lora_experts), model)
        from fastgrpo.train.tiling import apply_layer_memory_options

        apply_layer_memory_options(model, mlp_tile_tokens, use_peft and recompute_lora_inputs, recompute_norms)
    return _Built(model, fake, offload)


def _lora_config(lora_r: int, lora_alpha: int, lora_dropout: float, lora_experts: bool | None):
    """A TrainConfig with these LoRA options (the rest TrainConfig's defaults), for add_adapters."""
    from fastgrpo.train.config import TrainConfig

    experts = {} if lora_experts is None else {"lora_experts": lora_experts}
    return TrainConfig(model_name_or_path="trace", dataset_name="builtin", use_peft=True, lora_r=lora_r,
                       lora_alpha=lora_alpha, lora_dropout=lora_dropout, **experts)


def _optimizer(parameters: list[torch.Tensor], optim: str, defaults: dict) -> torch.optim.Optimizer:
    """The trainer's optimizer: AdamW with foreach=True, or bitsandbytes' AdamW8bit for optim="adamw_8bit"."""
    options = dict(lr=defaults["learning_rate"], weight_decay=defaults["weight_decay"],
                   betas=(defaults["adam_beta1"], defaults["adam_beta2"]))
    if optim == "adamw_8bit":
        return _bnb_qmaps().optim.AdamW8bit(parameters, **options)  # builds its maps: outside fake mode
    if optim == "adamw_torch":
        return torch.optim.AdamW(parameters, foreach=True, **options)
    raise ValueError(f"optim must be 'adamw_torch' or 'adamw_8bit', got {optim!r}")


def _steady_states(parameters: list[torch.Tensor], optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The optimizer's states after a step (inside the fake mode): live from the first step on."""
    for p in parameters:
        p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return [t for state in optimizer.state.values() for t in state.values() if isinstance(t, torch.Tensor)]


def _lora_defaults() -> dict:
    from fastgrpo.train.config import TrainConfig

    fields = {f.name: f.default for f in dataclasses.fields(TrainConfig)}
    return {name: fields[name] for name in ("lora_alpha", "lora_dropout", "learning_rate", "weight_decay",
                                            "adam_beta1", "adam_beta2", "max_grad_norm", "recompute_lora_inputs",
                                            "mask_free_attention", "recompute_norms")}


def trace_train_step(model_config, *, dtype: torch.dtype = torch.bfloat16, micro_batch: int = 8,
                     prompt_length: int = 256, completion_length: int = 1024, use_peft: bool = True, lora_r: int = 16,
                     lora_alpha: int | None = None, lora_dropout: float | None = None, load_in_4bit: bool = False,
                     optim: str = "adamw_torch", offload_activations: bool = False, beta: float = 0.0,
                     gradient_checkpointing: bool = True, attn_implementation: str | None = None,
                     loss_type: str = "dapo", head: str = "cpu", mlp_tile_tokens: int | None = None,
                     recompute_lora_inputs: bool | None = None, mask_free_attention: bool | None = None,
                     recompute_norms: bool | None = None, lora_experts: bool | None = None) -> dict:
    """One training micro-batch of fastgrpo's trainer at real shapes on fake CPU tensors: bytes by phase.

    `model_config`: a transformers config or a folder with a config.json. The model is built as load_policy builds
    it (4-bit linears, gradient checkpointing, offload, LoRA r / alpha / dropout as add_adapters places it, on an
    MoE's experts too with `lora_experts`; alpha, dropout and lora_experts default to TrainConfig's;
    fastgrpo/train/tiling.py's layer memory options `mlp_tile_tokens`, `recompute_lora_inputs`, `mask_free_attention`
    and `recompute_norms`, the last three TrainConfig's defaults (on) unless given); the fused loss applies the model's
    own logit transform (fastgrpo.loss.head_transform: Gemma's final-logit softcap); the micro-batch is `micro_batch`
    sequences of `prompt_length` + `completion_length` tokens, every completion token scored; first its no-grad
    logprobs (eval mode), then the trainer's update: PolicyLoss forward (the fused loss,
    `loss_type`, with ref logprobs when beta > 0), backward, clip_grad_norm_, the optimizer step (AdamW with
    foreach=True, or bitsandbytes' AdamW8bit for optim="adamw_8bit") and zero_grad. The optimizer's states are made
    by a step before the trace (a steady-state step: they are live throughout).

    Returns bytes (but "chunk_tokens", a count of tokens, and "seconds"):
        weights           parameters, buffers and 4-bit quantization states
        trainable         the parameters that train (in weights)
        optimizer_states  AdamW's states after a step
        logprobs          peak of the micro-batch's no-grad logprobs in eval mode (Trainer._logprobs: old or
                          reference logprobs, PolicyLoss.logprobs), before the update
        forward           peak during the micro-batch's forward (PolicyLoss: backbone and fused loss)
        loss              peak during the fused loss (its gradient is computed in its forward)
        saved             live after the forward, less before: what the backward will read (checkpointed inputs,
                          the loss's saved gradients)
        backward          peak during the backward
        gradients         the gradients after the backward
        optimizer         peak during clip_grad_norm_, the optimizer step and zero_grad
        train             peak over all of the above (the step's peak)
        chunk_tokens      rows per chunk of the fused loss (fastgrpo.chunked.chunk_tokens of the device `head`
                          emulates: "cpu", or "cuda" for the CUDA branch, see the module docstring)
    """
    from fastgrpo import chunked
    from fastgrpo.loss import head_transform
    from fastgrpo.loss_config import TOKEN_NORMALISED_LOSS_TYPES, LossConfig
    from fastgrpo.train.policy_loss import PolicyLoss
    from fastgrpo.train.rollout import MicroBatch

    if head not in ("cpu", "cuda"):
        raise ValueError(f"head must be 'cpu' or 'cuda', got {head!r}")
    start = time.perf_counter()
    defaults = _lora_defaults()
    config = _load_config(model_config)
    live = LiveBytes()
    built = _build(config, dtype, use_peft=use_peft, lora_r=lora_r,
                   lora_alpha=defaults["lora_alpha"] if lora_alpha is None else lora_alpha,
                   lora_dropout=defaults["lora_dropout"] if lora_dropout is None else lora_dropout,
                   load_in_4bit=load_in_4bit, gradient_checkpointing=gradient_checkpointing,
                   offload_activations=offload_activations, attn_implementation=attn_implementation, live=live,
                   mlp_tile_tokens=mlp_tile_tokens,
                   recompute_lora_inputs=defaults["recompute_lora_inputs"] if recompute_lora_inputs is None
                   else recompute_lora_inputs,
                   mask_free_attention=defaults["mask_free_attention"] if mask_free_attention is None
                   else mask_free_attention,
                   recompute_norms=defaults["recompute_norms"] if recompute_norms is None else recompute_norms,
                   lora_experts=lora_experts)
    model, fake = built.model, built.fake
    parameters = [p for p in model.parameters() if p.requires_grad]
    optimizer = _optimizer(parameters, optim, defaults)
    b, P, T = micro_batch, prompt_length, completion_length
    transform = head_transform(config)
    policy = PolicyLoss(model, packed=False, head=dict(transform))
    loss_options = LossConfig(loss_type=loss_type, beta=beta, max_completion_length=T, **transform)
    num_items = float(b * T) if loss_type in TOKEN_NORMALISED_LOSS_TYPES else None
    result = {}
    with fake:
        states = _steady_states(parameters, optimizer)
        live.add(*_weights(model))
        result["weights"] = live.current
        result["trainable"] = storage_bytes(parameters)
        result["optimizer_states"] = live.add(*states)
        live.base = live.current
        V = model.get_output_embeddings().weight.shape[0]
        batch = lambda: MicroBatch(  # the trainer's micro_batch: made on the device
            index=list(range(b)), completion_ids=torch.zeros(b, T, dtype=torch.long),
            mask=torch.ones(b, T), advantages=torch.zeros(b), sequences=[[0] * (P + T)] * b,
            prompt_lengths=[P] * b, old_logps=None, ref_logps=torch.zeros(b, T) if beta else None,
            importance_weights=None,
        )  # fmt: skip
        model.eval()  # the no-grad logprobs of Trainer._logprobs (old or reference logprobs)
        with live, _AssumeValid(), chunked.emulate_device(head), torch.no_grad(), live.phase("logprobs"):
            mb = batch()
            policy.logprobs(mb)
            del mb
        model.train()
        with live, _AssumeValid(), live.phase("train"):
            with chunked.emulate_device(head):
                mb = batch()
                before = live.current
                with live.phase("forward"):  # policy(mb, ...), its fused loss apart
                    hidden = policy.hidden(mb)
                    with live.phase("loss"):
                        loss, metrics = policy.loss(hidden, mb, loss_options, num_items)
                    del hidden
                result["saved"] = live.current - before
                with live.phase("backward"):
                    (loss * 1.0).backward()
            result["gradients"] = storage_bytes(p.grad for p in parameters if p.grad is not None)
            del loss, metrics, mb
            with live.phase("optimizer"):
                torch.nn.utils.clip_grad_norm_(parameters, defaults["max_grad_norm"])
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
        result.update({name: live.peaks[name] for name in ("logprobs", "forward", "loss", "backward", "optimizer",
                                                           "train")})
    result["chunk_tokens"] = chunked.chunk_tokens(V, torch.device(head))
    result["seconds"] = time.perf_counter() - start
    return result


def _output_only_attention(triton: bool) -> str:
    """The name of an engine attention backend (registered here) that allocates what the CUDA triton backend does, its
    [T, heads, value dim] output, and computes nothing, for any window, softcap or sinks (the CPU's torch backend
    gathers each sequence's pages into a padded copy per layer, which a GPU never makes). `triton`: the engine runs
    its Triton decode layers and sampler with it."""
    from fastgrpo.sampling.attention import register_backend

    name = "trace-output-only-triton" if triton else "trace-output-only"
    register_backend(name, _attention_output, triton=triton, features=("window", "softcap", "sinks", "value_dim"))
    return name


def _attention_output(query, k_cache, v_cache, batch, scale, *args, **kwargs):
    return query.new_empty(*query.shape[:2], v_cache.shape[-1])  # [T, heads, value dim]


def _decode_rows(batch, num_sequences: int, pages: int, context_length: int):
    """`batch` (a DecodeBatch) with `num_sequences` rows of `pages` pages whose contexts end at `context_length` (this
    step's token included)."""
    batch.seqs = [None] * num_sequences  # rows only: the step reads their host mirrors
    batch.context_h[:num_sequences] = context_length - 1
    batch.pages_h[:num_sequences] = pages
    return batch


def trace_decode_step(model_config, *, dtype: torch.dtype = torch.bfloat16, num_sequences: int = 64,
                      context_length: int = 1280, load_in_4bit: bool = False, use_peft: bool = False,
                      lora_r: int = 16, block_size: int = 16, attention: str = "triton", params=None) -> dict:
    """One decode step of fastgrpo's engine at real shapes on fake CPU tensors: bytes by phase.

    The engine itself runs (fastgrpo.sampling.engine.Engine._eager_forward and the sampler), not its scheduler: a
    paged KV pool holding `num_sequences` x `context_length` tokens (whole pages of `block_size`), a DecodeBatch of
    `num_sequences` rows whose contexts end at `context_length` (this step's token included), one forward of their
    new tokens through the model (the policy as load_policy builds it, in eval mode without autograd; LoRA adapters
    with use_peft) into [num_sequences, V] logits, then `sample` on their fp32 copy with `params` (default
    SamplingParams(): temperature 1, no top-k / top-p).

    `attention`: "triton" replaces the CPU's torch backend (which gathers each sequence's pages into a padded
    [S, context, kv_heads, d] copy per layer) with what the CUDA triton backend allocates: its [S, heads, d] output
    only; "torch" keeps the CPU backend.

    Returns bytes (but "seconds"):
        weights      parameters, buffers and 4-bit quantization states
        kv_cache     the pool: 2 x layers x pages x block_size x kv_heads x head_dim x dtype bytes (exactly 2 x
                     layers x num_sequences x context_length x ... when context_length is a multiple of block_size)
        kv_scratch   the page the engine allocates past its pool for CUDA graphs' padding rows (not in the trace)
        decode       peak during the step: the forward and the sampler, the pool and weights included
        forward      peak during the forward alone
    """
    from fastgrpo.sampling.batch import DecodeBatch
    from fastgrpo.sampling.block_pool import blocks_for
    from fastgrpo.sampling.engine import Engine
    from fastgrpo.sampling.params import SamplingParams
    from fastgrpo.sampling.sampler import sample

    if attention not in ("triton", "torch"):
        raise ValueError(f"attention must be 'triton' or 'torch', got {attention!r}")
    start = time.perf_counter()
    config = _load_config(model_config)
    built = _build(config, dtype, use_peft=use_peft, lora_r=lora_r, lora_alpha=_lora_defaults()["lora_alpha"],
                   lora_dropout=_lora_defaults()["lora_dropout"], load_in_4bit=load_in_4bit,
                   gradient_checkpointing=False, offload_activations=False, attn_implementation=None, live=None)
    model, fake = built.model, built.fake
    params = SamplingParams() if params is None else params
    S, pages = num_sequences, blocks_for(context_length, block_size)
    result = {}
    with fake:
        with _AssumeValid():  # (the engine's probe runs the model)
            engine = Engine(model, block_size=block_size,
                            attention=_output_only_attention(triton=False) if attention == "triton" else "torch")
        live = LiveBytes(_weights(model))
        result["weights"] = live.base
        itemsize = torch.empty((), dtype=engine.dtype).element_size()
        page_bytes = 2 * engine.num_layers * block_size * engine.num_kv_heads * engine.head_dim * itemsize
        with live, _AssumeValid():
            with live.phase("kv_cache"):
                kv_cache = torch.zeros(engine.num_layers, 2, S * pages, block_size, engine.num_kv_heads,
                                       engine.head_dim, dtype=engine.dtype)
            result["kv_cache"] = live.current - live.base
            batch = _decode_rows(DecodeBatch(S, pages, block_size, engine.device), S, pages, context_length)
            u = torch.empty(S, dtype=torch.float64)  # each row's uniform (Outputs.uniforms)
            with live.phase("decode"), engine._sampling_mode():
                rows = batch.inputs()
                with live.phase("forward"):
                    logits = engine._eager_forward(rows, batch.max_context(), None, kv_cache)
                tokens, logprobs = sample(logits.float(), params, None if params.greedy else u)
                del logits
    result["kv_scratch"] = page_bytes
    result.update({name: live.peaks[name] for name in ("decode", "forward")})
    result["seconds"] = time.perf_counter() - start
    return result


def trace_sampling(model_config, *, kv_blocks: int, prompt_length: int = 512, completion_length: int = 1024,
                   num_generations: int = 8, num_prompts: int = 1, dtype: torch.dtype = torch.bfloat16,
                   kv_cache_dtype: str = "auto", use_peft: bool = True, lora_r: int = 16, load_in_4bit: bool = False,
                   optim: str = "adamw_torch", mlp_tile_tokens: int | None = None, block_size: int = 16,
                   params=None, lora_dropout: float | None = None, lora_experts: bool | None = None) -> dict:
    """The sampling phase of `fastgrpo train` at real shapes on fake CPU tensors: bytes by moment.

    Live while the trainer samples a round: the policy as load_policy builds it for training (4-bit linears, LoRA r 16
    as add_adapters places it, `lora_dropout` and `lora_experts` TrainConfig's unless given, the tiled MLP and LoRA
    inputs as they come; the engine runs its no-grad forward), the
    optimizer's states of a steady step (gradients are freed after each step), and what Engine.generate allocates for
    a round of `num_prompts` x `num_generations` completions of up to `completion_length` tokens: the KV cache
    (fastgrpo.sampling.kv_cache.KVCache over the engine's layer model: the logical pool of `kv_blocks` pages for the
    full-attention layers and, per sliding window, its pool of plan.window_group_pages pages, each with its scratch
    page; the model's dtype, or e4m3 with kv_cache_dtype="fp8" and its [layers, 2, Hkv] fp32 scales), the output
    buffers (Outputs, 20 bytes a token) and the decode rows (DecodeBatch, a page table per pool). Then the
    engine's two largest steps, each a forward (Engine._eager_forward through transformers' layers) and its sampler
    (Engine._sample, the PyTorch sampler with `params`, default temperature 1):

        prefill  the step that starts the round: every prompt's tokens at once (as the scheduler packs them, up to
                 max_num_batched_tokens), each prompt's last position sampling its num_generations first tokens
        decode   min(max_num_seqs, completions) rows, each at the full context prompt + completion

    Attention allocates what the CUDA triton backend does, its output (`_output_only_attention`); on the CPU the
    cache stores and fp8 quantization are PyTorch ops, whose temporaries the CUDA rope_store kernel does not make.

    Returns bytes (but "seconds"):
        weights           parameters, buffers and 4-bit quantization states (the LoRA weights among them)
        optimizer_states  AdamW's states after a step
        kv_cache          the pools, their scratch pages and the fp8 scales (kv_pools: each pool's pages)
        recurrent_state   a hybrid's state slots; route_records an MoE's routes (sampling/routes.py)
        buffers           Outputs and DecodeBatch
        prefill, decode   the peak of each step (everything live counted)
        sampling          the larger of the two: the phase's peak
    """
    from fastgrpo.sampling.batch import DecodeBatch, Outputs
    from fastgrpo.sampling.block_pool import blocks_for
    from fastgrpo.sampling.engine import Engine, HostBatch
    from fastgrpo.sampling.kv_cache import KVCache
    from fastgrpo.sampling.params import EngineConfig, SamplingParams
    from fastgrpo.sampling.routes import RouteRecords
    from fastgrpo.sampling.sequence import Group, Sequence
    from fastgrpo.train.plan import window_group_pages

    if kv_cache_dtype not in ("auto", "fp8"):
        raise ValueError(f"kv_cache_dtype must be 'auto' or 'fp8', got {kv_cache_dtype!r}")
    start = time.perf_counter()
    defaults = _lora_defaults()
    config = _load_config(model_config)
    built = _build(config, dtype, use_peft=use_peft, lora_r=lora_r, lora_alpha=defaults["lora_alpha"],
                   lora_dropout=defaults["lora_dropout"] if lora_dropout is None else lora_dropout,
                   load_in_4bit=load_in_4bit, gradient_checkpointing=False, offload_activations=False,
                   attn_implementation=None, live=None, mlp_tile_tokens=mlp_tile_tokens,
                   recompute_lora_inputs=defaults["recompute_lora_inputs"], mask_free_attention=False,
                   recompute_norms=defaults["recompute_norms"], lora_experts=lora_experts)
    model, fake = built.model, built.fake
    parameters = [p for p in model.parameters() if p.requires_grad]
    optimizer = _optimizer(parameters, optim, defaults)
    params = SamplingParams(max_new_tokens=completion_length) if params is None else params
    engine_config = EngineConfig()
    G, P, T = num_generations, num_prompts, prompt_length
    width = blocks_for(T + completion_length, block_size)
    rows = min(engine_config.max_num_seqs, P * G)
    result = {}
    with fake:
        states = _steady_states(parameters, optimizer)
        live = LiveBytes(_weights(model))
        result["weights"] = live.base
        result["optimizer_states"] = live.add(*states)
        live.base = live.current
        with _AssumeValid():  # (the engine's probe runs the model)
            engine = Engine(model, block_size=block_size, attention=_output_only_attention(triton=False))
        with live, _AssumeValid(), engine._sampling_mode():
            before = live.current
            kv_dtype = torch.float8_e4m3fn if kv_cache_dtype == "fp8" else engine.dtype
            windows = engine.layer_model.windows  # the engine's pools: the logical one, then one per window
            sequence_pages = -(-(prompt_length + completion_length) // block_size)
            seats = min(engine_config.max_num_seqs, num_prompts * num_generations)  # as the engine sizes them
            pools = [kv_blocks, *(window_group_pages(w, kv_blocks, block_size, sequence_pages, seats) for w in windows)]
            kv_cache = KVCache(engine.layer_model, pools, block_size, kv_dtype, engine.device)
            if kv_cache_dtype == "fp8":  # (Engine computes them from the weights: kv_scales)
                engine._kv_scales = torch.ones(engine.num_layers, 2, engine.num_kv_heads)
            result["kv_cache"] = live.current - before
            before = live.current
            state = None  # a hybrid's recurrent state slots, as Engine.generate sizes them (state.slots_for)
            if engine.layer_model.states:
                seats = min(engine_config.max_num_seqs, engine_config.max_num_batched_tokens, P * G)
                state = RecurrentState(engine.layer_model.states, slots_for(seats, P, G), engine.device)
            result["recurrent_state"] = live.current - before
            result["kv_pools"] = pools
            before = live.current
            routes = None  # an MoE's route records, as the trainer's engine keeps them (record_routes)
            if engine.routing is not None and engine.routing.can_record:
                groups = [Group(prompt=Sequence([0] * T, T), n=G, index=i) for i in range(P)]
                routes = RouteRecords(engine.routing, groups, G, completion_length, engine.device)
            result["route_records"] = live.current - before
            before = live.current
            outputs = Outputs(P * G, completion_length, engine.device, None if params.greedy else 0)
            batch = DecodeBatch(max(min(engine_config.max_num_seqs, engine_config.max_num_batched_tokens), G), width,
                                block_size, engine.device, tables=lambda logical: [logical] * len(pools))
            result["buffers"] = live.current - before
            # the first step: the prompts, packed (the scheduler's chunks of at most max_num_batched_tokens)
            tokens = min(engine_config.max_num_batched_tokens, P * T)
            lengths = [min(T, tokens - i * T) for i in range(-(-tokens // T))]
            host = HostBatch(input_ids=[0] * tokens, positions=[p for n in lengths for p in range(n)],
                             slots=[list(range(tokens))] * len(pools), query_lens=lengths, context_lens=lengths,
                             block_tables=[[[0] * width for _ in lengths]] * len(pools),
                             last_tokens=[sum(lengths[: i + 1]) - 1 for i in range(len(lengths))],
                             sample_counts=[G] * len(lengths), state_slots=list(range(len(lengths))),
                             fresh=[True] * len(lengths))
            u = None if params.greedy else torch.empty(G * len(lengths), dtype=torch.float64)
            with live.phase("prefill"):
                logits = engine._eager_forward(None, 0, host, kv_cache, state)
                logits = logits[torch.arange(len(lengths)).repeat_interleave(G)]  # a first fork samples G tokens
                engine._sample(logits, params, u, None)
                del logits
            _decode_rows(batch, rows, width, T + completion_length)
            u = None if params.greedy else torch.empty(rows, dtype=torch.float64)
            with live.phase("decode"):
                row_slots = None if state is None else torch.arange(rows)
                logits = engine._eager_forward(batch.inputs(), batch.max_context(), None, kv_cache, state, row_slots)
                engine._sample(logits, params, u, None)
                del logits
            engine._kv_scales = None
            del outputs, batch, kv_cache, state, routes  # live through both steps, as in Engine.generate
    result.update({name: live.peaks[name] for name in ("prefill", "decode")})
    result["sampling"] = max(result["prefill"], result["decode"])
    result["seconds"] = time.perf_counter() - start
    return result


class BytesMoved(TorchDispatchMode):
    """Bytes each op reads and writes in device memory, summed by kind: "gemm" (mm, addmm, bmm: activations and
    weights), "experts" (grouped GEMMs, an MoE's experts: every expert's weight counted, the most such a kernel
    reads), "fused" (fastgrpo's custom ops: one kernel each) and "elementwise" (every other op), on real or fake
    tensors. An op moves its tensor arguments and results, with these exceptions: views, metadata and allocations
    move nothing; gathers and scatters (embedding, index, index_select, gather, index_put_) move the rows they
    touch, not the table; searchsorted reads log2(V) entries per row; fastgrpo::rope_store writes K/V into their
    pages (not the pool) and fastgrpo::sample reads the logits once plus one vocabulary tile per row."""

    NOTHING = ("empty", "empty_like", "new_empty", "empty_strided", "detach", "alias", "_unsafe_view", "lift_fresh",
               "sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "_local_scalar_dense", "set_")

    def __init__(self):
        super().__init__()
        self.bytes: dict[str, int] = {"gemm": 0, "experts": 0, "fused": 0, "elementwise": 0}
        self.ops: dict[str, int] = {"gemm": 0, "experts": 0, "fused": 0, "elementwise": 0}  # launches (one per op)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func.overloadpacket.__name__
        if func.is_view or name in self.NOTHING or func.namespace == "prim":
            return out
        moved = self._moved(func, name, args, kwargs, out)
        kind = ("fused" if func.namespace == "fastgrpo" else
                "gemm" if name in ("mm", "addmm", "bmm", "baddbmm") else
                "experts" if name in ("_grouped_mm", "grouped_mm", "grouped_mm_fallback") else "elementwise")
        self.bytes[kind] += moved
        self.ops[kind] += 1
        return out

    @staticmethod
    def _moved(func, name, args, kwargs, out) -> int:
        size = lambda t: t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0
        results = sum(map(size, tree_flatten(out)[0]))
        if name in ("embedding", "index", "index_select"):
            return 2 * results + size(args[1])  # the rows read, written out, and the indices
        if name == "gather":
            return 2 * results + size(args[2])
        if name == "searchsorted":  # a binary search per row: log2(V) reads of the sorted row
            sorted_rows = args[0]
            steps = max(1, int(sorted_rows.shape[-1]).bit_length())
            return sorted_rows[..., 0].numel() * steps * sorted_rows.element_size() + size(args[1]) + results
        if name in ("index_put", "index_put_"):
            indices = sum(map(size, tree_flatten(args[1])[0]))
            return 2 * size(args[2]) + indices
        if name == "rope_store":
            qkv, q = args[0], out
            kv_written = size(qkv) - size(q)
            return size(qkv) + size(args[1]) + size(args[2]) + size(args[3]) + size(args[4]) + size(q) + kv_written
        if name == "sample":
            from fastgrpo.kernels.sampling import BLOCK_V

            logits = args[0]
            tile = logits.shape[0] * min(BLOCK_V, logits.shape[1]) * logits.element_size()
            return size(logits) + tile + size(args[2]) + results
        inputs = sum(map(size, tree_flatten((args, kwargs))[0]))
        return inputs + results


def count_decode_bytes(model_config, *, fused: bool, dtype: torch.dtype = torch.bfloat16, num_sequences: int = 512,
                       context_length: int = 768, block_size: int = 16, params=None,
                       layer_type: str | None = None) -> dict:
    """Bytes one decode step of the engine moves on a GPU, counted op by op (BytesMoved) on fake CPU tensors at real
    shapes: `fused` runs the engine's own layers with their CUDA kernels (decode_layers.py with the triton ops, the
    fused sampler), not `fused` transformers' modules with the paged attention function and the PyTorch sampler
    over an fp32 copy of the logits (the engine before its fused layers, and the path of other architectures).

    The paged attention kernel itself is left out (the same kernel on both paths: it reads each sequence's K/V once
    per KV head, `attention_kv_bytes`). Returns {"layer": {kind: bytes}, "layer_ops": {kind: launches},
    "head": ..., "head_ops": ..., "attention_kv_bytes": int}: per decoder layer (the difference of a model with one
    layer more), and the rest of the step (embedding, rotary tables, final norm, lm_head, sampler).

    A hybrid (config.layer_types of several kinds): `layer_type` names the kind of layer counted, a model of one
    attention layer against one with a layer of that kind before it; a recurrent layer's decode runs from its rows'
    state slots (state.py), and "state_bytes" is what it must read and write of them at least (each row's state
    once each way).
    """
    from fastgrpo.sampling.attention import build_paged_batch
    from fastgrpo.sampling.batch import DecodeBatch
    from fastgrpo.sampling.block_pool import blocks_for
    from fastgrpo.sampling.engine import Engine
    from fastgrpo.sampling.kv_cache import KVCache
    from fastgrpo.sampling.params import SamplingParams

    config = _load_config(model_config)
    params = SamplingParams() if params is None else params
    S, pages = num_sequences, blocks_for(context_length, block_size)
    counts, states = [], None
    for layers in (1, 2):
        fields = {**config.to_dict(), "num_hidden_layers": layers}
        if layer_type is not None:
            fields["layer_types"] = [layer_type, "full_attention"][2 - layers :]
        elif fields.get("layer_types"):
            fields["layer_types"] = fields["layer_types"][:layers]
        layer_config = type(config).from_dict(fields)
        built = _build(layer_config, dtype, use_peft=False, lora_r=0, lora_alpha=0, lora_dropout=0.0,
                       load_in_4bit=False, gradient_checkpointing=False, offload_activations=False,
                       attn_implementation=None, live=None)
        with built.fake, _AssumeValid():
            engine = Engine(built.model, block_size=block_size, attention=_output_only_attention(triton=fused),
                            fused_layers=fused)
            kv_cache = torch.zeros(engine.num_layers, 2, S * pages, block_size, engine.num_kv_heads,
                                   engine.head_dim, dtype=engine.dtype)
            state = step = None
            if engine.layer_model.states:
                states = engine.layer_model.states
                state = RecurrentState(states, S, engine.device)
                step = StateStep(state, torch.arange(S), [], [], [])
            rows = _decode_rows(DecodeBatch(S, pages, block_size, engine.device), S, pages, context_length).inputs()
            u = None if params.greedy else torch.empty(S, dtype=torch.float64)
            with engine._sampling_mode():
                paged_batch = build_paged_batch(KVCache.from_tensor(kv_cache, engine.layer_model), [], [], [], [],
                                                engine.backend, 1, rows=rows, rows_max_context=context_length)
                with BytesMoved() as moved:  # the forward and the sampler, not the batch's set-up
                    logits = engine._forward(rows["input_ids"], rows["positions"], paged_batch, 0, step)
                    engine._sample(logits, params, u, None)
        counts.append(moved)
    one, two = counts
    layer = {kind: two.bytes[kind] - one.bytes[kind] for kind in one.bytes}
    layer_ops = {kind: two.ops[kind] - one.ops[kind] for kind in one.ops}
    itemsize = torch.empty((), dtype=dtype).element_size()
    text = config.get_text_config()
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    recurrent = layer_type not in (None, "full_attention", "sliding_attention")
    # (the rest of the step is the one-layer model less its layer: an attention layer's count, not a recurrent one's)
    return {"layer": layer, "layer_ops": layer_ops,
            "head": None if recurrent else {kind: one.bytes[kind] - layer[kind] for kind in layer},
            "head_ops": None if recurrent else {kind: one.ops[kind] - layer_ops[kind] for kind in layer_ops},
            "attention_kv_bytes": 0 if recurrent else 2 * S * context_length * text.num_key_value_heads * head_dim
            * itemsize,
            "state_bytes": 2 * S * sum(layer.nbytes for layer in states) if states else 0}


def measure_trainer_step(trainer) -> dict:
    """One `trainer.train_step()` of a real fastgrpo Trainer (on a CPU: every tensor is "device" memory) under
    LiveBytes, with the phases it reports to its phase_hooks: "sampling" (the engine's generate), "logprobs"
    (reference and old logprobs; None when the step computes none) and "train" (the update). Returns bytes:

        base        the policy's (and reference's) parameters and buffers and the optimizer's states at the start
        sampling, logprobs, train   the phases' peaks (everything live counted, base included)
        kv_pool     the engine's KV pools of that step (num_blocks + 1 logical pages, window_blocks + 1 per window: it
                    is sized from free memory on a CPU too, capped at what the call can use), in the sampling peak:
                    compare a plan net of it
        step        the peak over the whole step
    """
    models = [m for m in (trainer.model, getattr(trainer, "ref_model", None)) if m is not None]
    states = [t for state in trainer.optimizer.state.values() for t in state.values() if isinstance(t, torch.Tensor)]
    live = LiveBytes([t for m in models for t in _weights(m)] + states)
    hook = live.phase
    trainer.phase_hooks.append(hook)
    try:
        with live, live.phase("step"):
            trainer.train_step()
    finally:
        trainer.phase_hooks.remove(hook)
    engine = trainer.engine
    itemsize = torch.empty((), dtype=engine.kv_dtype).element_size()
    pages = [engine.stats.num_blocks, *engine.stats.window_blocks]  # per pool, as the engine's layer model orders them
    model = engine.layer_model
    pool = sum((pages[model.pool_of(layer.slot)] + 1) * engine.config.block_size * layer.kv_heads
               * (layer.key_dim + layer.value_dim) * itemsize for layer in model.layers if layer.owns_pages)
    return {"base": live.base, **{name: live.peaks.get(name) for name in ("sampling", "logprobs", "train")},
            "kv_pool": pool, "step": live.peaks["step"]}


def gib(result: dict) -> dict:
    """A result's byte counts in GiB (other entries as they are), for printing."""
    return {k: round(v / GiB, 3) if isinstance(v, int) and k != "chunk_tokens" else v for k, v in result.items()}
