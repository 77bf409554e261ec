"""`fastgrpo.integrations.trl.FastGRPOTrainer` trains exactly as stock `trl.GRPOTrainer` (trl 1.16).

Each case trains a tiny fp32 Qwen2 (built from a config, saved to a temporary folder, with a word-level tokenizer)
for two optimizer steps twice, once with `GRPOTrainer` and once with `FastGRPOTrainer`, from the same seed, on CPU:
sampling, rewards and advantages are TRL's own in both, so the completions must come out identical (checked), and
then every micro-step's loss, every parameter's gradient at the first optimizer step, the parameters after two steps
and every logged loss metric (kl, entropy, clip_ratio/*, cispo_clip_ratio) must agree.

The optimizer is plain SGD without gradient clipping: the parameters then move by lr x the gradient, so comparing
them after two steps checks the gradients of step two too (Adam's first steps move every weight by about +-lr
whatever the gradient, and clipping hides a wrong overall scale such as the accumulation normaliser).

Parametrization: every fastgrpo loss type runs twice, with complementary settings of four two-valued axes (beta 0 /
0.04, token / sequence importance level, num_iterations 1 / 2, gradient accumulation 1 / 2), drawn from four base rows
(`_ROWS`) that cover every pair of values of every two axes. dapo / cispo (the loss types normalised by
`num_items_in_batch`) accumulate over steps_per_generation = 4 instead of 2, so TRL's generation-batch rescaling is
not 1. Separate cases: fastgrpo's Triton kernels (interpreted on CPU), two processes over gloo (DDP; FSDP2 with an
untied, a tied and a LoRA model), LoRA (the reference = adapters disabled), a bf16 model with cast_lm_head_to_fp32,
top_entropy_quantile < 1, off_policy_mask_threshold, mask_truncated_completions, evaluation; the hidden states read
are the final-norm ones (Qwen2, Llama); the options that must raise; the version check.
"""

import os
import subprocess
import sys

import pytest

pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

import torch  # noqa: E402
from accelerate.state import PartialState  # noqa: E402
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin  # noqa: E402
from helpers import tiny_config, torch_threads, word_tokenizer  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM  # noqa: E402
from trl import GRPOTrainer  # noqa: E402
from trl_helpers import (  # noqa: E402
    _MAX_DIFF,
    BATCH,
    EXTRA,
    GRAD_REL,
    LOSS_TOL,
    LR,
    METRIC_PREFIXES,
    VOCAB_WORDS,
    _assert_mixed_lengths,
    _assert_same_training,
    _dataset,
    _initial,
    _record,
    _save_tiny_qwen2,
    _train,
)

from fastgrpo.integrations.trl import REFUSALS, FastGRPOTrainer, check_trl_version  # noqa: E402
from fastgrpo.loss_config import CLIP_LOSS_TYPES, LOSS_TYPES, TOKEN_NORMALISED_LOSS_TYPES  # noqa: E402

# (beta > 0, sequence level, num_iterations 2, accumulation 2): four rows whose complements complete a covering
# array of strength 2 over the four axes.
_ROWS = [(0, 0, 0, 0), (0, 0, 1, 1), (0, 1, 0, 1), (0, 1, 1, 0)]


def _axes(loss_type, row):
    beta, sequence, mu2, accumulate = row
    per_generation = 4 if loss_type in TOKEN_NORMALISED_LOSS_TYPES else 2
    return {"beta": 0.04 if beta else 0.0, "importance_sampling_level": "sequence" if sequence else "token",
            "num_iterations": 2 if mu2 else 1, "gradient_accumulation_steps": 2 if accumulate else 1,
            "steps_per_generation": per_generation if accumulate else 1}


CASES = [
    pytest.param(loss_type, options, id=f"{loss_type}-beta{options['beta']}-{options['importance_sampling_level']}"
                 f"-mu{options['num_iterations']}-gas{options['gradient_accumulation_steps']}"
                 f"-spg{options['steps_per_generation']}", marks=pytest.mark.slow if second else ())
    for i, loss_type in enumerate(LOSS_TYPES)
    for second, row in enumerate((_ROWS[i % 4], tuple(1 - v for v in _ROWS[i % 4])))  # the second row: slow
    for options in [_axes(loss_type, row)]
]

@pytest.fixture(scope="module", autouse=True)
def _one_thread_and_max_diffs():
    # Tiny tensors: intra-op threads only add OpenMP spin-waits on a 2-core machine shared with other processes.
    with torch_threads(1):
        yield
    if _MAX_DIFF:
        print("\nFastGRPOTrainer vs GRPOTrainer, max differences:")
        for what, value in sorted(_MAX_DIFF.items()):
            print(f"  {what:<14} {value:.3e}")


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """A tiny fp32 Qwen2 and its word-level tokenizer, saved offline."""
    path = tmp_path_factory.mktemp("trl_trainer")
    tokenizer = word_tokenizer(VOCAB_WORDS)
    _save_tiny_qwen2(path, tokenizer)
    return path, tokenizer


@pytest.mark.parametrize(("loss_type", "options"), CASES)
def test_training_matches_trl(workdir, loss_type, options):
    path, tokenizer = workdir
    options = {"loss_type": loss_type, **EXTRA[loss_type], **options}
    stock = _train(path, tokenizer, GRPOTrainer, **options)
    fast = _train(path, tokenizer, FastGRPOTrainer, **options)
    metrics = _assert_same_training(stock, fast, _initial(path))
    # The cases must reach the branches they name: a KL to a reference that has moved away, and, after an update
    # on the same completions (num_iterations 2), ratios away from 1 that clip.
    if options["beta"]:
        assert metrics[1]["kl"] > 0, metrics
    if options["num_iterations"] == 2 and loss_type in CLIP_LOSS_TYPES:
        assert max(m["clip_ratio/region_mean"] for m in metrics) > 0, metrics


# Two processes (DDP over gloo on CPU): each rank samples its own completions (TRL seeds per process), so the
# token counts differ across ranks and TRL's cross-process reductions (count-weighted means, gathered extremes,
# num_items_in_batch / num_processes) have to be reproduced, not just the local values.
DDP_CASES = {
    "grpo-sequence": dict(loss_type="grpo", **EXTRA["grpo"], importance_sampling_level="sequence", beta=0.04,
                          num_iterations=2),
    "dapo-token": dict(loss_type="dapo", **EXTRA["dapo"], beta=0.04, num_iterations=2, gradient_accumulation_steps=2,
                       steps_per_generation=4),
}


def _ddp_worker(path, out_dir):
    """One rank of test_ddp_matches_trl: the same comparisons as single-process runs, on this rank's view."""
    import json

    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    report = {"completions": {}}
    for name, options in DDP_CASES.items():
        stock = _train(path, word_tokenizer(VOCAB_WORDS), GRPOTrainer, **options)
        fast = _train(path, word_tokenizer(VOCAB_WORDS), FastGRPOTrainer, **options)
        assert stock.accelerator.num_processes == 2
        _assert_same_training(stock, fast, _initial(path), mixed_lengths=False)  # checked over both ranks
        report["completions"][name] = stock.completions
    report["max_diff"] = _MAX_DIFF
    (out_dir / f"rank{rank}.json").write_text(json.dumps(report))


@pytest.mark.slow
def test_ddp_matches_trl(workdir, tmp_path):
    import json

    path, _ = workdir
    _run_ranks("ddp", path, tmp_path)
    ranks = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    for name in DDP_CASES:  # else the cross-process reductions would see equal counts
        assert ranks[0]["completions"][name] != ranks[1]["completions"][name], name
        _assert_mixed_lengths(ranks[0]["completions"][name] + ranks[1]["completions"][name])
    for rank in ranks:
        for what, value in rank["max_diff"].items():
            _record(f"ddp {what}", value)


def _run_ranks(worker, *paths):
    """`_WORKERS[worker](*paths)` on two processes (gloo), started by torch.distributed.run; fails if a rank fails."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", __file__, worker,
           *map(str, paths)]
    out = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-4000:]


# FSDP2 (torch's fully_shard) on two processes over gloo, the model as accelerate shards it for GRPOConfig(fsdp=True,
# fsdp_config={"version": 2, ...}): the policy by accelerate's fsdp2_prepare_model (each decoder layer, the input
# embeddings, then the final norm and the lm_head, with the embeddings when tied, as one group that stays whole after
# its forward, then the root), the reference model (beta > 0) by TRL's prepare_fsdp (the root alone, resharded after
# its forward: FastGRPOTrainer gathers its lm_head weight for the no-grad reference logprobs).
# The tied model (Qwen2.5-0.5B's layout) has head weights of std 0.1: they are its input embeddings too, and at std 0.5
# every completion repeats the prompt's last word (equal rewards, zero advantages). Its weights move ~10x less per step
# than the untied model's (4.8e-4 at LR, one process), hence 10 x LR.
TIED_HEAD_STD = 0.1
FSDP_CASES = {  # name: (tied embeddings, LoRA, options)
    "grpo-sequence-untied": (False, False, DDP_CASES["grpo-sequence"]),
    "dapo-token-tied": (True, False, {**DDP_CASES["dapo-token"], "learning_rate": 10 * LR}),
    "dapo-lora": (False, True, dict(loss_type="dapo", beta=0.04, num_iterations=2, learning_rate=0.1)),
}


def _lora_config():
    import peft

    return peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj"], lora_dropout=0.0)


def _fsdp2(**config):
    """GRPOConfig options for FSDP2 (a new fsdp_config each time: TrainingArguments edits it in place)."""
    return dict(fsdp=True, fsdp_config={"version": 2, **config})


def _fsdp_on_cpu(cls):
    """cls with accelerate's FSDP on CPU. accelerate turns FSDP on for accelerator devices only (AcceleratorState keeps
    DistributedType.MULTI_CPU whatever the fsdp_plugin, accelerate 1.15 state.py), though torch's fully_shard runs on
    CPU over gloo; the built Accelerator's state is set to what it is on GPUs: FSDP, with the plugin transformers makes
    from fsdp / fsdp_config. Everything after is the stock path (fsdp2_prepare_model, TRL's prepare_fsdp, the
    Trainer's FSDP branches), in both trainers."""

    class OnCPU(cls):
        def create_accelerator_and_postprocess(self):
            super().create_accelerator_and_postprocess()
            state = self.accelerator.state
            state.fsdp_plugin = FullyShardedDataParallelPlugin(**self.args.fsdp_plugin_args)
            state.distributed_type = PartialState._shared_state["distributed_type"] = DistributedType.FSDP
            self.is_fsdp_enabled = True

    return OnCPU


def _fsdp_worker(path, tied_path, out_dir):
    """One rank of test_fsdp2_matches_trl: the comparisons of _assert_same_training on gathered parameters and
    gradients, then the refusal of an lm_head resharded after its forward."""
    import json

    from torch.distributed.fsdp import FSDPModule, fully_shard

    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    report = {"completions": {}}
    layers = _fsdp2(auto_wrap_policy="TRANSFORMER_BASED_WRAP", transformer_layer_cls_to_wrap=["Qwen2DecoderLayer"])
    for name, (tied, lora, options) in FSDP_CASES.items():
        folder = tied_path if tied else path
        kwargs = dict(**layers, **options, peft_config=_lora_config() if lora else None)
        stock, fast = (_train(folder, word_tokenizer(VOCAB_WORDS), _fsdp_on_cpu(cls), **kwargs)
                       for cls in (GRPOTrainer, FastGRPOTrainer))
        for run in (stock, fast):  # sharded at rest, the reference model too (LoRA: the adapters disabled)
            head, embeddings = run.model.get_output_embeddings(), run.model.get_input_embeddings()
            assert isinstance(run.model, FSDPModule) and isinstance(head.weight, DTensor)
            assert (head.weight is embeddings.weight) == tied
            assert lora or isinstance(run.ref_model, FSDPModule) and isinstance(run.ref_model.lm_head.weight, DTensor)
        if lora:  # the adapters as initialised (B = 0, A random)
            untrained = _train(folder, word_tokenizer(VOCAB_WORDS), _fsdp_on_cpu(GRPOTrainer), train=False, **kwargs)
            initial = {n: p.detach().clone() for n, p in untrained.model.named_parameters()}
        else:
            initial = _initial(folder)
        metrics = _assert_same_training(stock, fast, initial, mixed_lengths=False)  # checked over both ranks
        assert metrics[1]["kl"] > 0
        assert not lora or all("lora_" in n for n in stock.first_grads), sorted(stock.first_grads)
        report["completions"][name] = stock.completions
    # A model sharded by hand (accelerate and TRL leave an FSDPModule as it is) whose lm_head is a group of its own,
    # resharded after its forward: refused at the loss, the first read of the weight with beta 0 and num_iterations 1.
    model = Qwen2ForCausalLM.from_pretrained(path, dtype=torch.float32)
    for module in (*model.model.layers, model.lm_head, model):
        fully_shard(module)
    with pytest.raises(ValueError, match="FastGRPOTrainer does not support an lm_head that FSDP2 reshards"):
        _train(path, word_tokenizer(VOCAB_WORDS), _fsdp_on_cpu(FastGRPOTrainer), model=model,
               **_fsdp2(auto_wrap_policy="NO_WRAP"))
    report["max_diff"] = _MAX_DIFF
    (out_dir / f"rank{rank}.json").write_text(json.dumps(report))


@pytest.mark.slow
def test_fsdp2_matches_trl(workdir, tmp_path):
    """FSDP2 on two processes (FSDP_CASES): an untied and a tied model and a LoRA adapter, all with a KL to a reference,
    train as in TRL; FastGRPOTrainer reads the lm_head weight right after the model's forward, whole as FSDP2 leaves
    it, and refuses an lm_head that FSDP2 reshards after its forward. accelerate refuses FSDP on CPU silently (it
    trains with DDP instead), so both trainers switch it on after building their Accelerator (`_fsdp_on_cpu`)."""
    import json

    pytest.importorskip("peft")
    path, tokenizer = workdir
    _save_tiny_qwen2(tmp_path / "tied", tokenizer, head_std=TIED_HEAD_STD, tie_word_embeddings=True)
    _run_ranks("fsdp", path, tmp_path / "tied", tmp_path)
    ranks = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    for name in FSDP_CASES:
        assert ranks[0]["completions"][name] != ranks[1]["completions"][name], name
        _assert_mixed_lengths(ranks[0]["completions"][name] + ranks[1]["completions"][name])
    for rank in ranks:
        for what, value in rank["max_diff"].items():
            _record(f"fsdp {what}", value)


_WORKERS = {"ddp": _ddp_worker, "fsdp": _fsdp_worker}


def test_lora_matches_trl(workdir):
    """PEFT: a LoRA adapter on the backbone trains as in TRL; the reference (beta > 0) has the adapters disabled."""
    pytest.importorskip("peft")
    path, tokenizer = workdir
    lora = _lora_config()
    options = dict(loss_type="dapo", beta=0.04, num_iterations=2, learning_rate=0.1)  # LoRA's B starts at 0
    stock = _train(path, tokenizer, GRPOTrainer, peft_config=lora, **options)
    fast = _train(path, tokenizer, FastGRPOTrainer, peft_config=lora, **options)
    initial = {name: p.detach().clone() for name, p in _train(path, tokenizer, GRPOTrainer, peft_config=lora,
                                                               train=False, **options).model.named_parameters()}
    metrics = _assert_same_training(stock, fast, initial)
    assert all("lora_" in name for name in stock.first_grads), sorted(stock.first_grads)
    assert metrics[1]["kl"] > 0  # step 2: the adapter has moved the policy away from the adapter-free reference


def test_bf16_model_with_fp32_lm_head_matches_trl(workdir):
    """cast_lm_head_to_fp32 on a bf16 model under bf16 autocast: TRL runs the head in fp32 on fp32-cast hidden states,
    and so does FastGRPOTrainer (it reads the fp32 weight and casts the hidden states to it). The bf16 backbone is
    the same code in both, so the only differences are the head's fp32 rounding, as in the fp32 cases."""
    path, tokenizer = workdir
    options = dict(loss_type="dapo", beta=0.04, num_iterations=2, cast_lm_head_to_fp32=True, bf16=True)
    stock, fast = (_train(path, tokenizer, cls, model=Qwen2ForCausalLM.from_pretrained(path, dtype=torch.bfloat16),
                          **options) for cls in (GRPOTrainer, FastGRPOTrainer))
    assert stock.model.lm_head.weight.dtype == torch.float32 and stock.model.model.norm.weight.dtype == torch.bfloat16
    _assert_same_training(stock, fast, {name: p.to(torch.bfloat16) for name, p in _initial(path).items()})


@pytest.mark.parametrize(("loss_type", "level"), [("grpo", "token"),
                                                  pytest.param("bnpo", "sequence", marks=pytest.mark.slow)])
def test_top_entropy_quantile_matches_trl(workdir, loss_type, level):
    path, tokenizer = workdir
    options = dict(loss_type=loss_type, **EXTRA[loss_type], importance_sampling_level=level, beta=0.04,
                   num_iterations=2, top_entropy_quantile=0.4)
    stock = _train(path, tokenizer, GRPOTrainer, **options)
    fast = _train(path, tokenizer, FastGRPOTrainer, **options)
    _assert_same_training(stock, fast, _initial(path))
    # The same tokens were kept, and some tokens were dropped, else the mask would be untested.
    assert len(fast.masks) == len(stock.masks) == len(stock.losses)
    for (_, keep, valid), (_, stock_keep, _) in zip(fast.masks, stock.masks, strict=True):
        assert torch.equal(keep, stock_keep)
        assert 0 < keep.sum() < valid.sum()


def test_off_policy_mask_matches_trl(workdir):
    """off_policy_mask_threshold drops negative-advantage sequences whose policy drifted from the sampling one."""
    path, tokenizer = workdir
    options = dict(loss_type="bnpo", **EXTRA["bnpo"], num_iterations=2, off_policy_mask_threshold=0.0)
    stock = _train(path, tokenizer, GRPOTrainer, **options)
    fast = _train(path, tokenizer, FastGRPOTrainer, **options)
    _assert_same_training(stock, fast, _initial(path))
    assert len(fast.masks) == len(stock.masks) == len(stock.losses)
    for (_, keep, _), (_, stock_keep, _) in zip(fast.masks, stock.masks, strict=True):
        assert torch.equal(keep, stock_keep)
    assert min(keep.sum() for _, keep, _ in stock.masks) < BATCH  # step 2 drops a sequence


@pytest.mark.parametrize(("loss_type", "extra"), [
    ("dapo", dict(gradient_accumulation_steps=2, steps_per_generation=4)),
    pytest.param("grpo", dict(gradient_accumulation_steps=2, num_iterations=2, beta=0.04), marks=pytest.mark.slow),
    pytest.param("bnpo", dict(num_iterations=2, off_policy_mask_threshold=0.0), marks=pytest.mark.slow),
])
def test_entropy_bonus_matches_trl(workdir, loss_type, extra):
    """TRL's static entropy bonus (entropy_coef): its gradient flows through the entropy into the head; the logged
    policy_loss is TRL's too."""
    path, tokenizer = workdir
    options = dict(loss_type=loss_type, **EXTRA[loss_type], entropy_coef=0.05, **extra)
    stock = _train(path, tokenizer, GRPOTrainer, **options)
    fast = _train(path, tokenizer, FastGRPOTrainer, **options)
    _assert_same_training(stock, fast, _initial(path))
    policy = [[log["policy_loss"] for log in run.state.log_history if "policy_loss" in log] for run in (fast, stock)]
    assert len(policy[1]) == 2
    torch.testing.assert_close(torch.tensor(policy[0]), torch.tensor(policy[1]), **LOSS_TOL)
    # The bonus changes the training: without it the first step's head gradient differs far beyond the tolerance.
    plain = _train(path, tokenizer, FastGRPOTrainer, **{**options, "entropy_coef": 0.0})
    head, plain_head = fast.first_grads["lm_head.weight"], plain.first_grads["lm_head.weight"]
    assert (head - plain_head).abs().max() > 100 * GRAD_REL * head.abs().max()


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "cispo"])
def test_importance_sampling_correction_matches_trl(workdir, loss_type):
    """vLLM's truncated IS ratio (TRL's `importance_sampling_ratio` input) weighs the policy term as in TRL: both
    trainers' `_compute_loss` on the same batch with a given ratio (vLLM itself is not installed here)."""
    path, tokenizer = workdir
    options = dict(loss_type=loss_type, **EXTRA[loss_type])  # beta 0: a KL to random reference logprobs explodes
    runs = [_train(path, tokenizer, cls, train=False, **options) for cls in (GRPOTrainer, FastGRPOTrainer)]
    torch.manual_seed(3)
    B, P, T = 4, 3, 5
    inputs = {"prompt_ids": torch.randint(3, VOCAB_WORDS, (B, P)), "prompt_mask": torch.ones(B, P, dtype=torch.long),
              "completion_ids": torch.randint(3, VOCAB_WORDS, (B, T)),
              "advantages": torch.tensor([1.0, -0.5, 0.3, -1.2]),
              "completion_mask": torch.tensor([[1] * 5, [1] * 3 + [0] * 2, [1] * 4 + [0], [1] * 5]),
              "importance_sampling_ratio": torch.rand(B, T) * 2}
    inputs["num_items_in_batch"] = inputs["completion_mask"].sum()
    results = []
    for trainer in runs:
        trainer.use_vllm, trainer.vllm_importance_sampling_correction = True, True
        trainer.current_gradient_accumulation_steps = 1
        trainer.model.zero_grad(set_to_none=True)
        loss = trainer._compute_loss(trainer.model, inputs)
        loss.backward()
        results.append((loss.detach(), {n: q.grad.clone() for n, q in trainer.model.named_parameters()}))
    (fast_loss, fast_grads), (stock_loss, stock_grads) = results[1], results[0]
    torch.testing.assert_close(fast_loss, stock_loss, **LOSS_TOL)
    for name, want in stock_grads.items():
        assert (fast_grads[name] - want).abs().max() <= GRAD_REL * want.abs().max(), name
    runs[1].vllm_importance_sampling_correction = False  # the ratio matters
    runs[1].model.zero_grad(set_to_none=True)
    assert not torch.allclose(runs[1]._compute_loss(runs[1].model, inputs).detach(), stock_loss, **LOSS_TOL)


@pytest.mark.parametrize("loss_type", ["dapo", "luspo"])
def test_mask_truncated_completions_matches_trl(workdir, loss_type):
    path, tokenizer = workdir
    options = dict(loss_type=loss_type, **EXTRA[loss_type], mask_truncated_completions=True,
                   gradient_accumulation_steps=2, steps_per_generation=2)
    stock = _train(path, tokenizer, GRPOTrainer, **options)
    fast = _train(path, tokenizer, FastGRPOTrainer, **options)
    _assert_same_training(stock, fast, _initial(path))  # checks that truncated and finished completions occur


def test_evaluation_matches_trl(workdir):
    """Evaluation logs TRL's loss and metrics: no accumulation, and dapo divides by num_items_in_batch /
    num_processes (in training also x accumulation / steps_per_generation, here 1 / 4: a mix-up would show as 4x)."""
    path, tokenizer = workdir
    options = dict(loss_type="dapo", beta=0.04, steps_per_generation=4, per_device_eval_batch_size=8,
                   eval_dataset=_dataset(8))
    results = [_train(path, tokenizer, cls, train=False, **options).evaluate()
               for cls in (GRPOTrainer, FastGRPOTrainer)]
    names = ("eval_loss", *("eval_" + prefix for prefix in METRIC_PREFIXES))
    stock, fast = ({k: v for k, v in r.items() if k.startswith(names)} for r in results)
    assert fast.keys() == stock.keys() and {"eval_loss", "eval_kl", "eval_entropy"} <= stock.keys()
    assert abs(stock["eval_loss"]) > 1e-3, stock
    for name, value in stock.items():
        torch.testing.assert_close(torch.tensor(fast[name]), torch.tensor(value), msg=name, **LOSS_TOL)


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_hidden_states_are_final_norm_outputs(workdir, arch):
    """The hidden states the trainer scores are the backbone's last_hidden_state (after the final norm), through
    TRL's patched forward (its fused lm_head) and with no logits produced."""
    path, tokenizer = workdir
    cls, config = (Qwen2ForCausalLM, Qwen2Config) if arch == "qwen2" else (LlamaForCausalLM, LlamaConfig)
    torch.manual_seed(0)
    model = cls(tiny_config(config, len(tokenizer)))
    trainer = _train(path, tokenizer, FastGRPOTrainer, model=model, train=False)
    ids = torch.randint(3, len(tokenizer), (3, 9))
    mask = torch.ones_like(ids)
    mask[0, :2] = 0  # left padding
    mask[1, 7:] = 0  # right padding
    want = trainer.model.model(input_ids=ids, attention_mask=mask).last_hidden_state[:, 4:8]
    seen = []  # (the last decoder layer's output, before the final norm; the lm_head's output shape)
    hooks = [trainer.model.model.layers[-1].register_forward_hook(lambda m, args, out: seen.append(out[:, 4:8])),
             trainer.model.lm_head.register_forward_hook(lambda m, args, out: seen.append(out.shape))]
    hidden = trainer._completion_hidden_states(trainer.model, ids, mask, 4)
    for hook in hooks:
        hook.remove()
    torch.testing.assert_close(hidden, want, rtol=0, atol=0)
    assert not torch.allclose(hidden, seen[0])  # not the state before the final norm
    assert seen[1] == torch.Size([3, 0, len(tokenizer)])  # the lm_head ran on no position


def _moe_model(vocab_size):
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    config = tiny_config(Qwen2MoeConfig, vocab_size)
    config.update(dict(num_experts=2, num_experts_per_tok=1, moe_intermediate_size=16,
                       shared_expert_intermediate_size=16))
    return Qwen2MoeForCausalLM(config)


def _prompt_tuning():
    peft = pytest.importorskip("peft")
    return peft.PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=2)


def _processor():
    """A ProcessorMixin (what marks a vision-language model to TRL) around the word tokenizer."""
    from transformers import ProcessorMixin

    class Processor(ProcessorMixin):
        attributes = ["tokenizer"]
        tokenizer_class = "PreTrainedTokenizerFast"

    return Processor(tokenizer=word_tokenizer(VOCAB_WORDS))


# (constructor options, text the error must hold, the REFUSALS entry it hits or None for a GRPOConfig check)
UNSUPPORTED = [
    pytest.param(dict(epsilon=-0.1), "epsilon_low must be a finite number >= 0", None, id="bad_epsilon"),
    pytest.param(dict(loss_type="dr_grpo", max_completion_length=None), "needs max_completion_length", None,
                 id="dr_grpo"),
    pytest.param(dict(fsdp=True, fsdp_config={"version": 1}), "fsdp_version=1 (FSDP1)", "fsdp1_zero3", id="fsdp1"),
    pytest.param(dict(peft_config=_prompt_tuning), "PEFT prompt learning", "peft_prompt_learning",
                 id="prompt_tuning"),
    pytest.param(dict(processing_class=_processor), "vision-language models", "vision_language", id="vlm"),
    pytest.param(dict(model=_moe_model, router_aux_loss_coef=0.01), "router_aux_loss_coef=0.01",
                 "router_aux_loss_coef", id="moe_aux_loss"),
    pytest.param(dict(model_config={"lm_head_multiplier": 2.0}), "config.lm_head_multiplier=2.0", "logit_transform",
                 id="lm_head_multiplier"),
    pytest.param(dict(model_config={"tie_last_hidden_states": False}), "tie_last_hidden_states=False",
                 "tie_last_hidden_states", id="untied_last_hidden_state"),
]


@pytest.mark.parametrize(("options", "message", "refusal"), UNSUPPORTED)
def test_unsupported_options_raise_at_construction(workdir, options, message, refusal):
    path, tokenizer = workdir
    options = dict(options)
    load = lambda vocab_size: Qwen2ForCausalLM.from_pretrained(path, dtype=torch.float32)
    model = options.pop("model", load)(len(tokenizer))
    for name, value in options.pop("model_config", {}).items():
        setattr(model.config, name, value)
    for name in ("peft_config", "processing_class"):  # built here: the parameter list is built at collection
        if name in options:
            options[name] = options[name]()
    with pytest.raises(ValueError, match="FastGRPOTrainer") as error:
        _train(path, tokenizer, FastGRPOTrainer, model=model, train=False, **options)
    assert message in str(error.value)
    if refusal is not None:
        assert REFUSALS[refusal].reason in str(error.value)


def test_every_refusal_is_tested():
    assert {case.values[2] for case in UNSUPPORTED} - {None} == set(REFUSALS)


def test_trl_version_check():
    check_trl_version("1.16.0")
    check_trl_version("1.16.7")
    for version in ("1.15.2", "1.17.0", "2.0.0"):
        with pytest.raises(ImportError, match=f"supports trl .*1.16.0.*but trl {version} is installed"):
            check_trl_version(version)
    # The check runs when the module is imported.
    code = "import trl; trl.__version__ = '1.15.2'; import fastgrpo.integrations.trl"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode != 0
    message = "ImportError: fastgrpo.integrations.trl supports trl >=1.16.0,<1.17 (tested with 1.16.0), but trl 1.15.2"
    assert message in out.stderr, out.stderr[-2000:]


if __name__ == "__main__":  # a rank of test_ddp_matches_trl or test_fsdp2_matches_trl, started by torch.distributed.run
    from pathlib import Path

    _WORKERS[sys.argv[1]](*map(Path, sys.argv[2:]))
