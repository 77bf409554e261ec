"""GRPO loss benchmark: fastgrpo vs the reference, TRL, Liger and the bare matmuls. Same as `fastgrpo bench loss`.

    python benchmarks/loss.py --quick                                    # CPU, well under 2 minutes
    python benchmarks/loss.py --heads qwen2.5-7b --tokens 8192 32768     # on a GPU: bf16, beta 0 and 0.04
"""

from fastgrpo.bench.loss import main

if __name__ == "__main__":
    main()
