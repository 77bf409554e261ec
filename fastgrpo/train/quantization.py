"""bitsandbytes, imported only when an option needs it: NF4 bases (load_in_4bit) and 8-bit AdamW (optim adamw_8bit).
peft and transformers' TrainerState (which user reward functions get) import it too, so its start-up notice is
dropped here for every run (quiet_bitsandbytes)."""

import logging

import torch

BITSANDBYTES_MIN = "0.50"  # NF4 layers and 8-bit optimizers on a CPU too
# bitsandbytes 0.50 logs this warning as it is imported, on a CPU with AVX512-BF16 without the `kernels` package (its
# optional faster 4-bit GEMV): a notice for bitsandbytes' developers, which every run that imports peft printed.
_KERNELS_NOTICE = "Failed to load CPU gemm_4bit_forward from kernels-community"


class _DropKernelsNotice(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(_KERNELS_NOTICE)


def quiet_bitsandbytes() -> None:
    """Drops bitsandbytes' _KERNELS_NOTICE (and nothing else it logs), whenever it is imported later."""
    logger = logging.getLogger("bitsandbytes.backends.cpu.ops")  # the logger it writes the notice with
    if not any(isinstance(f, _DropKernelsNotice) for f in logger.filters):
        logger.addFilter(_DropKernelsNotice())


quiet_bitsandbytes()


def bitsandbytes(option: str):
    """The bitsandbytes module, or an ImportError naming the option that needs it."""
    from packaging.version import Version

    try:
        import bitsandbytes as bnb
    except ImportError as e:
        raise ImportError(f"{option} needs bitsandbytes>={BITSANDBYTES_MIN}: pip install 'fastgrpo[quant]' (or "
                          f"bitsandbytes)") from e
    if Version(bnb.__version__) < Version(BITSANDBYTES_MIN):
        raise ImportError(f"{option} needs bitsandbytes>={BITSANDBYTES_MIN}, found {bnb.__version__}: "
                          "pip install -U bitsandbytes")
    return bnb


def four_bit(dtype: torch.dtype):
    """QLoRA's quantization: NF4 blocks of 64 with double quantization (the blocks' fp32 scales themselves 8-bit),
    computing in `dtype`. transformers leaves the output head (and the embeddings, not linear layers) unquantized."""
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                              bnb_4bit_compute_dtype=dtype)


def keep_trainable(model: torch.nn.Module) -> None:
    """Keeps every NF4 layer of `model` on the path it trains through, in eval mode and without grad too.

    On a CPU with AVX512-BF16, bitsandbytes (0.50) `Linear4bit.forward` in eval mode on an input that needs no grad
    (fastgrpo's evaluation and sampling) repacks its weight in place for its bf16 inference kernel, once, and keeps it
    packed: from then on every call, training ones too, goes through `gemv_4bit`, which has no backward (no gradient
    reaches the layers below; with a bias, "a view of a leaf Variable ... in-place operation") and computes in bf16
    with the blocks' scales rounded to bf16. Unpacking (bitsandbytes does on save) re-quantizes those rounded scales:
    the weights do not come back (up to 8e-3 off on a [64, 128] N(0, 1) weight). With the layer's own switch off, every
    call dequantizes and multiplies in the compute dtype, as on any other CPU or a GPU: the policy that samples is the
    one that trains."""
    bnb = bitsandbytes("load_in_4bit")
    for module in model.modules():
        if isinstance(module, bnb.nn.Linear4bit):
            module.support_avx512bf16_for_cpu = False
