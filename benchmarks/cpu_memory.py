"""Peak host memory of the loss, chunked path vs the full-logits reference (CPU, Linux). Same as
`python -m fastgrpo.bench.cpu_memory`.

    python benchmarks/cpu_memory.py --tokens 8192 --hidden 256 --vocab 65536
"""

from fastgrpo.bench.cpu_memory import main

if __name__ == "__main__":
    main()
