"""The Trainer's evaluation (`Evaluation`): pass@1 on the held-out prompts, sampled at eval_temperature with the
engine (and tools) as training samples, scored by the accuracy reward against each row's answer."""

from fastgrpo.train.rewards import accuracy, completion_text
from fastgrpo.train.rounds import seed_for


class Evaluation:
    """(it reads the trainer's config, world, eval_prompts and its Rounds' _sample and _sampling_params)"""

    def evaluate(self) -> float | None:
        """pass@1 on the held-out subset: share of prompts whose one completion the accuracy reward scores 1."""
        if self.eval_prompts is None:
            return None
        config = self.config
        params = self._sampling_params(seed_for("eval", config.seed), evaluation=True)
        data = self.eval_prompts
        with self.world.together("evaluation"):
            n = config.num_generations_eval or 1
            sampled = self._sample(data, list(range(len(data.rows))), n, params)
            correct = 0.0
            if sampled is not None:
                share = self.world.share(len(data.rows))
                answers = [data.rows[i][data.answer_column] for i in share for _ in range(n)]
                texts = [completion_text(c) for c in sampled.completions]  # with tools: the last assistant turn
                correct = sum(accuracy(sampled.prompts, texts, answers))
        return sum(self.world.gather(correct)) / (len(self.eval_prompts.rows) * n)
