"""TRL training-step benchmark: stock trl.GRPOTrainer vs fastgrpo's FastGRPOTrainer. Same as `fastgrpo bench trl`.

    python benchmarks/trl_step.py --quick
    python benchmarks/trl_step.py --threads 1                                  # CPU: tiny model, 8 x 256 tokens
    python benchmarks/trl_step.py --shape qwen2.5-1.5b --completions 8 --completion-len 1024   # on a GPU
"""

from fastgrpo.bench.trl_step import main

if __name__ == "__main__":
    main()
