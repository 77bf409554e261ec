"""Memory sizes: the binary units, and sizes as users write them ('24GiB', '80GB', '16000MiB')."""

import math

MiB = 2**20
GiB = 2**30
UNITS = {"": GiB, "g": GiB, "gb": 10**9, "gib": GiB, "m": MiB, "mb": 10**6, "mib": MiB, "t": 2**40, "tb": 10**12,
         "tib": 2**40}


def parse_size(text: str, option: str = "gpu_memory") -> int:
    """'24GiB', '24GB', '24' (GiB), '80 GiB', '16000MiB' -> bytes; a ValueError naming `option` otherwise."""
    stripped = text.strip().lower().replace(" ", "")
    number = stripped.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = stripped[len(number):]
    try:
        value = float(number)
    except ValueError:
        value = math.nan
    if unit not in UNITS or not value > 0 or math.isinf(value):
        raise ValueError(f"{option}: {text!r} is not a memory size such as 24GiB, 80GB or 16000MiB")
    return int(value * UNITS[unit])
