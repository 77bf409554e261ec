"""Integrations with other trainers. Each lives in its own module and imports its trainer library only when imported:

    from fastgrpo.integrations.trl import FastGRPOTrainer   # trl.GRPOTrainer with fastgrpo's logprobs and loss
"""
