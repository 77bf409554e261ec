"""Sampling benchmark: fastgrpo's paged engine vs HF generate and generate_batch. Same as `fastgrpo bench sampling`.

    python benchmarks/sampling.py --quick
    python benchmarks/sampling.py --prompts 64 --group-size 8 --prompt-len 256 --max-new-tokens 512   # on a GPU
"""

from fastgrpo.bench.sampling import main

if __name__ == "__main__":
    main()
