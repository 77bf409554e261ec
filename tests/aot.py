"""Ahead-of-time builds of the Triton kernels for real GPUs, on a machine without one.

`triton.compile(ASTSource(...), target=GPUTarget("cuda", cc, 32))` lowers a kernel to PTX and a cubin for the given
compute capability; `ptxas-blackwell -v` (shipped in triton's wheel, it reads the newest PTX versions) reports
registers, shared memory and spills of the PTX.
"""

import os
import re
import subprocess
import tempfile
from dataclasses import dataclass

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

_PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas-blackwell")


@dataclass
class Build:
    ptx: str
    registers: int
    spill_stores: int
    spill_loads: int
    shared_bytes: int
    ptxas_report: str

    def uses_tensor_cores(self, cc: int) -> bool:
        return ("wgmma.mma_async" in self.ptx) if cc >= 90 else ("mma.sync" in self.ptx)


def build(fn, signature: dict, constexprs: dict, cc: int, num_warps: int, num_stages: int) -> Build:
    """Compile `fn` for sm_<cc> and read its resource usage from ptxas."""
    signature = {**signature, **{name: "constexpr" for name in constexprs}}
    compiled = triton.compile(
        ASTSource(fn=fn, signature=signature, constexprs=constexprs),
        target=GPUTarget("cuda", cc, 32),
        options={"num_warps": num_warps, "num_stages": num_stages},
    )
    ptx = compiled.asm["ptx"]
    arch = "sm_90a" if cc == 90 else f"sm_{cc}"
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    try:
        out = subprocess.run([_PTXAS, "-v", f"--gpu-name={arch}", f.name, "-o", os.devnull], capture_output=True,
                             text=True, check=True)
    finally:
        os.unlink(f.name)
    report = out.stdout + out.stderr
    regs = int(re.search(r"Used (\d+) registers", report).group(1))
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report)
    return Build(ptx=ptx, registers=regs, spill_stores=int(spills.group(1)), spill_loads=int(spills.group(2)),
                 shared_bytes=compiled.metadata.shared, ptxas_report=report.strip())
