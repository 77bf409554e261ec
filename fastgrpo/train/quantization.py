"""bitsandbytes, imported only when an option needs it: NF4 bases (load_in_4bit) and 8-bit AdamW (optim adamw_8bit)."""

import torch

BITSANDBYTES_MIN = "0.50"  # NF4 layers and 8-bit optimizers on a CPU too


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
