"""Loading the policy, its reference and tokenizer: from a hub id, a folder, a GGUF file or the built-in model; the
checks that fastgrpo's fused head computes the model's own logits."""

import dataclasses
import importlib.util
import inspect
import json
from contextlib import contextmanager
from pathlib import Path

import torch
from huggingface_hub import constants as hub_constants
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerFast
from transformers.modeling_outputs import BaseModelOutputWithPast, ModelOutput

from fastgrpo.loss import head_transform
from fastgrpo.sampling.engine import context_window
from fastgrpo.train.config import BUILTIN, TrainConfig, is_local_path, read_utf8, train_dtype
from fastgrpo.train.lora import add_adapters
from fastgrpo.train.moe import router_aux_loss_coef
from fastgrpo.train.quantization import bitsandbytes, four_bit, keep_trainable
from fastgrpo.train.tiling import apply_layer_memory_options, use_mask_free_sdpa

DEFAULT_MODEL = Path(__file__).parent / "default_model"
PACKED_ATTENTION = ("flash_attention_2", "flash_attention_3")  # varlen kernels: packing costs no extra FLOPs
GGUF_SUFFIX = ".gguf"
GGUF_PACKAGES = ("gguf", "accelerate")  # transformers reads a GGUF with gguf, and refuses to without accelerate


def model_path(config: TrainConfig) -> str:
    """The model's folder, GGUF file or hub id; a local path that does not exist, or a folder without a config.json,
    is refused here rather than sent to the hub as an id."""
    if config.model_name_or_path == BUILTIN:
        return str(DEFAULT_MODEL)
    name, path = config.model_name_or_path, Path(config.model_name_or_path).expanduser()
    if path.suffix.lower() == GGUF_SUFFIX and not path.is_dir():
        if not path.is_file():
            raise FileNotFoundError(f"model_name_or_path: the GGUF file {name} does not exist")
        return str(path)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"model_name_or_path: the folder {name} is not a transformers model (it holds no "
                                    "config.json)")
        return str(path)
    if is_local_path(name):
        raise FileNotFoundError(f"model_name_or_path: {name} does not exist (a local path, so the hub was not asked)")
    return name


def pretrained_source(path: str) -> tuple[str, dict]:
    """What transformers' from_pretrained reads `path` (model_path's) from: (the folder or hub id, extra keywords).
    A GGUF file is its folder with gguf_file=its name."""
    if Path(path).suffix.lower() != GGUF_SUFFIX or not Path(path).is_file():
        return path, {}
    missing = [name for name in GGUF_PACKAGES if importlib.util.find_spec(name) is None]
    if missing:
        raise ImportError(f"model_name_or_path: {path} is a GGUF file, which transformers reads with gguf and "
                          f"accelerate (missing: {', '.join(missing)}): pip install 'fastgrpo[gguf]'")
    return str(Path(path).parent), {"gguf_file": Path(path).name}


def not_loadable(option: str, name: str, error: Exception, cache: str, offline: bool) -> FileNotFoundError:
    """One line saying what was looked for (`option`'s value) and where (its local folder, or the hub and its cache),
    with the loader's own reason."""
    hub = f"huggingface.co ({'offline mode: not asked' if offline else 'not reachable or no such repository'})"
    where = (f"the folder {name}" if Path(name).is_dir() else f"the file {name}" if Path(name).is_file()
             else f"{hub} and the cache {cache}")
    reason = " ".join(str(error).split())[:300]
    return FileNotFoundError(f"{option}: cannot load {name!r} from {where}: {type(error).__name__}: {reason}")


@contextmanager
def _loading(name: str):
    """transformers' loading errors (several lines, often no name) as one `not_loadable` line."""
    try:
        yield
    except (OSError, ValueError) as e:  # missing files, no network, no such repository; a GGUF file it cannot read
        if isinstance(e, ValueError) and Path(name).suffix.lower() != GGUF_SUFFIX:
            raise
        raise not_loadable("model_name_or_path", name, e, hub_constants.HF_HUB_CACHE,
                           hub_constants.HF_HUB_OFFLINE) from e


def model_config(config: TrainConfig):
    """The model's configuration (its config.json, without loading weights)."""
    path = model_path(config)
    source, gguf = pretrained_source(path)
    with _loading(path):
        return AutoConfig.from_pretrained(source, trust_remote_code=config.trust_remote_code, **gguf)


def max_positions(config: TrainConfig) -> int | None:
    """The model's context window; None when its configuration does not say."""
    return context_window(model_config(config))


GENERIC_TOKENIZER_CLASSES = ("PreTrainedTokenizerFast", "TokenizersBackend")


def load_tokenizer(config: TrainConfig):
    """The policy's tokenizer (tokenizer_from), with the EOS token as padding when it has none and the chat template
    of chat_template_path when one is given."""
    path = model_path(config)
    with _loading(path):
        tokenizer = tokenizer_from(path, config.trust_remote_code)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    if config.chat_template_path is not None:
        template = Path(config.chat_template_path).expanduser()
        if not template.is_file():
            raise FileNotFoundError(f"chat_template_path: {template} is not a file (a Jinja chat template)")
        tokenizer.chat_template = read_utf8(template, "chat_template_path")
    return tokenizer


def tokenizer_from(path: str, trust_remote_code: bool = False):
    """AutoTokenizer; except that a local folder whose tokenizer_config.json declares the generic fast class gets
    exactly its tokenizer.json (transformers 5's AutoTokenizer would rebuild it as the model type's tokenizer, e.g.
    a Qwen2 byte-level BPE, which drops the characters of a small word-level vocabulary). A GGUF file's tokenizer is
    the one it holds."""
    source, gguf = pretrained_source(path)
    declared = Path(path) / "tokenizer_config.json"
    if declared.is_file() and json.loads(declared.read_text()).get("tokenizer_class") in GENERIC_TOKENIZER_CLASSES:
        return PreTrainedTokenizerFast.from_pretrained(path)
    return AutoTokenizer.from_pretrained(source, trust_remote_code=trust_remote_code, **gguf)


# The probe's logits span [-R, R], R = max(PROBE_SPAN, 4 * softcap): there a softcap bends them by ~75%, a logit scale
# by |scale - 1|, both far past bf16's rounding (0.4% per operation); an ambiguous match keeps the config's transform.
PROBE_SPAN = 64.0
PROBE_TOLERANCE = 2**-5
PLAIN_HEAD = {"logit_scale": 1.0, "logit_softcap": None}


def check_head(model: PreTrainedModel) -> dict:
    """The logit transform {logit_scale, logit_softcap} that fastgrpo's head must apply to score what `model` samples.

    fastgrpo.loss.head_transform reads it from the config, and refuses the options the loss cannot apply. The sampler
    runs the model's own forward, so an option honoured must be one that forward applies: the forward is probed with
    the lm_head's output replaced by known logits. A config option the forward ignores (a Qwen2 config.json carrying
    final_logit_softcapping: Qwen2's forward has no cap) is not honoured; a forward that transforms the logits
    otherwise than its config says is refused.
    """
    name = type(model).__name__
    if model.get_output_embeddings() is None:
        raise ValueError(f"model_name_or_path: {name} has no lm_head (output embeddings)")
    try:
        head = head_transform(model.config)
    except ValueError as error:
        raise ValueError(f"model_name_or_path: {name} sets {error}") from None
    logits, returned = _probe_logits(model, max(PROBE_SPAN, 4 * (head["logit_softcap"] or 0.0)))  # [V], [V]
    for candidate in (head, PLAIN_HEAD):
        expected = logits * candidate["logit_scale"]
        if candidate["logit_softcap"] is not None:
            expected = torch.tanh(expected / candidate["logit_softcap"]) * candidate["logit_softcap"]
        if torch.allclose(returned, expected, rtol=PROBE_TOLERANCE, atol=PROBE_TOLERANCE):
            return candidate
    raise ValueError(f"model_name_or_path: {name}'s forward transforms the logits of its lm_head otherwise than its "
                     f"config says ({head}), which fastgrpo's fused loss cannot reproduce")


@torch.no_grad()
def _probe_logits(model: PreTrainedModel, span: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(known logits [V] put out by the lm_head, what the model's forward returns for them [V]), fp32. The backbone
    is stubbed out (its output is what the head reads, as in completion_hidden): no layer runs, so the probe costs
    nothing and needs none of the layers' kernels (Liger's need CUDA). The stub returns the output class the
    backbone's forward declares, holding the hidden state alone, so a forward that reads more of it (an MoE's
    router_logits) gets None there, as from a backbone asked for nothing else."""
    backbone = getattr(model, model.base_model_prefix)
    head = model.get_output_embeddings()
    hidden = head.weight.new_zeros(1, 1, head.weight.shape[1])  # [1, 1, H]
    known = []

    def replace(module, args, output):  # [1, 1, V]
        known.append(torch.linspace(-span, span, output.shape[-1], device=output.device).to(output.dtype))
        return known[-1].expand_as(output)

    output = _output_type(backbone)(last_hidden_state=hidden)  # its other fields None (no router logits, no cache)
    own_forward = backbone.__dict__.get("forward")
    backbone.forward = lambda *args, **kwargs: output
    hook = head.register_forward_hook(replace)
    try:
        returned = model(input_ids=torch.zeros(1, 1, dtype=torch.long, device=hidden.device), use_cache=False).logits
    finally:
        hook.remove()
        if own_forward is None:
            del backbone.forward
        else:
            backbone.forward = own_forward
    if not known:
        raise ValueError(f"model_name_or_path: {type(model).__name__}'s forward does not call its lm_head module, so "
                         "fastgrpo cannot check that its fused head computes the model's logits")
    return known[-1].float(), returned[0, -1].float()


def _output_type(backbone: torch.nn.Module) -> type[ModelOutput]:
    """The ModelOutput class the backbone's forward declares it returns (MoE backbones: MoeModelOutputWithPast, whose
    router_logits their CausalLM's forward reads; Gemma 4's: its own, with shared_kv_states), BaseModelOutputWithPast
    where the signature declares none; as a subclass whose fields it does not have read None (Nemotron-H's backbone
    declares BaseModelOutputWithPast and returns MoeModelOutputWithPast, whose router_logits its CausalLM reads)."""
    declared = inspect.signature(type(backbone).forward).return_annotation
    if not (isinstance(declared, type) and issubclass(declared, ModelOutput)):
        declared = BaseModelOutputWithPast
    if declared not in _LENIENT_OUTPUTS:
        _LENIENT_OUTPUTS[declared] = dataclasses.dataclass(type(declared.__name__, (declared,), {
            "__getattr__": _no_such_field, "__module__": __name__}))
    return _LENIENT_OUTPUTS[declared]


_LENIENT_OUTPUTS: dict[type, type] = {}


def _no_such_field(self, name: str):
    if name.startswith("_"):
        raise AttributeError(name)
    return None


# Liger's layer kernels only: the head and the loss are fastgrpo's.
LIGER_KERNELS = {"rope": True, "rms_norm": True, "swiglu": True, "cross_entropy": False,
                 "fused_linear_cross_entropy": False}


def _liger_loader():
    """liger-kernel's public `AutoLigerKernelForCausalLM`: it swaps the model type's layers for Liger's (process-wide,
    so a reference model gets them too) before loading the weights."""
    try:
        from liger_kernel.transformers import AutoLigerKernelForCausalLM
    except ImportError as e:
        raise ImportError("use_liger_kernel needs liger-kernel: pip install liger-kernel") from e
    return AutoLigerKernelForCausalLM


def _from_pretrained(path: str, config: TrainConfig, dtype: torch.dtype, device: torch.device,
                     quantize: bool = False) -> PreTrainedModel:
    source, gguf = pretrained_source(path)
    kwargs = {"dtype": dtype, "trust_remote_code": config.trust_remote_code, **gguf}
    if config.attn_implementation is not None:
        kwargs["attn_implementation"] = config.attn_implementation
    if gguf:
        if quantize:
            raise ValueError(f"load_in_4bit: {path} is a GGUF file, which transformers loads dequantized and cannot "
                             "quantize again; train it with LoRA in the training dtype (without --load-in-4bit)")
        kwargs.update(_dense_gguf())
    if quantize:  # the weights are quantized as they are placed on the device
        bitsandbytes("load_in_4bit")
        kwargs.update(quantization_config=four_bit(dtype), device_map={"": device})
    loader = _liger_loader() if config.use_liger_kernel else AutoModelForCausalLM
    with _loading(path):
        model = loader.from_pretrained(source, **kwargs, **(LIGER_KERNELS if config.use_liger_kernel else {}))
    if quantize:
        head = model.get_output_embeddings()
        if type(head) is not torch.nn.Linear or head.weight.dtype != dtype:
            raise ValueError(f"load_in_4bit: the output head of {path} was quantized ({type(head).__name__}); "
                             "fastgrpo's loss reads its weight in the training dtype")
        keep_trainable(model)
    else:
        model = model.to(device)
    if config.use_liger_kernel and not any(type(m).__module__.startswith("liger_kernel") for m in model.modules()):
        raise ValueError(f"use_liger_kernel: liger-kernel has no kernels for {model.config.model_type!r} models")
    if config.mask_free_attention:
        use_mask_free_sdpa(model)
    check_head(model)
    return model


def _dense_gguf() -> dict:
    """GgufConfig(dequantize=True) where transformers has it (5.24 does): without it, transformers keeps a GGUF's
    weights in their quantized blocks where it has a matmul kernel for them (frozen), and even with every weight
    unpacked marks the model quantized, which save_pretrained refuses. fastgrpo trains the weights and saves them as
    an ordinary folder. Older versions, without GgufConfig, always unpack the weights."""
    try:
        from transformers import GgufConfig
    except ImportError:
        return {}
    return {"quantization_config": GgufConfig(dequantize=True)}


def load_policy(config: TrainConfig, device: torch.device, checkpoint: Path | None = None) -> torch.nn.Module:
    """The trainable policy: the model's initial weights, or a checkpoint's (its LoRA adapter with use_peft)."""
    dtype = train_dtype(config, device.type)
    path = str(checkpoint) if checkpoint is not None and not config.use_peft else model_path(config)
    model = _from_pretrained(path, config, dtype, device, quantize=config.load_in_4bit)
    router_aux_loss_coef(config.router_aux_loss_coef, model)  # its check, before LoRA
    if config.gradient_checkpointing:
        # Newer transformers renamed gradient_checkpointing_enable (kept, deprecated); >= 4.56 is supported.
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if config.offload_activations:
            from fastgrpo.train.offload import ActivationOffload

            ActivationOffload(device).install(model)
    model.config.use_cache = False
    if config.use_peft:
        try:
            from peft import PeftModel
        except ImportError as e:
            raise ImportError("use_peft needs peft: pip install peft") from e
        if checkpoint is not None:
            model = PeftModel.from_pretrained(model, str(checkpoint), is_trainable=True)
        else:
            model = add_adapters(config, model)
    apply_layer_memory_options(model, config.mlp_tile_tokens, config.use_peft and config.recompute_lora_inputs,
                               config.recompute_norms)
    return model


def load_reference(config: TrainConfig, device: torch.device) -> PreTrainedModel | None:
    """A frozen copy of the initial policy; None when beta = 0 (no KL) or with LoRA (the base, adapters off)."""
    if config.beta == 0 or config.use_peft:
        return None
    model = _from_pretrained(model_path(config), config, train_dtype(config, device.type), device)
    return model.eval().requires_grad_(False)
