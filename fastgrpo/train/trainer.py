"""The GRPO loop of `fastgrpo train`.

Each step is one generation round:
  1. sample    P prompts x G completions from the policy with the paged engine (the policy's own weights)
  2. score     reward functions (TRL's call and None semantics, reward models too) -> weighted sum -> advantages
               per group (TRL's scale_rewards; flat groups and unscorable samples get 0)
  3. no-grad   reference logprobs (beta > 0; with LoRA the base with adapters off) and old logprobs (when updates
               go off-policy: num_iterations > 1 or several optimizer steps per round, or with
               importance_sampling_correction), fastgrpo.loss.token_logprobs without grad (one GEMM and the row
               statistics per chunk); then TRL's truncated IS weights of old against
               the sampler's logprobs (importance_sampling_correction)
  4. update    num_iterations passes; each optimizer step accumulates micro-batches: backbone forward (gradient
               checkpointing; packed when the attention is varlen, else length-bucketed padding) -> completion
               hidden states -> fastgrpo.loss.fused_grpo_loss -> backward; then clip, AdamW, LR schedule
  5. log, evaluate (pass@1 on held-out prompts), checkpoint

The jobs live in their own modules, each a part of the Trainer: rounds.py (1, 2: sampling, tools, rollout_func,
dynamic sampling, scoring), rollout.py (the round's samples and their per-token extras), update.py (3, 4: no-grad
logprobs, the update), evaluation.py (pass@1); this module loads the run and drives the loop.

Under torchrun every rank runs this loop on the same data order and seeds (fastgrpo.train.distributed): it samples
and scores its slice of the round's prompt groups, the rollout is gathered, and each global micro-batch of
K * per_device_train_batch_size samples is cut into K shares whose summed gradients are one process's.

Loss normalisation across micro-batches follows TRL 1.16: the per-micro-batch loss is divided by
gradient_accumulation_steps, except dapo/cispo, which divide by the loss tokens of an average optimizer step. The
entropy bonus (entropy_coef) is each micro-batch's mean token entropy divided by gradient_accumulation_steps, for every
loss type. The head scores logits as the model's forward makes them (its logit scale or softcap, model.check_head).
"""

import dataclasses
import datetime
import gc
import math
import sys
import time
import warnings
from collections import defaultdict
from contextlib import ExitStack, contextmanager
from pathlib import Path

import torch
import yaml

from fastgrpo.chunked import chunk_size
from fastgrpo.loss_config import TOKEN_NORMALISED_LOSS_TYPES, LossConfig
from fastgrpo.memory import peak_memory, reset_peak_memory
from fastgrpo.models import find_hf_model, stop_token_ids
from fastgrpo.sampling import Engine
from fastgrpo.sizes import GiB, parse_size
from fastgrpo.train import checkpoint, distributed, run_config, run_dir
from fastgrpo.train.agent import Agent
from fastgrpo.train.config import TrainConfig, flag, train_dtype
from fastgrpo.train.data import (
    PromptOrder,
    Rows,
    StreamedPrompts,
    StreamOrder,
    answer_column,
    eval_subset,
    load_rows,
    prepare,
    stream_rows,
)
from fastgrpo.train.distributed import RankFailed
from fastgrpo.train.evaluation import Evaluation
from fastgrpo.train.finite import (
    NonFiniteError,
    check_inputs,
    check_rewards,
    check_weights,
    last_checkpoint_said,
)
from fastgrpo.train.loading import (
    PACKED_ATTENTION,
    check_head,
    load_policy,
    load_reference,
    load_tokenizer,
    max_positions,
    model_config,
)
from fastgrpo.train.logs import (
    PLOT_FILE,
    MetricsLog,
    Progress,
    Timer,
    length_metrics,
    plot,
    reward_metrics,
    summary_line,
)
from fastgrpo.train.moe import check_routing_replay, router_aux_loss_coef, routing_metrics
from fastgrpo.train.plan import (
    check_kv_cache_blocks,
    describe_peak,
    fitted,
    format_plan,
    model_shapes,
    plan_run,
    usable,
    what_would_fit,
)
from fastgrpo.train.policy_loss import EntropyControl, PolicyLoss
from fastgrpo.train.quantization import bitsandbytes
from fastgrpo.train.rewards import RewardError, Rewards, load_function
from fastgrpo.train.rollout import decoupled_advantages, group_advantages, rollout_of, sampler_importance_weights
from fastgrpo.train.rounds import Rounds, seed_for
from fastgrpo.train.run_dir import RunDir
from fastgrpo.train.schedule import lr_scheduler
from fastgrpo.train.tools import RolloutError, ToolCounts
from fastgrpo.train.update import Update

PLAN_FILE = "memory_plan.txt"
REFERENCE_FILE = "reference.safetensors"  # a checkpoint's reference model, with sync_ref_model


# Errors before the first step is done after which no run is left behind (Trainer._discard_unstarted_run); a failure
# of another process carries its error's class name.
DISCARDED_BEFORE_A_STEP = ("RewardError", "RolloutError", "NonFiniteError")

# What a checkpoint holds and a resumed run therefore cannot change.
RESUME_FIXED = ("model_name_or_path", "use_peft", "lora_r", "lora_alpha", "lora_target_modules", "load_in_4bit",
                "optim", "bf16", "sync_ref_model")



def make_optimizer(config: TrainConfig, parameters: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """AdamW with the config's learning rate, betas and weight decay: PyTorch's (states in the parameters' dtype), or
    bitsandbytes' 8-bit AdamW (adamw_8bit: both moments 8-bit with a scale per block of 256 values; tensors under
    4096 values keep 32-bit states, as bitsandbytes does)."""
    options = dict(lr=config.learning_rate, weight_decay=config.weight_decay,
                   betas=(config.adam_beta1, config.adam_beta2))
    if config.optim == "adamw_8bit":
        return bitsandbytes("optim adamw_8bit").optim.AdamW8bit(parameters, **options)
    return torch.optim.AdamW(parameters, **options)


def model_loss_options(config: TrainConfig, head: dict) -> LossConfig:
    """The loss options with the model's logit transform `head`. TRL's entropy bonus is a micro-batch mean divided by
    gradient_accumulation_steps, never by the loss type's normaliser; dapo / cispo losses are not divided by
    gradient_accumulation_steps (their num_items_in_batch spans the optimizer step), so their coefficient is."""
    from fastgrpo.train.policy_loss import check_options

    check_options(config)  # TRL's masks and adaptive entropy control
    options = dataclasses.replace(config.loss_options(), **head)
    if config.loss_type in TOKEN_NORMALISED_LOSS_TYPES:
        options = dataclasses.replace(options, entropy_coef=config.entropy_coef / config.gradient_accumulation_steps)
    return options


def _output_dir(config: TrainConfig) -> Path:
    if config.output_dir is not None:
        return Path(config.output_dir)
    return Path("runs") / datetime.datetime.now().strftime("%Y%m%d-%H%M%S")


class Trainer(Rounds, Update, Evaluation):
    def __init__(self, config: TrainConfig, device: str | torch.device | None = None):
        self.config = config
        self.world = distributed.current(config.ddp_timeout, join_alone=config.parallelism is not None)
        self.device = torch.device(device) if device is not None else distributed.device(self.world)
        # One process shards or wraps itself only when asked to (--parallelism under torchrun: FSDP2 on one GPU).
        grouped = self.world.size > 1 or (config.parallelism is not None and torch.distributed.is_initialized())
        self.parallelism = (config.parallelism or "fsdp") if grouped else None
        self.output_dir = self.world.broadcast(_output_dir(config))  # the default's date-time: rank 0's
        self.folder = RunDir(self.output_dir)
        try:
            claimed = None
            with self.world.together("checking the output folder"):
                if self.world.is_main:  # one process checks and locks the folder
                    claimed = self._claim_output_dir()
            resume_from, replaced = self.world.broadcast(claimed)
            with self.world.together("loading"):
                self._load(resume_from)
            if self.world.is_main:
                run_dir.delete(replaced)  # the old run goes only now that the new one has its model and data
            config = self.config  # as --auto-fit left it
            self.log = MetricsLog(self.output_dir, config.report_to, config.to_dict(),
                                  self.step if resume_from is not None else None, write=self.world.is_main)
            if self.world.is_main:
                changed = run_config.record(self.output_dir, config, self.step if resume_from is not None else None)
                if changed is not None:
                    print(changed, file=sys.stderr)
                (self.output_dir / PLAN_FILE).write_text(self.plan_text + "\n")
        except BaseException:
            self.folder.release(remove_new=True)
            raise

    @property
    def processing_class(self):
        """The tokenizer, under TRL's name (a TRL rollout_func reads trainer.processing_class)."""
        return self.tokenizer

    def _check_resume_options(self, saved: Path) -> None:
        """A resumed run keeps the model and the optimizer its checkpoints hold: an option that would change them is
        refused, naming the flag (the other options apply from the resumed step on)."""
        if not saved.is_file():
            return
        run = yaml.safe_load(saved.read_text()) or {}
        changed = [name for name in RESUME_FIXED if name in run and run[name] != getattr(self.config, name)]
        if changed:
            said = "; ".join(f"{flag(name)} {getattr(self.config, name)!r}, the run's is {run[name]!r}"
                             for name in changed)
            raise ValueError(f"resume: {said} ({saved}): a resumed run keeps the model and optimizer of its "
                             "checkpoints; drop the option, or start a new run in another --output-dir")

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
            self._check_resume_options(out / "config.yaml")
            if config.max_steps <= step:
                raise ValueError(f"resume: max_steps {config.max_steps} is not past the step of {resume_from} "
                                 f"({step}); pass --max-steps greater than {step} to train on")
        elif run_dir.contents(out):
            if not config.overwrite_output_dir:
                raise FileExistsError(f"--output-dir {out} already holds files; pass --resume to continue that run "
                                      "or --overwrite-output-dir to replace it")
            replaced = run_dir.replaceable(out)
        self.folder.lock()
        return resume_from, replaced

    def _plan_memory(self) -> None:
        """The memory plan of this run (fastgrpo.train.plan) for gpu_memory (or the GPU's own), with the training
        data's longest prompt, in self.plan_text; with auto_fit the config takes the settings it picks. A run the plan
        says does not fit gets a warning; a kv_cache_blocks that cannot sample or does not fit in memory, an error."""
        config = self.config
        gpu = None
        if config.gpu_memory is not None:
            gpu = parse_size(config.gpu_memory)
        elif self.device.type == "cuda":
            gpu = torch.cuda.get_device_properties(self.device).total_memory
        longest = max(map(len, self.train_prompts.token_ids))
        shapes = model_shapes(model_config(config))
        plan = plan_run(config, shapes, self.device.type, gpu, prompt_length=longest)
        if config.auto_fit:
            self.config = config = dataclasses.replace(config, **fitted(config, plan))
        evaluated = [] if self.eval_prompts is None else list(map(len, self.eval_prompts.token_ids))
        check_kv_cache_blocks(config, shapes, self.device, list(map(len, self.train_prompts.token_ids)), evaluated)
        self.plan_text = format_plan(plan, gpu)
        if gpu is not None and self.world.is_main:
            print(f"fastgrpo train: memory plan: peak {plan.peak() / GiB:.1f} GiB ({describe_peak(plan)}) of "
                  f"{gpu / GiB:.1f} GiB; {PLAN_FILE} in the output folder", file=sys.stderr)
            if not plan.fits(gpu):
                warnings.warn(f"the memory plan's peak, {plan.peak() / GiB:.1f} GiB, is over the "
                              f"{usable(gpu) / GiB:.1f} GiB that tensors can use of gpu_memory {gpu / GiB:.1f} GiB; "
                              "--auto-fit picks settings that fit; "
                              + what_would_fit(config, shapes, self.device.type, gpu), stacklevel=2)

    def _load(self, resume_from: Path | None) -> None:
        """Tokenizer, prompts, rewards, policy (a checkpoint's weights on resume), reference, engine, the policy
        sharded or replicated over the processes, optimizer and schedule, and on resume the optimizer, schedule, RNG
        and data position."""
        config = self.config
        torch.manual_seed(config.seed)  # LoRA's initial weights (the same on every rank)
        self.tokenizer = load_tokenizer(config)
        self.agent = None  # tools and environments (agent.py)
        self.context_window = max_positions(config)
        if config.tools or config.environment_factory is not None:
            self.agent = Agent(config, self.tokenizer, self.context_window)
        self.rollout_func = None
        if config.rollout_func is not None:
            try:
                self.rollout_func = load_function(config.rollout_func)
            except ValueError as e:
                raise ValueError(f"rollout_func: {str(e).removeprefix('reward function ')}") from None
        shown = None if self.agent is None else self.agent.tools_for  # the tools each prompt shows the model
        if config.dataset_streaming:  # rows read as the run reaches them; the held-out split's first ones
            self.train_prompts = StreamedPrompts(config, self.tokenizer, shown)
            answers = self.train_prompts.answer_column
            stream = stream_rows(config, "test") if answers is not None else None
            eval_rows = None if stream is None else Rows(list(stream.take(config.eval_num_samples)),
                                                         f"the streamed held-out split of {config.dataset_name}")
            self.eval_prompts = None if eval_rows is None else prepare(eval_rows, self.tokenizer, config, "held-out",
                                                                       answers, shown)
        else:
            train_rows = load_rows(config, "train")
            answers = answer_column(config, train_rows)
            self.train_prompts = prepare(train_rows, self.tokenizer, config, "train", answers, shown)
            eval_rows = load_rows(config, "test") if answers is not None else None  # pass@1 needs reference answers
            self.eval_prompts = None if eval_rows is None else eval_subset(
                prepare(eval_rows, self.tokenizer, config, "held-out", answers, shown), config.eval_num_samples)
        self._plan_memory()  # before anything that depends on the micro-batch, which --auto-fit may change
        config = self.config
        extra = [] if self.agent is None else self.agent.reward_functions
        if not config.reward_funcs and not extra:
            raise ValueError(f"reward_funcs is empty and no environment of environment_factory "
                             f"{config.environment_factory!r} has a get_reward method: nothing scores the rollouts")
        self.rewards = Rewards(config.reward_funcs, config.reward_weights, config.max_completion_length, answers,
                               self.device, train_dtype(config, self.device.type), config.trust_remote_code,
                               config.chat_template_kwargs, extra)

        sharded = resume_from is not None and checkpoint.is_sharded(resume_from)
        self.model = load_policy(config, self.device, None if sharded else resume_from)
        self.ref_model = load_reference(config, self.device)
        if config.disable_dropout:  # as TRL: every torch.nn.Dropout (LoRA's included) of both models
            for module in [*self.model.modules(), *(self.ref_model.modules() if self.ref_model is not None else [])]:
                if isinstance(module, torch.nn.Dropout):
                    module.p = 0.0
        self.packed = find_hf_model(self.model).config._attn_implementation in PACKED_ATTENTION
        self.stop_token_ids = stop_token_ids(self.model, self.tokenizer)
        self.head = check_head(find_hf_model(self.model))  # {logit_scale, logit_softcap}
        self.loss_options = model_loss_options(config, self.head)
        self.entropy_control = EntropyControl.of(config) if config.use_adaptive_entropy else None
        # The modules whose forward runs a micro-batch: the root that FSDP shards, or the module DDP wraps.
        self.policy = PolicyLoss(self.model, self.packed, self.head,
                                 router_aux_loss_coef(config.router_aux_loss_coef, find_hf_model(self.model)),
                                 config.routing_replay)
        check_routing_replay(config, self.policy.routing, find_hf_model(self.model))
        self.reference = None if self.ref_model is None else PolicyLoss(self.ref_model, self.packed, self.head,
                                                                        routing_replay=config.routing_replay)
        # An MoE sampled by the engine records its routes: replayed (routing_replay) or compared (routing/mismatch)
        routing = self.policy.routing
        record_routes = routing is not None and routing.can_record and self.rollout_func is None
        self.train_module = self._parallelize()
        # Under FSDP2 the layers keep FSDP's forward hooks while sampling (no-ops on unsharded weights, but they
        # touch streams, which a CUDA-graph capture does not allow): decode steps run eager there. The engine reads
        # the layers with a forward of its own (sampling/layers.py), on whole weights as it samples.
        with distributed.unsharded(self.policy):
            self.engine = Engine(self.model, tokenizer=self.tokenizer, block_size=config.block_size,
                                 num_blocks=config.kv_cache_blocks, memory_fraction=config.sampling_memory_fraction,
                                 cuda_graphs=self.parallelism != "fsdp", kv_cache_dtype=config.kv_cache_dtype,
                                 record_routes=record_routes)

        self.parameters = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = make_optimizer(config, self.parameters)
        self.optimizer_steps_per_round = config.num_iterations * config.steps_per_generation // (
            config.gradient_accumulation_steps)
        if config.sync_ref_model:
            self.optimizer.register_step_post_hook(self._sync_reference)
        total = config.max_steps * self.optimizer_steps_per_round
        self.scheduler = lr_scheduler(config.lr_scheduler_type, self.optimizer, math.ceil(config.warmup_ratio * total),
                                      total)

        self.order = (StreamOrder(self.train_prompts) if config.dataset_streaming
                      else PromptOrder(len(self.train_prompts.rows), config.seed))
        self.step, self.num_tokens, self.seconds, self.initial_accuracy = 0, 0, 0.0, None
        # Functions of a phase's name ("sampling", "logprobs", "train") returning a context manager, entered around
        # that phase of train_step: how a measurement attributes what it counts (fastgrpo.bench.memory_trace).
        self.phase_hooks = []
        if resume_from is not None:
            plain = not sharded and self.parallelism != "fsdp"  # optimizer.pt into unsharded parameters
            if sharded:
                checkpoint.load_sharded(resume_from, self.model, self.optimizer)
            elif not plain:
                checkpoint.load_full_optimizer(resume_from, self.model, self.optimizer)
            state = checkpoint.load_state(resume_from, self.optimizer if plain else None, self.scheduler)
            self.step, self.num_tokens, self.seconds = state["step"], state["num_tokens"], state["seconds"]
            self.initial_accuracy = state["initial_accuracy"]
            self.order.load_state_dict(state["data"])
            if self.entropy_control is not None and "entropy_control" in state:
                self.entropy_control.load_state_dict(state["entropy_control"])
            if config.sync_ref_model:
                checkpoint.load_full_state(resume_from / REFERENCE_FILE, self.ref_model)
        self.optimizer_steps_done = self.step * self.optimizer_steps_per_round  # (sync_ref_model's clock)

    def _parallelize(self) -> torch.nn.Module:
        """The module the update calls: the policy itself (one process), wrapped by DDP, or sharded by FSDP2 (the
        reference too, so no rank holds a whole copy of it)."""
        if self.parallelism is None:
            return self.policy
        config = self.config
        for on, what in ((config.optim == "adamw_8bit", "optim adamw_8bit"), (config.load_in_4bit, "load_in_4bit")):
            if on:  # bitsandbytes' states and NF4 weights are plain tensors: neither DTensor shards nor DCP's loads
                raise ValueError(f"{what} runs in one process; several processes (torchrun) are not supported with "
                                 "it yet")
        if self.parallelism == "ddp":
            from torch.nn.parallel import DistributedDataParallel

            ids = [self.device.index] if self.device.type == "cuda" else None
            return DistributedDataParallel(self.policy, device_ids=ids)
        reduce_dtype = torch.float32 if self.device.type == "cuda" else None
        if self.reference is not None:
            distributed.fully_shard(self.reference, self.ref_model, reduce_dtype)
        return distributed.fully_shard(self.policy, self.model, reduce_dtype)

    def _seed(self, *key) -> int:
        """A seed per (run seed, step, purpose): sampling and shuffles do not depend on what ran before."""
        return seed_for(self.config.seed, self.step, *key)

    # -- the loop --

    def train(self) -> dict:
        """Trains to max_steps; the output folder's lock is released when this returns or raises."""
        # The model, data and libraries loaded so far live for the whole run: moved out of the collector's reach, a
        # full collection (triggered by the lists each sampling call returns) no longer re-scans them (~0.3 s with
        # transformers loaded on a slow CPU). They go back afterwards (unless the caller had frozen objects itself):
        # frozen objects are never freed at exit, and triton's bindings then report them as leaks.
        unfreeze = gc.get_freeze_count() == 0
        gc.freeze()
        fresh = self.step == 0  # not resumed
        try:
            with chunk_size(self.config.loss_chunk_tokens):
                return self._train()
        except (RewardError, RolloutError, NonFiniteError, RankFailed) as error:
            # (another process's failure: when it was one of these)
            discards = not isinstance(error, RankFailed) or error.kind in DISCARDED_BEFORE_A_STEP
            if fresh and discards:
                self._discard_unstarted_run()
            raise
        finally:
            if unfreeze:
                gc.unfreeze()
            if self.agent is not None:
                self.agent.close()
            self.folder.release(remove_new=True)  # (a folder this run made is removed only if it is empty)

    def _discard_unstarted_run(self) -> None:
        """A reward function, rollout_func or environment that fails, or a non-finite step, before the first step is
        done leaves no run behind, as a refused run leaves no file: what this run wrote (its config, memory plan, the
        initial evaluation's metrics) goes, so that the same command runs again once the cause is fixed (on every
        number of processes: rank 0 deletes). A run with a finished step keeps all."""
        if not self.world.is_main or any(row["step"] >= 1 for row in self.log.history):
            return
        self.log.close()
        run_dir.delete(run_dir.run_entries(self.output_dir))

    def _train(self) -> dict:
        config = self.config
        first_step, earlier_seconds = self.step, self.seconds  # > 0 when resumed
        if self.step == 0:
            self.initial_accuracy = self.evaluate()
            self.log.log(0, {"eval/accuracy": self.initial_accuracy})
        final_accuracy = self.initial_accuracy
        quiet = dataclasses.replace(config, disable_tqdm=True) if not self.world.is_main else config
        with Progress(quiet, self.step) as progress:
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
        plot_path = self.output_dir / PLOT_FILE
        if self.world.is_main:
            plot(self.log.history, plot_path)
        summary = {"initial_accuracy": self.initial_accuracy, "final_accuracy": final_accuracy, "steps": self.step,
                   "seconds": self.seconds, "resumed_from": first_step, "steps_run": self.step - first_step,
                   "seconds_run": self.seconds - earlier_seconds, "output_dir": str(self.output_dir),
                   "plot": str(plot_path),
                   "eval_prompts": 0 if self.eval_prompts is None else len(self.eval_prompts.rows)}
        if self.world.is_main:
            print(summary_line(summary, config))
        return summary

    @contextmanager
    def _phase(self, name: str):
        """Phase `name` of train_step, inside the contexts of phase_hooks."""
        with ExitStack() as stack:
            for hook in self.phase_hooks:
                stack.enter_context(hook(name))
            yield

    def train_step(self) -> dict:
        config, G = self.config, self.config.num_generations
        reset_peak_memory(self.device)
        timer = Timer()

        # 1. sample (this rank's prompt groups) and 2. score them; then every rank gets the whole round
        params = self._sampling_params(self._seed("sample"))
        dynamic = {}
        with self._phase("sampling"):  # (each round's sampling and scoring runs in World.together)
            if config.dynamic_sampling:
                picked, parts, dynamic = self._dynamic_round(params)
            else:
                picked = self.order.next(config.prompts_per_step * self.world.size)
                parts = self._round(picked, params)  # in group order
        timer.lap("sampling")
        completions = [c for part in parts for group in part.groups for c in group]  # [P*G], prompt-major
        per_func = torch.cat([part.per_func for part in parts])  # [P*G, F]
        rewards = torch.cat([part.rewards for part in parts])  # [P*G]
        logged = defaultdict(list)  # the reward functions' log_metric values, averaged over calls as TRL does
        for part in parts:
            for name, values in part.logged_metrics.items():
                logged[name] += values
        timer.lap("rewards")

        completion_ids = [c.token_ids for c in completions]
        gdpo = config.multi_objective_aggregation == "normalize_then_sum"
        check_rewards(rewards, per_func, self.rewards.metric_names, G, per_function=gdpo)
        if gdpo:
            advantages, flat = decoupled_advantages(per_func, self.rewards.weights, G)
        else:
            advantages, _, flat = group_advantages(rewards, G, config.scale_rewards)
        if config.log_completions:
            self._log_completions(completion_ids, per_func, advantages, parts)
        correct = config.importance_sampling_correction
        # The sampler's logprobs: for the IS correction and the off-policy mask (which TRL measures from vLLM's
        # logprobs: the drift of the updates and the sampler's mismatch both)
        rollout = rollout_of(completions, [ids for part in parts for ids in part.prompt_ids], advantages,
                             config.mask_truncated_completions,
                             sampler_logps="required" if correct else
                             "if given" if config.off_policy_mask_threshold is not None else None)  # fmt: skip

        # 3. no-grad logprobs
        if config.beta != 0:
            with self._phase("logprobs"):
                rollout.ref_logps = self._reference_logprobs(rollout)
        routed = rollout.routes is not None  # (the old logprobs' pass measures the routes against the sampler's)
        route_counts = None
        if (correct or routed or config.num_iterations > 1
                or config.steps_per_generation > config.gradient_accumulation_steps):
            with self._phase("logprobs"):
                rollout.old_logps, route_counts = self._logprobs(self.policy, rollout)
        sampling_metrics = {}
        if correct:
            rollout.importance_weights, sampling_metrics = sampler_importance_weights(
                rollout, config.importance_sampling_mode, config.importance_sampling_clip_min,
                config.importance_sampling_clip_max)
        if routed:
            sampling_metrics = routing_metrics(route_counts, rollout, completions) | sampling_metrics
        timer.lap("reference")
        check_inputs(self.step, rollout, correct, self.rollout_func is not None, self._last_checkpoint)

        # 4. update
        with self._phase("train"):
            stats = self._update(rollout)
        timer.lap("train")

        # As TRL: a completion's length counts the tokens the model wrote (tool_mask 1), not the tools' results.
        lengths = torch.tensor([sum(c.tool_mask) for c in completions], dtype=torch.float32)
        truncated = rollout.truncated
        self.num_tokens += int(lengths.sum()) + sum(len(p) for p in rollout.prompt_ids)
        tool_metrics = {}
        if self.agent is not None:
            tool_metrics = sum((part.tool_counts for part in parts), ToolCounts()).metrics(len(completions))
        return {
            **stats,
            **tool_metrics,
            **reward_metrics(self.rewards, per_func, rewards, flat),
            **{name: sum(values) / len(values) for name, values in logged.items()},
            **length_metrics(lengths, truncated),
            **sampling_metrics,
            "num_tokens": self.num_tokens,
            "learning_rate": self.scheduler.get_last_lr()[0],
            "sampling/preemptions": sum(part.preemptions for part in parts),
            **timer.metrics(),
            "tokens_per_second": float(lengths.sum()) / timer.total,
            "peak_memory_gib": max(self.world.gather(peak_memory(self.device) / GiB)),  # the fullest process's
            **dynamic,  # (its frac_reward_zero_std counts the groups before filtering)
        }

    def _sync_reference(self, optimizer, args, kwargs) -> None:
        """sync_ref_model (TRL's SyncRefModelCallback): after every ref_model_sync_steps-th optimizer step of the
        run, ref = alpha * policy + (1 - alpha) * ref, parameter by parameter (on each process's shards)."""
        self.optimizer_steps_done += 1
        if self.optimizer_steps_done % self.config.ref_model_sync_steps:
            return
        alpha = self.config.ref_model_mixup_alpha
        with torch.no_grad():
            for ref, policy in zip(self.ref_model.parameters(), self.model.parameters(), strict=True):
                ref.mul_(1.0 - alpha).add_(policy, alpha=alpha)

    def _last_checkpoint(self) -> str:
        return last_checkpoint_said(checkpoint.latest(self.output_dir))

    def save(self) -> Path:
        check_weights(self.step, self.model, self.world, self._last_checkpoint)  # no checkpoint holds NaN or inf
        state = {"num_tokens": self.num_tokens, "seconds": self.seconds, "initial_accuracy": self.initial_accuracy,
                 "data": self.order.state_dict()}
        if self.entropy_control is not None:  # use_adaptive_entropy: its coefficient and last step's entropy
            state["entropy_control"] = self.entropy_control.state_dict()
        # The reference that sync_ref_model moves is part of the run's state (gathered: a collective under FSDP2).
        tensors = {REFERENCE_FILE: checkpoint.full_state(self.ref_model)} if self.config.sync_ref_model else None
        if self.parallelism is not None:  # sharded (FSDP2) or not, several processes write a DCP checkpoint
            return checkpoint.save_sharded(self.output_dir, self.step, self.world, self.model, self.tokenizer,
                                           self.optimizer, self.scheduler, state, self.config.save_total_limit,
                                           export=self.step == self.config.max_steps, tensors=tensors)
        return checkpoint.save(self.output_dir, self.step, self.model, self.tokenizer, self.optimizer,
                               self.scheduler, state, self.config.save_total_limit, tensors)

