"""The GRPO loop of `fastgrpo train`.

Each step is one generation round:
  1. sample    P prompts x G completions from the policy with the paged engine (the policy's own weights)
  2. score     weighted rule rewards -> advantages per group (TRL's scale_rewards; flat groups get 0)
  3. no-grad   reference logprobs (beta > 0; with LoRA the base with adapters off) and old logprobs (when updates
               go off-policy: num_iterations > 1 or several optimizer steps per round, or with
               importance_sampling_correction), fused logprob path; then TRL's truncated IS weights of old against
               the sampler's logprobs (importance_sampling_correction)
  4. update    num_iterations passes; each optimizer step accumulates micro-batches: backbone forward (gradient
               checkpointing; packed when the attention is varlen, else length-bucketed padding) -> completion
               hidden states -> fastgrpo.loss.fused_grpo_loss -> backward; then clip, AdamW, LR schedule
  5. log, evaluate (pass@1 on held-out prompts), checkpoint

Loss normalisation across micro-batches follows TRL 1.16: the per-micro-batch loss is divided by
gradient_accumulation_steps, except dapo/cispo, which divide by the loss tokens of an average optimizer step. The
entropy bonus (entropy_coef) is each micro-batch's mean token entropy divided by gradient_accumulation_steps, for every
loss type. The head scores logits as the model's forward makes them (its logit scale or softcap, model.check_head).
"""

import dataclasses
import datetime
import gc
import math
import time
import zlib
from collections import defaultdict
from pathlib import Path

import torch
from transformers import get_scheduler

from fastgrpo.loss import fused_grpo_loss, token_logprobs
from fastgrpo.loss_config import TOKEN_NORMALISED_LOSS_TYPES, LossConfig
from fastgrpo.memory import peak_memory, reset_peak_memory
from fastgrpo.models import find_hf_model, stop_token_ids
from fastgrpo.sampling import Engine, SamplingParams
from fastgrpo.train import checkpoint, run_dir
from fastgrpo.train.config import TrainConfig
from fastgrpo.train.data import PromptOrder, eval_subset, load_rows, prepare
from fastgrpo.train.logs import (
    PLOT_FILE,
    MetricsLog,
    Progress,
    Timer,
    length_metrics,
    nanmean,
    plot,
    reward_metrics,
    summary_line,
)
from fastgrpo.train.model import (
    PACKED_ATTENTION,
    check_head,
    completion_hidden,
    lm_head,
    load_policy,
    load_reference,
    load_tokenizer,
)
from fastgrpo.train.rewards import Rewards, accuracy
from fastgrpo.train.rollout import Rollout, group_advantages, micro_batch, micro_batches, sampler_importance_weights
from fastgrpo.train.run_dir import RunDir

RESERVED_REWARD_ARGS = ("prompts", "completions", "completion_ids")


def seed_for(*key) -> int:
    """A 32-bit seed that depends on `key` only (its repr), the same in every process and run."""
    return zlib.crc32(repr(key).encode())


def loss_config(config: TrainConfig, head: dict) -> LossConfig:
    """The loss options with the model's logit transform `head`. TRL's entropy bonus is a micro-batch mean divided by
    gradient_accumulation_steps, never by the loss type's normaliser; dapo / cispo losses are not divided by
    gradient_accumulation_steps (their num_items_in_batch spans the optimizer step), so their coefficient is."""
    options = dataclasses.replace(config.loss_config(), **head)
    if config.loss_type in TOKEN_NORMALISED_LOSS_TYPES:
        options = dataclasses.replace(options, entropy_coef=config.entropy_coef / config.gradient_accumulation_steps)
    return options


def _output_dir(config: TrainConfig) -> Path:
    if config.output_dir is not None:
        return Path(config.output_dir)
    return Path("runs") / datetime.datetime.now().strftime("%Y%m%d-%H%M%S")


class Trainer:
    def __init__(self, config: TrainConfig, device: str | torch.device | None = None):
        self.config = config
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.output_dir = _output_dir(config)
        self.folder = RunDir(self.output_dir)
        resume_from, replaced = self._claim_output_dir()
        try:
            self._load(resume_from)
            run_dir.delete(replaced)  # the old run goes only now that the new one has its model and data
            self.log = MetricsLog(self.output_dir, config.report_to, config.to_dict(),
                                  self.step if resume_from is not None else None)
            config.save_yaml(self.output_dir / "config.yaml")
        except BaseException:
            self.folder.release(remove_new=True)
            raise

    def _claim_output_dir(self) -> tuple[Path | None, list[Path]]:
        """Checks the output folder before anything loads, then locks it. Until every check passes the folder is
        only read, so a refused run changes nothing. Returns the checkpoint to resume from and what
        overwrite_output_dir replaces."""
        out, config = self.output_dir, self.config
        run_dir.check_writable(out)
        run_dir.check_free(out)
        resume_from, replaced = None, []
        if config.resume:
            resume_from, step = checkpoint.resume_point(out)
            if config.max_steps <= step:
                raise ValueError(f"resume: max_steps {config.max_steps} is not past the step of {resume_from} "
                                 f"({step}); pass --max-steps greater than {step} to train on")
        elif run_dir.contents(out):
            if not config.overwrite_output_dir:
                raise FileExistsError(f"output_dir {out} already holds files; pass resume to continue that run or "
                                      "overwrite_output_dir to replace it")
            replaced = run_dir.replaceable(out)
        self.folder.lock()
        return resume_from, replaced

    def _load(self, resume_from: Path | None) -> None:
        """Tokenizer, prompts, rewards, policy (a checkpoint's weights on resume), reference, engine, optimizer and
        schedule, and on resume the optimizer, schedule, RNG and data position."""
        config = self.config
        torch.manual_seed(config.seed)  # LoRA's initial weights
        self.tokenizer = load_tokenizer(config)
        self.train_prompts = prepare(load_rows(config, "train"), self.tokenizer, config, "train")
        eval_rows = load_rows(config, "test") if config.answer_column is not None else None
        self.eval_prompts = None if eval_rows is None else eval_subset(
            prepare(eval_rows, self.tokenizer, config, "held-out"), config.eval_num_samples)
        self.rewards = Rewards(config.reward_funcs, config.reward_weights, config.max_completion_length)

        self.model = load_policy(config, self.device, resume_from)
        self.ref_model = load_reference(config, self.device)
        self.packed = find_hf_model(self.model).config._attn_implementation in PACKED_ATTENTION
        self.engine = Engine(self.model, tokenizer=self.tokenizer, block_size=config.block_size,
                             memory_fraction=config.sampling_memory_fraction)
        self.stop_token_ids = stop_token_ids(self.model, self.tokenizer)
        self.head = check_head(find_hf_model(self.model))  # {logit_scale, logit_softcap}
        self.loss_config = loss_config(config, self.head)

        self.parameters = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.parameters, lr=config.learning_rate, weight_decay=config.weight_decay,
                                           betas=(config.adam_beta1, config.adam_beta2))
        self.optimizer_steps_per_round = config.num_iterations * config.steps_per_generation // (
            config.gradient_accumulation_steps)
        total = config.max_steps * self.optimizer_steps_per_round
        self.scheduler = get_scheduler(config.lr_scheduler_type, self.optimizer,
                                       num_warmup_steps=math.ceil(config.warmup_ratio * total),
                                       num_training_steps=total)

        self.order = PromptOrder(len(self.train_prompts.rows), config.seed)
        self.step, self.num_tokens, self.seconds, self.initial_accuracy = 0, 0, 0.0, None
        if resume_from is not None:
            state = checkpoint.load_state(resume_from, self.optimizer, self.scheduler)
            self.step, self.num_tokens, self.seconds = state["step"], state["num_tokens"], state["seconds"]
            self.initial_accuracy = state["initial_accuracy"]
            self.order.load_state_dict(state["data"])

    def _seed(self, *key) -> int:
        """A seed per (run seed, step, purpose): sampling and shuffles do not depend on what ran before."""
        return seed_for(self.config.seed, self.step, *key)

    # -- the loop --

    def train(self) -> dict:
        """Trains to max_steps; the output folder's lock is released when this returns or raises."""
        try:
            return self._train()
        finally:
            self.folder.release()

    def _train(self) -> dict:
        config = self.config
        # The model, data and libraries loaded so far live for the whole run: moved out of the collector's reach, a
        # full collection (triggered by the lists each sampling call returns) no longer re-scans them (~0.3 s with
        # transformers loaded on a slow CPU).
        gc.freeze()
        if self.step == 0:
            self.initial_accuracy = self.evaluate()
            self.log.log(0, {"eval/accuracy": self.initial_accuracy})
        final_accuracy = self.initial_accuracy
        with Progress(config, self.step) as progress:
            while self.step < config.max_steps:
                self.step += 1
                start = time.perf_counter()
                metrics = self.train_step()
                if self.step == config.max_steps or (config.eval_steps and self.step % config.eval_steps == 0):
                    metrics["eval/accuracy"] = final_accuracy = self.evaluate()
                self.seconds += time.perf_counter() - start
                metrics["time/elapsed"] = self.seconds
                self.log.log(self.step, metrics)
                if self.step == config.max_steps or (config.save_steps and self.step % config.save_steps == 0):
                    self.save()
                progress.update(self.step, metrics)
        if self.log.history and self.log.history[-1].get("eval/accuracy") is not None:
            final_accuracy = self.log.history[-1]["eval/accuracy"]
        self.log.close()
        plot_path = plot(self.log.history, self.output_dir / PLOT_FILE)
        summary = {"initial_accuracy": self.initial_accuracy, "final_accuracy": final_accuracy, "steps": self.step,
                   "seconds": self.seconds, "output_dir": str(self.output_dir), "plot": str(plot_path),
                   "eval_prompts": 0 if self.eval_prompts is None else len(self.eval_prompts.rows)}
        print(summary_line(summary, config))
        return summary

    def train_step(self) -> dict:
        config, G = self.config, self.config.num_generations
        reset_peak_memory(self.device)
        timer = Timer()

        # 1. sample
        picked = self.order.next(config.prompts_per_step)
        params = SamplingParams(temperature=config.temperature, top_p=config.top_p, top_k=config.top_k,
                                max_new_tokens=config.max_completion_length, stop_token_ids=self.stop_token_ids,
                                seed=self._seed("sample"))
        outputs = self.engine.generate([self.train_prompts.token_ids[i] for i in picked], n=G, params=params)
        completions = [c for group in outputs for c in group]  # [P*G], prompt-major
        timer.lap("sampling")

        # 2. score
        samples = [i for i in picked for _ in range(G)]  # [P*G] prompt index per completion
        completion_ids = [c.token_ids for c in completions]
        texts = self.tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
        columns = {k: [self.train_prompts.rows[i][k] for i in samples] for k in self.train_prompts.rows[0]
                   if k not in RESERVED_REWARD_ARGS and k != config.prompt_column}
        per_func, rewards = self.rewards([self.train_prompts.texts[i] for i in samples], texts, completion_ids,
                                         columns)
        advantages, std, flat = group_advantages(rewards, G, config.scale_rewards)
        truncated = torch.tensor([c.finish_reason == "length" for c in completions])
        drop = config.mask_truncated_completions
        cut = truncated.tolist()
        rollout = Rollout(
            prompt_ids=[self.train_prompts.token_ids[i] for i in samples], completion_ids=completion_ids,
            truncated=truncated, advantages=advantages,
            loss_mask=[[0 if drop and cut[i] else 1] * len(ids) for i, ids in enumerate(completion_ids)],
        )  # fmt: skip
        timer.lap("rewards")

        # 3. no-grad logprobs
        if config.beta != 0:
            rollout.ref_logps = self._reference_logprobs(rollout)
        correct = config.importance_sampling_correction
        if correct or config.num_iterations > 1 or config.steps_per_generation > config.gradient_accumulation_steps:
            rollout.old_logps = self._logprobs(self.model, rollout)
        sampling_metrics = {}
        if correct:
            rollout.sampling_logps = [torch.tensor(c.logprobs, dtype=torch.float32) for c in completions]
            rollout.importance_weights, sampling_metrics = sampler_importance_weights(
                rollout, config.importance_sampling_mode, config.importance_sampling_clip_min,
                config.importance_sampling_clip_max)
        timer.lap("reference")

        # 4. update
        stats = self._update(rollout)
        timer.lap("train")

        lengths = torch.tensor([len(ids) for ids in completion_ids], dtype=torch.float32)
        self.num_tokens += int(lengths.sum()) + sum(len(p) for p in rollout.prompt_ids)
        return {
            **stats,
            **reward_metrics(self.rewards, per_func, rewards, std, flat),
            **length_metrics(lengths, truncated),
            **sampling_metrics,
            "num_tokens": self.num_tokens,
            "learning_rate": self.scheduler.get_last_lr()[0],
            "sampling/preemptions": self.engine.stats.num_preemptions,
            **timer.metrics(),
            "tokens_per_second": float(lengths.sum()) / timer.total,
            "peak_memory_gib": peak_memory(self.device) / 2**30,
        }

    def _update(self, rollout: Rollout) -> dict:
        config = self.config
        self.model.train()
        weight, bias = lm_head(self.model)
        lengths = [len(p) + len(c) for p, c in zip(rollout.prompt_ids, rollout.completion_ids, strict=True)]
        # TRL's dapo/cispo normaliser: the loss tokens of the round, spread over its optimizer steps.
        num_items = sum(map(sum, rollout.loss_mask)) * config.gradient_accumulation_steps / config.steps_per_generation
        metrics, losses, grad_norms = defaultdict(list), [], []
        for iteration in range(config.num_iterations):
            shuffle = torch.Generator().manual_seed(self._seed("shuffle", iteration))
            for step_batches in micro_batches(lengths, config.per_device_train_batch_size,
                                              config.gradient_accumulation_steps, shuffle):
                step_loss = 0.0
                for index in step_batches:
                    mb = micro_batch(rollout, index, self.device)
                    hidden = completion_hidden(self.model, mb.sequences, mb.prompt_lengths, mb.mask.shape[1],
                                               self.packed)  # [b, T, H]
                    loss, micro_metrics = fused_grpo_loss(
                        hidden, weight, mb.completion_ids, mb.mask, mb.advantages, bias=bias, old_logps=mb.old_logps,
                        ref_logps=mb.ref_logps, config=self.loss_config, importance_weights=mb.importance_weights,
                        num_items_in_batch=num_items if config.loss_type in TOKEN_NORMALISED_LOSS_TYPES else None,
                    )  # fmt: skip
                    if self.loss_config.entropy_coef != 0.0:  # TRL's policy_loss: the loss before the bonus
                        micro_metrics["policy_loss"] = loss + self.loss_config.entropy_coef * micro_metrics["entropy"]
                    if config.loss_type not in TOKEN_NORMALISED_LOSS_TYPES:
                        loss = loss / config.gradient_accumulation_steps
                    loss.backward()
                    step_loss = step_loss + loss.detach()
                    for key, value in micro_metrics.items():
                        metrics[key].append(value.detach())
                max_norm = config.max_grad_norm if config.max_grad_norm > 0 else math.inf
                grad_norms.append(torch.nn.utils.clip_grad_norm_(self.parameters, max_norm))
                self.optimizer.step()
                self.scheduler.step()
                self.optimizer.zero_grad(set_to_none=True)
                losses.append(step_loss)
        # One device sync for all the metrics of the round.
        metrics = {"loss": losses, "grad_norm": grad_norms, **metrics}
        return {key: nanmean(torch.stack(values).tolist()) for key, values in metrics.items()}

    @torch.no_grad()
    def _logprobs(self, model: torch.nn.Module, rollout: Rollout) -> list[torch.Tensor]:
        """Per sample [T_i] fp32 logprobs of its completion under `model` (eval mode, no grad)."""
        was_training = model.training
        model.eval()
        weight, bias = lm_head(model)
        out = []
        size = self.config.per_device_train_batch_size
        for start in range(0, len(rollout), size):
            mb = micro_batch(rollout, list(range(start, min(start + size, len(rollout)))), self.device)
            hidden = completion_hidden(model, mb.sequences, mb.prompt_lengths, mb.mask.shape[1], self.packed)
            logps, _ = token_logprobs(hidden, weight, mb.completion_ids, bias=bias,
                                      temperature=self.config.temperature, **self.head)  # [b, T]
            out += [row[: len(rollout.completion_ids[i])].float().cpu() for row, i in zip(logps, mb.index, strict=True)]
        model.train(was_training)
        return out

    def _reference_logprobs(self, rollout: Rollout) -> list[torch.Tensor]:
        if self.ref_model is not None:
            return self._logprobs(self.ref_model, rollout)
        with self.model.disable_adapter():  # LoRA: the base model is the reference
            return self._logprobs(self.model, rollout)

    def evaluate(self) -> float | None:
        """pass@1 on the held-out subset: share of prompts whose one completion the accuracy reward scores 1."""
        if self.eval_prompts is None:
            return None
        config = self.config
        params = SamplingParams(temperature=config.eval_temperature, top_p=config.top_p, top_k=config.top_k,
                                max_new_tokens=config.max_completion_length, stop_token_ids=self.stop_token_ids,
                                seed=seed_for("eval", config.seed))
        outputs = self.engine.generate(self.eval_prompts.token_ids, n=1, params=params)
        texts = self.tokenizer.batch_decode([group[0].token_ids for group in outputs], skip_special_tokens=True)
        answers = [row[config.answer_column] for row in self.eval_prompts.rows]
        return sum(accuracy(self.eval_prompts.texts, texts, answers)) / len(texts)

    def save(self) -> Path:
        state = {"num_tokens": self.num_tokens, "seconds": self.seconds, "initial_accuracy": self.initial_accuracy,
                 "data": self.order.state_dict()}
        return checkpoint.save(self.output_dir, self.step, self.model, self.tokenizer, self.optimizer,
                               self.scheduler, state, self.config.save_total_limit)
