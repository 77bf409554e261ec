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

Under torchrun every rank runs this loop on the same data order and seeds (fastgrpo.train.distributed): it samples
and scores its slice of the round's prompt groups, the rollout is gathered, and each global micro-batch of
K * per_device_train_batch_size samples is cut into K shares whose summed gradients are one process's.

Loss normalisation across micro-batches follows TRL 1.16: the per-micro-batch loss is divided by
gradient_accumulation_steps, except dapo/cispo, which divide by the loss tokens of an average optimizer step. The
entropy bonus (entropy_coef) is each micro-batch's mean token entropy divided by gradient_accumulation_steps, for every
loss type. The head scores logits as the model's forward makes them (its logit scale or softcap, model.check_head).
"""

import copy
import dataclasses
import datetime
import gc
import math
import sys
import time
import warnings
import zlib
from collections import defaultdict
from contextlib import ExitStack, contextmanager, nullcontext
from pathlib import Path

import torch
import yaml

from fastgrpo.chunked import chunk_size
from fastgrpo.loss_config import TOKEN_NORMALISED_LOSS_TYPES, LossConfig
from fastgrpo.memory import peak_memory, reset_peak_memory
from fastgrpo.models import find_hf_model, stop_token_ids
from fastgrpo.reference import RATIO_METRICS
from fastgrpo.sampling import Completion, Engine, SamplingParams
from fastgrpo.sizes import GiB, parse_size
from fastgrpo.train import checkpoint, distributed, run_config, run_dir
from fastgrpo.train.agent import Agent
from fastgrpo.train.config import TrainConfig, flag, train_dtype
from fastgrpo.train.data import (
    PromptOrder,
    Prompts,
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
from fastgrpo.train.finite import (
    NonFiniteError,
    check_inputs,
    check_rewards,
    check_step,
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
    nanmean,
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
from fastgrpo.train.rewards import RewardError, Rewards, accuracy, completion_text, load_function
from fastgrpo.train.rollout import (
    Rollout,
    decoupled_advantages,
    group_advantages,
    micro_batch,
    micro_batches,
    sampler_importance_weights,
)
from fastgrpo.train.rounds import RankRound, Sampled, dynamic_round
from fastgrpo.train.run_dir import RunDir
from fastgrpo.train.schedule import lr_scheduler
from fastgrpo.train.tools import RolloutError, ToolChat, ToolCounts, check_rollout

PLAN_FILE = "memory_plan.txt"
REFERENCE_FILE = "reference.safetensors"  # a checkpoint's reference model, with sync_ref_model
# Dataset columns that do not reach reward functions as keywords (TRL's, and the keywords the trainer passes).
RESERVED_REWARD_ARGS = ("prompt", "completion", "prompts", "completions", "completion_ids", "trainer_state",
                        "log_extra", "log_metric", "environments")


# Errors before the first step is done after which no run is left behind (Trainer._discard_unstarted_run); a failure
# of another process carries its error's class name.
DISCARDED_BEFORE_A_STEP = ("RewardError", "RolloutError", "NonFiniteError")

# What a checkpoint holds and a resumed run therefore cannot change.
RESUME_FIXED = ("model_name_or_path", "use_peft", "lora_r", "lora_alpha", "lora_target_modules", "load_in_4bit",
                "optim", "bf16", "sync_ref_model")


def completion_messages(tokenizer, completion_ids: list[list[int]], prompt_ids: list[list[int]],
                        conversational: bool) -> list:
    """Completions without tools as reward functions get them, as TRL 1.16's _generate makes them: the decoded text
    (special tokens dropped) for text prompts; for conversational ones one assistant message, parsed with the
    tokenizer's response_template when it ships one (reasoning_content apart, the EOS dropped), else the text."""
    if conversational and getattr(tokenizer, "response_template", None) is not None:
        chat = ToolChat(tokenizer, tokenizer.response_template)
        return [[chat.parse(ids, prompt, None)] for ids, prompt in zip(completion_ids, prompt_ids, strict=True)]
    texts = tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
    return [[{"role": "assistant", "content": t}] for t in texts] if conversational else texts


def seed_for(*key) -> int:
    """A 32-bit seed that depends on `key` only (its repr), the same in every process and run."""
    return zlib.crc32(repr(key).encode())


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


class Trainer:
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

    def _sample(self, data: Prompts, picked: list[int], n: int, params: SamplingParams,
                first_group: int = 0) -> Sampled | None:
        """This rank's slice of the prompt groups `picked` (indices into `data`), n completions each, sampled with
        each group's own random stream (first_group + its index in `picked`), so that the round is the same for any
        number of processes; None for a rank without a group. Through the engine, with the agent's tool loop when
        there are tools or environments, or through the user's rollout_func."""
        share = self.world.share(len(picked))
        with distributed.unsharded(self.policy):  # FSDP2's all-gathers: every rank joins, even one without a group
            if not share:  # more processes than prompts (a small held-out set)
                return None
            mine = [picked[i] for i in share]
            streams = [first_group + i for i in share]
            if self.rollout_func is not None:
                return self._call_rollout_func(data, mine, n)
            if self.agent is not None:
                # reset(**row) gets every column, None where the row has none (as rows of a `datasets` table)
                done = self.agent.generate(self.engine, [data.rows[i] for i in mine], [data.prompts[i] for i in mine],
                                           [data.token_ids[i] for i in mine], streams, n, params)
                columns = {} if done.environments is None else {"environments": done.environments}
                return Sampled(done.groups, done.prompt_ids, done.prompts, done.messages, columns, done.counts)
            groups = self.engine.generate([data.token_ids[i] for i in mine], n=n, params=params, group_ids=streams)
        return self._plain_sampled(data, mine, groups)

    def _plain_sampled(self, data: Prompts, mine: list[int], groups: list[list[Completion]]) -> Sampled:
        """Engine groups of the prompts `mine` as reward functions get them (text, or one assistant message)."""
        samples = [i for i in mine for _ in range(len(groups[0]))]
        prompt_ids = [data.token_ids[i] for i in samples]
        completions = completion_messages(self.tokenizer, [c.token_ids for group in groups for c in group], prompt_ids,
                                          data.conversational)
        return Sampled(groups, prompt_ids, [data.prompts[i] for i in samples], completions, {}, ToolCounts())

    def _round(self, picked: list[int], params: SamplingParams, first_group: int = 0) -> list[RankRound]:
        """The groups of train prompts `picked`, sampled (this rank's share) and scored, gathered to every rank in
        group order. A rank that fails while sampling or scoring ends every rank with its error (World.together),
        before any of them enters the gather."""
        mine = None
        with self.world.together("sampling and rewards"):
            sampled = self._sample(self.train_prompts, picked, self.config.num_generations, params, first_group)
            if sampled is not None:  # a process gets no group when a round has fewer groups than processes
                samples = [picked[i] for i in self.world.share(len(picked))
                           for _ in range(self.config.num_generations)]
                per_func, rewards = self._score(samples, sampled)
                mine = RankRound(sampled.groups, sampled.prompt_ids, sampled.prompts, sampled.tool_counts, per_func,
                                 rewards,
                                 self.engine.stats.num_preemptions if self.rollout_func is None else 0,
                                 self.rewards.logged_metrics, self.rewards.logged_columns)
        return [part for part in self.world.gather(mine) if part is not None]

    def _dynamic_round(self, params: SamplingParams) -> tuple[list[int], list[RankRound], dict]:
        """DAPO's dynamic sampling (rounds.dynamic_round). -> (the kept groups' prompts, the round as one RankRound,
        metrics)."""
        return dynamic_round(self, params)

    def _call_rollout_func(self, data: Prompts, mine: list[int], n: int) -> Sampled:
        """TRL's rollout_func(prompts, trainer) for the samples of prompts `mine` (n each, prompt-major); its
        output checked (tools.check_rollout). Its env_mask is the tool mask; a completion that does not end in a
        stop or pad token was cut ("length"), as TRL reads it; its other fields go to the reward functions."""
        samples = [i for i in mine for _ in range(n)]
        prompts = [copy.deepcopy(data.prompts[i]) for i in samples]
        try:
            output = self.rollout_func(prompts, self)
        except Exception as e:
            raise RewardError(f"rollout_func {self.config.rollout_func!r} raised {type(e).__name__}: {e}") from e
        output = check_rollout(output, len(samples), len(self.tokenizer), self.config.max_completion_length,
                               self.context_window)
        ids, logprobs = output["completion_ids"], output["logprobs"]
        if logprobs is None and self.config.importance_sampling_correction:
            raise RolloutError("rollout_func returned logprobs None, but importance_sampling_correction needs the "
                             "sampler's logprob of every completion token; return them, or turn the correction off")
        ends = {*self.stop_token_ids, self.tokenizer.pad_token_id}
        masks = output.get("env_mask") or [[1] * len(c) for c in ids]
        completions = [Completion(c, [math.nan] * len(c) if logprobs is None else logprobs[k],
                                  "stop" if c[-1] in ends else "length", masks[k]) for k, c in enumerate(ids)]
        columns = {key: value if isinstance(value, list) else [value] * len(samples) for key, value in output.items()
                   if key not in ("prompt_ids", "completion_ids", "logprobs", "env_mask")}
        return Sampled([completions[g * n : (g + 1) * n] for g in range(len(mine))], output["prompt_ids"], prompts,
                       completion_messages(self.tokenizer, ids, output["prompt_ids"], data.conversational), columns,
                       ToolCounts())

    def _sampling_params(self, seed: int, evaluation: bool = False) -> SamplingParams:
        """The sampler's options, generation_kwargs' overriding the config's (TRL's rule). Its temperature is the
        training samples' only: the loss still divides by `temperature` (as TRL's does), and evaluation samples at
        eval_temperature."""
        config = self.config
        options = dict(temperature=config.temperature, top_p=config.top_p, top_k=config.top_k, min_p=config.min_p,
                       repetition_penalty=config.repetition_penalty)
        options |= config.generation_kwargs or {}
        if evaluation:
            options["temperature"] = config.eval_temperature
        options["min_p"] = options["min_p"] or 0.0  # TRL's None is off
        return SamplingParams(**options, max_new_tokens=config.max_completion_length,
                              stop_token_ids=self.stop_token_ids, seed=seed)

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
        truncated = torch.tensor([c.finish_reason == "length" for c in completions])
        drop = config.mask_truncated_completions
        cut = truncated.tolist()
        rollout = Rollout(
            prompt_ids=[ids for part in parts for ids in part.prompt_ids], completion_ids=completion_ids,
            truncated=truncated, advantages=advantages,  # tool results (tool_mask 0) stay out of the loss
            loss_mask=[[0] * len(c.token_ids) if drop and cut[i] else list(c.tool_mask)
                       for i, c in enumerate(completions)],
            routes=[c.routes for c in completions] if any(c.routes is not None for c in completions) else None,
        )  # fmt: skip

        # 3. no-grad logprobs
        if config.beta != 0:
            with self._phase("logprobs"):
                rollout.ref_logps = self._reference_logprobs(rollout)
        correct = config.importance_sampling_correction
        routed = rollout.routes is not None  # (the old logprobs' pass measures the routes against the sampler's)
        route_counts = None
        if (correct or routed or config.num_iterations > 1
                or config.steps_per_generation > config.gradient_accumulation_steps):
            with self._phase("logprobs"):
                rollout.old_logps, route_counts = self._logprobs(self.policy, rollout)
        sampling_metrics = {}
        if correct or config.off_policy_mask_threshold is not None:
            # The sampler's logprobs, for the IS correction and the off-policy mask (which TRL measures from vLLM's
            # logprobs: the drift of the updates and the sampler's mismatch both); a rollout_func without logprobs
            # (NaN) leaves the mask the old ones
            sampled = [torch.tensor(c.logprobs, dtype=torch.float32) for c in completions]
            if correct or not any(bool(t.isnan().any()) for t in sampled):
                rollout.sampling_logps = sampled
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

    def _score(self, samples: list[int], sampled: Sampled) -> tuple[torch.Tensor, torch.Tensor]:
        """The rewards of this rank's completions (`samples`: their train prompts' indices): (per function [n, F],
        weighted total [n]). Reward functions get TRL's arguments: the prompts (after an environment's reset),
        the completions (text, one assistant message, or with tools the assistant and tool messages), the dataset's
        columns, the completions' token ids, a TrainerState, and the environments (environments=) or a
        rollout_func's extra fields."""
        data = self.train_prompts
        completion_ids = [c.token_ids for group in sampled.groups for c in group]
        # Every column of the data, None in rows without it (as a `datasets` table holds rows of different keys).
        columns = {k: [data.rows[i][k] for i in samples] for k in data.rows[0]  # (prepare gave every row every key)
                   if k not in RESERVED_REWARD_ARGS and k != self.config.prompt_column}
        columns |= sampled.columns
        per_round = self.optimizer_steps_per_round  # TrainerState counts optimizer steps, as TRL's does
        state = None
        if self.rewards.user_functions:  # the built-in rewards read no trainer_state (and it imports peft)
            from transformers import TrainerState

            state = TrainerState(global_step=(self.step - 1) * per_round, max_steps=self.config.max_steps * per_round,
                                 epoch=self.order.epochs_done())
        return self.rewards(sampled.prompts, sampled.completions, completion_ids, columns, state)

    def _log_completions(self, completion_ids: list[list[int]], per_func: torch.Tensor, advantages: torch.Tensor,
                         parts: list[RankRound]) -> None:
        """completions.jsonl rows of this round (rank 0 writes): prompt, completion, each reward, the advantage, and
        the columns the reward functions logged with log_extra (null for a rank's samples that logged none)."""
        texts = self.tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
        prompts = [prompt for part in parts for prompt in part.prompts]  # after an environment's reset
        columns = {column for part in parts for column in part.logged_columns}
        extra = {column: [] for column in columns}
        for part in parts:
            n = sum(len(group) for group in part.groups)
            for column in columns:
                extra[column].extend(part.logged_columns.get(column, [None] * n))
        names = self.rewards.metric_names
        self.log.log_completions(self.step, [
            {"prompt": prompts[k], "completion": texts[k],
             **{f"rewards/{name}": per_func[k, j].item() for j, name in enumerate(names)},
             "advantage": advantages[k].item(), **{column: values[k] for column, values in extra.items()}}
            for k in range(len(texts))])

    def _update(self, rollout: Rollout) -> dict:
        """num_iterations passes over the round. Each global micro-batch (per_device_train_batch_size * K samples
        of the plan one process would make) is cut into K shares; rank r trains on share r with the loss scaled so
        that the gradients, averaged over ranks by DDP / FSDP, are those of the whole micro-batch.

        TRL's token masks (top_entropy_quantile, off_policy_mask_threshold) go to the loss as TokenMasks, with the
        global micro-batch's share token counts: its entropy quantile and the bonus's token count are then what one
        process computes on the whole micro-batch. Every micro-batch of an optimizer step applies the entropy
        coefficient the step starts with: entropy_coef, or with use_adaptive_entropy `self.entropy_control`'s, which
        the step's entropy over its bonus tokens (all micro-batches, all ranks: one exchange) then updates."""
        from fastgrpo.train.policy_loss import BONUS_ENTROPY, ROUTER_LOSS, TokenMasks

        config, world = self.config, self.world
        self.train_module.train()
        size, K = config.per_device_train_batch_size, world.size
        lengths = [len(p) + len(c) for p, c in zip(rollout.prompt_ids, rollout.completion_ids, strict=True)]
        tokens = [sum(m) for m in rollout.loss_mask]  # loss tokens per sample
        # TRL's dapo/cispo normaliser: the loss tokens of the round, spread over its optimizer steps.
        num_items = sum(tokens) * config.gradient_accumulation_steps / config.steps_per_generation
        token_normalised = config.loss_type in TOKEN_NORMALISED_LOSS_TYPES
        control = self.entropy_control if config.use_adaptive_entropy else None
        bonus = config.entropy_coef != 0.0 or control is not None  # TRL's _entropy_bonus_enabled: logs policy_loss
        masked = config.top_entropy_quantile < 1.0 or config.off_policy_mask_threshold is not None
        metrics, weights, losses, grad_norms, coefficients = defaultdict(list), [], [], [], []
        for iteration in range(config.num_iterations):
            shuffle = torch.Generator().manual_seed(self._seed("shuffle", iteration))
            for step_batches in micro_batches(lengths, size * world.size, config.gradient_accumulation_steps,
                                              shuffle):
                step_options = self.loss_options
                if control is not None:  # the coefficient of this step, scaled as model_loss_options scales it
                    coef = control.applied()
                    coef = coef / config.gradient_accumulation_steps if token_normalised else coef
                    step_options = dataclasses.replace(step_options, entropy_coef=coef)
                step_loss, window = 0.0, []  # window: per micro-batch [entropy sum, count] over its bonus tokens
                for j, whole in enumerate(step_batches):
                    index = whole[world.rank * size : (world.rank + 1) * size]
                    mb = micro_batch(rollout, index, self.device)
                    scale, options = self._share_scale(whole, index, tokens, step_options)
                    masks = None
                    if masked:  # the bonus is then the masks': this share's entropy over the global bonus tokens
                        shares = tuple(sum(tokens[i] for i in whole[r * size : (r + 1) * size]) for r in range(K))
                        sampled = None  # the sampler's logprobs
                        if rollout.sampling_logps is not None and config.off_policy_mask_threshold is not None:
                            sampled = torch.nn.utils.rnn.pad_sequence(
                                [rollout.sampling_logps[i] for i in index], batch_first=True).to(self.device)  # [b, T]
                        masks = TokenMasks(config.top_entropy_quantile, config.off_policy_mask_threshold,
                                           step_options.entropy_coef * K / scale if scale else 0.0,
                                           shares if K > 1 else (), sampled)
                        options = dataclasses.replace(options, entropy_coef=0.0)
                    last = j == len(step_batches) - 1
                    with nullcontext() if last or self.parallelism != "ddp" else self.train_module.no_sync():
                        loss, micro_metrics = self.train_module(
                            mb, options, num_items if token_normalised else None, masks)
                        entropy = micro_metrics.pop(BONUS_ENTROPY, None)
                        router = micro_metrics.pop(ROUTER_LOSS, None)  # an MoE's coef x load-balancing loss
                        policy = micro_metrics.pop("policy_loss", None)
                        if bonus:  # TRL's policy_loss: the loss before the bonus
                            if policy is None:
                                policy = loss + options.entropy_coef * micro_metrics["entropy"]
                            micro_metrics["policy_loss"] = policy * (scale / world.size)
                        if not token_normalised:
                            loss = loss / config.gradient_accumulation_steps
                        loss = loss * scale
                        if router is not None:  # TRL's: / accumulation steps, each process's own (DDP averages them)
                            loss = loss + router / config.gradient_accumulation_steps
                        loss.backward()
                    step_loss = step_loss + loss.detach() / world.size
                    for key, value in micro_metrics.items():
                        metrics[key].append(value.detach())
                    weights.append((sum(tokens[i] for i in index), len(index)))
                    if control is not None:
                        if entropy is None:  # the fused loss: the bonus tokens are the loss tokens
                            n = micro_metrics["entropy"].new_tensor(float(sum(tokens[i] for i in index)))
                            entropy = torch.stack([micro_metrics["entropy"] * n, n])
                        window.append(entropy.detach())
                max_norm = config.max_grad_norm if config.max_grad_norm > 0 else math.inf
                grad_norms.append(distributed.full_tensor(torch.nn.utils.clip_grad_norm_(self.parameters, max_norm)))
                check_step(self.step, step_loss, grad_norms[-1], world, self.model, self._last_checkpoint)
                self.optimizer.step()
                self.scheduler.step()
                self.optimizer.zero_grad(set_to_none=True)
                losses.append(step_loss)
                if control is not None:
                    summed, count = map(sum, zip(*world.gather(torch.stack(window).sum(0).tolist()), strict=True))
                    control.update(summed / max(count, 1.0))
                if bonus:
                    coefficients.append(config.entropy_coef if control is None else control.coef)
        # One device sync (and with several processes one exchange) for all the metrics of the round.
        local = {"loss": torch.stack(losses).tolist(), "grad_norm": torch.stack(grad_norms).tolist(),
                 **{key: torch.stack(values).tolist() for key, values in metrics.items()}}
        merged = merge_metrics(world.gather((local, weights)), config.importance_sampling_level == "sequence")
        out = {key: nanmean(values) for key, values in merged.items()}
        if self.policy.routing is not None:  # (the engine's calls leave routes alone; nothing else should replay)
            self.policy.routing.stop()
        if coefficients:  # TRL's entropy_coef: the coefficient after each optimizer step (the same on every rank)
            out["entropy_coef"] = nanmean(coefficients)
        return out

    def _share_scale(self, whole: list[int], index: list[int], tokens: list[int],
                     options: LossConfig | None = None) -> tuple[float, LossConfig]:
        """(the factor on this rank's share of a global micro-batch, its loss options) such that the gradients,
        averaged over K ranks, are those of one process's loss on the whole micro-batch (the loss type's
        LossType.share_scale). The entropy bonus is a mean over the micro-batch's tokens: factor K * (share's
        tokens) / (micro-batch's tokens), folded into its coefficient where the loss's factor differs. `options`:
        the step's loss options (default the run's; use_adaptive_entropy changes the coefficient by step)."""
        K = self.world.size
        config = self.loss_options if options is None else options
        if K == 1:
            return 1.0, config
        share = K * sum(tokens[i] for i in index) / max(sum(tokens[i] for i in whole), 1)
        scale = config.kind.share_scale(K, share)
        if config.entropy_coef != 0.0 and scale != 0.0 and share != scale:
            config = dataclasses.replace(config, entropy_coef=config.entropy_coef * share / scale)
        return float(scale), config

    @torch.no_grad()
    def _logprobs(self, module: torch.nn.Module, rollout: Rollout) -> tuple[list[torch.Tensor], tuple[int, int]]:
        """Per sample [T_i] fp32 logprobs of its completion under `module` (a PolicyLoss; eval mode, no grad), and
        (routes where the model's own experts differ from the sampler's, routes compared) over every rank (MoE with
        the engine's routes; else (0, 0)). Chunks of per_device_train_batch_size samples are dealt to the ranks in
        turn, then gathered."""
        was_training = module.training
        routing = module.routing
        if routing is not None:
            routing.take_counts()  # (what earlier forwards counted is not this pass's)
        module.eval()
        size, K = self.config.per_device_train_batch_size, self.world.size
        starts = range(self.world.rank * size, len(rollout), size * K)
        out = {}
        for start in starts:
            mb = micro_batch(rollout, list(range(start, min(start + size, len(rollout)))), self.device)
            logps = module.logprobs(mb, temperature=self.config.temperature)  # [b, T]
            out |= {i: row[: len(rollout.completion_ids[i])].float().cpu() for row, i in zip(logps, mb.index,
                                                                                                 strict=True)}
        module.train(was_training)
        counts = (0, 0)
        if routing is not None:
            counts = routing.take_counts()
            routing.stop()
        parts = self.world.gather((out, counts))  # one process: its own
        for part, _ in parts:
            out |= part
        return [out[i] for i in range(len(rollout))], tuple(sum(c[k] for _, c in parts) for k in range(2))

    def _reference_logprobs(self, rollout: Rollout) -> list[torch.Tensor]:
        if self.reference is not None:
            return self._logprobs(self.reference, rollout)[0]
        with self.model.disable_adapter():  # LoRA: the base model is the reference
            return self._logprobs(self.policy, rollout)[0]

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


# Metrics of a micro-batch that are not a mean over its loss tokens: how the shares of a global micro-batch combine.
SUMMED = ("loss", "policy_loss")  # already scaled per share
SAME = ("grad_norm",)  # the same on every rank


def merge_metrics(parts: list[tuple[dict, list]], sequence_level: bool) -> dict[str, list[float]]:
    """Per rank (its metrics per micro-batch, (loss tokens, samples) per micro-batch) -> per global micro-batch the
    value one process would log for it: loss terms summed over shares, minima and maxima over shares, means over
    tokens (over samples for sequence-level ratios) weighted by the shares' counts. One rank: its own values."""
    if len(parts) == 1:
        return parts[0][0]
    merged = {}
    for key in parts[0][0]:
        columns = list(zip(*(values[key] for values, _ in parts), strict=True))  # per micro-batch, per rank
        if key in SAME:
            merged[key] = [column[0] for column in columns]
        elif key in SUMMED:
            merged[key] = [sum(column) for column in columns]
        elif key.endswith(("_min", "/min", "_max", "/max")):
            pick = min if key.endswith(("_min", "/min")) else max
            merged[key] = [pick((v for v in column if not math.isnan(v)), default=math.nan) for column in columns]
        else:
            k = 1 if sequence_level and key in RATIO_METRICS else 0
            counts = list(zip(*(weights for _, weights in parts), strict=True))  # per micro-batch, per rank
            merged[key] = [sum(v * w[k] for v, w in zip(column, count, strict=True) if w[k]) /
                           max(sum(w[k] for w in count), 1) for column, count in zip(columns, counts, strict=True)]
    return merged
