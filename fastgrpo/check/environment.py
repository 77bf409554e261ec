"""What `fastgrpo check` runs on: the device, the library versions, and which paths the loss and the engine take here
and why."""

import importlib.metadata
import os
import platform
import shutil
import subprocess

import torch

# Distribution names, in the report's order; None where one is not installed.
PACKAGES = ("torch", "triton", "transformers", "peft", "bitsandbytes", "flash-attn", "flash-linear-attention",
            "accelerate", "trl", "liger-kernel", "fastgrpo")


def versions() -> dict[str, str | None]:
    found = {}
    for name in PACKAGES:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = None
    return found


def driver_version() -> str | None:
    """The NVIDIA driver's version from nvidia-smi (None without one)."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None


def describe(device: torch.device) -> dict:
    """The device and versions, as the results file records them."""
    from fastgrpo import bench

    env = {**bench.environment(device), "python": platform.python_version()}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(capability=f"{props.major}.{props.minor}", memory_gib=round(props.total_memory / 2**30, 1),
                   multiprocessors=props.multi_processor_count, cuda=torch.version.cuda, driver=driver_version())
    else:
        env.update(cpu_threads=torch.get_num_threads())
    env["fp32_matmul_precision"] = torch.get_float32_matmul_precision()  # "highest": no TF32 in fp32 GEMMs
    env["triton_interpreter"] = os.environ.get("TRITON_INTERPRET") == "1"
    env["packages"] = versions()
    return env


# (package, below this version, what is missing) for the versions a GPU image may have: each a line of the report.
VERSION_NOTES = (
    ("transformers", "5.24", "the engine refuses hybrid models (Qwen3.5, Qwen3-Next, Nemotron-H, Granite-4.0-H, "
                             "LFM2): their state modules use an older cache interface"),
    ("transformers", "5.18", "GGUF files with an end-of-sequence token but no beginning-of-sequence one fail to load "
                             "(transformers' ggml.py)"),
    ("triton", "3.7", "Triton's interpreter (TRITON_INTERPRET=1, the CPU tests) needs numpy < 2.4"),
)


def version_notes(found: dict[str, str | None]) -> list[str]:
    from packaging.version import Version

    return [f"{package} {found[package]} < {version}: {what}" for package, version, what in VERSION_NOTES
            if found.get(package) and Version(found[package]) < Version(version)]


def fp8_pages(device: torch.device) -> bool:
    """Whether the Triton kernels can read and write e4m3 KV pages here (CUDA compute capability 8.9+: Ada, Hopper,
    Blackwell)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def choices(device: torch.device, dtype: torch.dtype) -> list[tuple[str, str]]:
    """(what, which and why) of the paths the loss and the engine take on this device for a Llama/Qwen model in
    `dtype`: the rules of fastgrpo.loss.resolve_backend, chunked.head_plan and Engine._resolve_backend, read back from
    them (an Engine is built on a tiny model to ask it)."""
    from fastgrpo.loss import resolve_backend

    cuda = device.type == "cuda"
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    backend = resolve_backend()
    chosen = os.environ.get("FASTGRPO_BACKEND", "auto")
    rows = "Triton row kernels (kernels/logit_rows.py)" if cuda else "PyTorch row passes (a CPU)"
    gemms = "cuBLAS" if cuda else "torch"
    loss = (f"{backend} (FASTGRPO_BACKEND={chosen}): chunks of fp32 logits by {gemms} GEMMs, {rows}" if backend ==
            "chunked" else f"{backend} (FASTGRPO_BACKEND={chosen}): full logits, the yardstick, not the fast path")
    engine = engine_choices(device, dtype)
    attention = engine["backend"]
    if not cuda:
        why = "on a CPU `auto` picks torch" + ("; the check forces triton under the interpreter" if interpreted else "")
    elif attention == "flash":
        why = "flash-attn is installed, the weights are bf16/fp16 and block_size is a multiple of 256"
    else:
        why = ("flash-attn " + ("needs block_size a multiple of 256 (the default is 16)" if _flash_installed()
                                else "is not installed") + "; triton computes every attention variant")
    graphs = ("on (CUDA, triton/flash; off for recurrent hybrids and while recording MoE routes)" if cuda
              else "off (CUDA only)")
    fp8 = ("available (compute capability >= 8.9)" if fp8_pages(device) else
           "unavailable with the Triton kernels (needs compute capability 8.9+); the torch path reads fp8 pages" if cuda
           else "torch path only on a CPU")
    return [("loss", loss), ("engine attention", f"{attention} ({why})"),
            ("engine layers", f"{engine['layers']} for Llama/Qwen2/Qwen3; other families: transformers' modules with "
                              "the paged attention function"),
            ("engine sampler", "fused Triton sampler (top-p runs the PyTorch one)" if engine["fused"] else
             "PyTorch sampler"),
            ("CUDA graphs", graphs), ("fp8 KV pages", fp8)]


def _flash_installed() -> bool:
    from fastgrpo.sampling.engine import _flash_attn_installed

    return _flash_attn_installed()


def engine_choices(device: torch.device, dtype: torch.dtype) -> dict:
    """The Engine's own picks for a tiny Qwen2 model in `dtype` on `device` (attention "auto")."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from fastgrpo.sampling import Engine

    config = Qwen2Config(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    with torch.device(device):
        model = Qwen2ForCausalLM(config).to(dtype)
    engine = Engine(model)
    return {"backend": engine.backend, "layers": engine.layers, "fused": engine.fused_kernels}
