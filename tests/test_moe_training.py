"""Mixture-of-experts models in `fastgrpo train`: the router's load-balancing loss (TRL's router_aux_loss_coef) and
LoRA on the experts (peft's target_parameters), on tiny random models built from transformers' configs
(family_helpers), fp32 on the CPU."""

import pytest
import torch
from family_helpers import GEMMA4_MOE, MOE, save_tiny_model, tiny_model
from train_helpers import make_config
from transformers import AutoModelForCausalLM

from fastgrpo.cli import main
from fastgrpo.loss import token_logprobs
from fastgrpo.train import TrainConfig, Trainer
from fastgrpo.train.lora import add_adapters
from fastgrpo.train.moe import load_balancing_loss, router_aux_loss_coef
from fastgrpo.train.policy_loss import completion_hidden, lm_head

# One round of 16 completions in 2 micro-batches, the raw gradient of its one optimizer step.
ONE_STEP = dict(max_steps=1, save_steps=0, eval_num_samples=1, max_grad_norm=0.0, max_completion_length=4)


def padded(sequences: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded input_ids [B, L] and attention_mask [B, L] of `sequences`."""
    L = max(map(len, sequences))
    ids = torch.tensor([s + [0] * (L - len(s)) for s in sequences])
    return ids, (torch.arange(L)[None] < torch.tensor([len(s) for s in sequences])[:, None]).long()


# -- the router's load-balancing loss ---------------------------------------------------------------------------


@pytest.mark.parametrize("family", MOE)
def test_load_balancing_loss_equals_the_models_own(family):
    """moe.load_balancing_loss of the backbone's router logits = the aux_loss the model's own forward returns, padding
    left out by the mask (the value and its gradient)."""
    model = tiny_model(family)
    ids, mask = padded([[3, 5, 7, 2, 9, 4, 1], [6, 6, 2], [8, 3, 11, 12, 5]])
    own = model(input_ids=ids, attention_mask=mask, output_router_logits=True).aux_loss
    (own_grad,) = torch.autograd.grad(own, [model.model.layers[0].mlp.router.weight if family == "gpt_oss"
                                             else model.model.layers[0].mlp.gate.weight])
    routers = model.model(input_ids=ids, attention_mask=mask, output_router_logits=True).router_logits
    ours = load_balancing_loss(routers, model.config.num_experts_per_tok, mask.view(-1) != 0)
    (our_grad,) = torch.autograd.grad(ours, [model.model.layers[0].mlp.router.weight if family == "gpt_oss"
                                             else model.model.layers[0].mlp.gate.weight])
    assert torch.allclose(ours, own, rtol=1e-6, atol=0) and torch.allclose(our_grad, own_grad, rtol=1e-5, atol=1e-9)
    unmasked = load_balancing_loss(routers, model.config.num_experts_per_tok)
    assert not torch.allclose(unmasked, own, rtol=1e-4, atol=0)  # the pads' routes would count


def one_step_gradient(config) -> tuple[Trainer, list[torch.Tensor], list[list[list[int]]]]:
    """Trains one round of `config`: (the trainer, the gradient at its optimizer step, each micro-batch's sequences)."""
    trainer = Trainer(config)
    gradients, batches = [], []
    step, forward = trainer.optimizer.step, trainer.policy.forward
    trainer.optimizer.step = lambda: gradients.append([p.grad.clone() for p in trainer.parameters]) or step()
    trainer.policy.forward = lambda mb, *args: batches.append(mb.sequences) or forward(mb, *args)
    trainer.train()
    return trainer, gradients[0], batches


@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_router_aux_loss_is_added_as_trl_adds_it(assets, tmp_path, loss_type):
    """TRL 1.16 adds router_aux_loss_coef x the micro-batch's aux_loss / gradient_accumulation_steps to each
    micro-batch's loss, whatever the loss type (dapo's is normalised by the step's tokens, grpo's by the accumulation
    steps). The same round with the coefficient 0.5 and 0: the gradients differ by exactly the coefficient's share of
    the gradient of the model's own aux_loss (full forward, padded micro-batches), and the logged loss by its value."""
    model = save_tiny_model("qwen3_moe", tmp_path / "qwen3_moe")
    runs = {}
    for coef in (0.5, 0.0):
        config = make_config({**assets, "model": model}, tmp_path / str(coef), loss_type=loss_type,
                             router_aux_loss_coef=coef, **ONE_STEP)
        runs[coef] = one_step_gradient(config)
    (trainer, gradient, batches), (plain, plain_gradient, plain_batches) = runs[0.5], runs[0.0]
    assert batches == plain_batches and len(batches) == config.gradient_accumulation_steps == 2
    assert plain.log.history[-1].get("aux_loss") is None
    own = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    auxes = []
    for sequences in batches:
        ids, mask = padded(sequences)
        auxes.append(own(input_ids=ids, attention_mask=mask, output_router_logits=True).aux_loss)
    (0.5 * sum(auxes) / config.gradient_accumulation_steps).backward()
    named = dict(own.named_parameters())
    want = [torch.zeros_like(p) if named[name].grad is None else named[name].grad  # the head: no aux gradient
            for name, p in trainer.model.named_parameters() if p.requires_grad]
    largest = max(w.abs().max().item() for w in want)
    errors = [(g - p - w).abs().max().item() for g, p, w in zip(gradient, plain_gradient, want, strict=True)]
    assert largest > 1e-3 and max(errors) < 1e-5 * largest, (max(errors), largest)  # fp32 sums in another order
    logged, plain_logged = trainer.log.history[-1], plain.log.history[-1]
    assert logged["aux_loss"] == pytest.approx(sum(a.item() for a in auxes) / len(auxes), rel=1e-6)
    assert logged["loss"] - plain_logged["loss"] == pytest.approx(0.5 * sum(a.item() for a in auxes) / 2, rel=1e-5)


def test_router_aux_loss_coef_defaults_to_the_models_own(tmp_path):
    """None takes the config's coefficient (TRL's rule): Qwen3-MoE's 0.001, OLMoE's 0.01; a dense model has none."""
    for family, want in (("qwen3_moe", 0.001), ("olmoe", 0.01), ("gpt_oss", 0.001), ("mistral", 0.0)):
        assert router_aux_loss_coef(None, tiny_model(family)) == want, family
    assert router_aux_loss_coef(0.0, tiny_model("qwen3_moe")) == 0.0
    trainer = Trainer(TrainConfig(model_name_or_path=save_tiny_model("qwen3_moe", tmp_path / "qwen3_moe"),
                                  dataset_name="builtin", output_dir=str(tmp_path / "run"), max_completion_length=4,
                                  report_to=["none"], disable_tqdm=True))
    assert trainer.policy.router_aux_loss_coef == 0.001 and trainer.reference is None  # (beta 0)


def test_router_aux_loss_coef_on_a_dense_model_is_one_line(assets, tmp_path, capsys):
    with pytest.raises(SystemExit) as stop:
        main(["train", "--model-name-or-path", assets["model"], "--dataset-name", assets["data"], "--output-dir",
              str(tmp_path / "run"), "--max-completion-length", "4", "--router-aux-loss-coef", "0.01"])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.count("\n") == 1, err
    assert err.startswith("fastgrpo train: error: --router-aux-loss-coef=0.01: Qwen2ForCausalLM is not a "
                          "mixture-of-experts model"), err
    with pytest.raises(SystemExit):
        main(["train", "--model-name-or-path", assets["model"], "--dataset-name", "builtin", "--router-aux-loss-coef",
              "-1"])
    assert "--router-aux-loss-coef must be None or >= 0" in capsys.readouterr().err


# -- LoRA per family ----------------------------------------------------------------------------------------------

ATTENTION = ["self_attn.k_proj", "self_attn.o_proj", "self_attn.q_proj", "self_attn.v_proj"]
MLP = ["mlp.down_proj", "mlp.gate_proj", "mlp.up_proj"]
EXPERTS = ["mlp.experts.down_proj", "mlp.experts.gate_up_proj"]
# family -> (the linear layers of a decoder layer with adapters, the parameters with adapters): what docs/training.md
# says. The routers (Qwen2-MoE's shared_expert_gate, Gemma 4's router.proj) and the output head have none.
DEFAULT_TARGETS = {
    **{family: (sorted(ATTENTION + MLP), []) for family in ("gemma", "gemma2", "gemma3_text", "mistral", "cohere")},
    "gemma4_text": (sorted(ATTENTION + MLP + ["per_layer_input_gate", "per_layer_projection"]), []),
    "gemma4_text moe": (sorted(ATTENTION + MLP + ["per_layer_input_gate", "per_layer_projection"]),
                        ["experts.down_proj", "experts.gate_up_proj"]),
    **{family: (ATTENTION, EXPERTS) for family in ("gpt_oss", "qwen3_moe", "mixtral", "olmoe")},
    "qwen2_moe": (sorted(ATTENTION + [f"mlp.shared_expert.{name}" for name in ("down_proj", "gate_proj", "up_proj")]),
                  EXPERTS),
}


def adapted(model: torch.nn.Module) -> tuple[list[str], list[str]]:
    """(the linear layers of decoder layer 0 with LoRA, its parameters with LoRA), by their names below the layer."""
    layer = next(m for name, m in model.named_modules() if name.endswith("layers.0"))
    modules, parameters = [], []
    for name, module in layer.named_modules():
        kind = type(module).__name__
        if type(module).__module__.startswith("peft.tuners.lora") and kind == "Linear":
            modules.append(name)
        elif kind == "ParamWrapper":
            parameters.append(f"{name.removesuffix('.base_layer')}.{module.parameter_name}")
    return sorted(modules), sorted(set(parameters))


@pytest.mark.parametrize("family", DEFAULT_TARGETS)
def test_lora_default_targets_per_family(family):
    model = tiny_model(family.split()[0], **(GEMMA4_MOE if family.endswith("moe") else {}))
    config = TrainConfig(model_name_or_path="unused", dataset_name="builtin", use_peft=True, lora_dropout=0.0)
    modules, parameters = adapted(add_adapters(config, model))
    assert (modules, parameters) == DEFAULT_TARGETS[family]
    assert all("lora_" not in name for name, _ in model.get_output_embeddings().named_parameters())


@pytest.mark.parametrize("family", ["gpt_oss", "qwen3_moe"])
def test_lora_on_experts_trains_and_the_reference_stays_the_base(assets, tmp_path, family):
    """A step changes every expert adapter (and no base weight); with the adapters off the policy scores a completion
    as the base model's own forward does (the reference), with them on it does not."""
    model = save_tiny_model(family, tmp_path / family)
    config = make_config({**assets, "model": model}, tmp_path, use_peft=True, lora_dropout=0.0, lora_r=4, beta=0.04,
                         learning_rate=1e-2, max_steps=2, save_steps=0, eval_num_samples=1)
    trainer = Trainer(config)
    assert trainer.ref_model is None
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    trainer.train()
    after = trainer.model.state_dict()
    experts = [k for k in before if ".experts." in k and "lora_B" in k]
    assert len(experts) == 2 * 2  # gate_up_proj and down_proj in each of the 2 layers
    assert all(not torch.equal(before[k], after[k]) for k in experts)
    assert all(torch.equal(before[k], after[k]) for k in before if "lora_" not in k)
    assert all(("lora_" in n) == p.requires_grad for n, p in trainer.model.named_parameters())

    base = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    sequence, prompt = [3, 5, 7, 2, 9, 4, 1, 8, 6, 10, 11], 4
    completion = torch.tensor(sequence[prompt:])
    want = base(input_ids=torch.tensor([sequence])).logits[0, prompt - 1 : -1].log_softmax(-1)
    want = want.gather(-1, completion[:, None])[:, 0]  # [T]
    weight, bias = lm_head(trainer.model)
    with torch.no_grad():
        with trainer.model.disable_adapter():
            hidden = completion_hidden(trainer.model, [sequence], [prompt], len(completion), False)[0]
            reference = token_logprobs(hidden, weight, completion, bias=bias)[0]
        hidden = completion_hidden(trainer.model, [sequence], [prompt], len(completion), False)[0]
        policy = token_logprobs(hidden, weight, completion, bias=bias)[0]
    assert torch.allclose(reference, want, atol=1e-5), (reference - want).abs().max()
    assert (policy - want).abs().max() > 1e-3


def test_no_lora_experts_leaves_them_frozen(tmp_path):
    model = tiny_model("qwen3_moe")
    config = TrainConfig(model_name_or_path="unused", dataset_name="builtin", use_peft=True, lora_experts=False)
    assert adapted(add_adapters(config, model)) == (ATTENTION, [])
    explicit = TrainConfig(model_name_or_path="unused", dataset_name="builtin", use_peft=True, lora_dropout=0.0,
                           lora_target_modules=["q_proj"], lora_target_parameters=["mlp.experts.down_proj"])
    assert adapted(add_adapters(explicit, tiny_model("qwen3_moe"))) == (["self_attn.q_proj"], ["mlp.experts.down_proj"])


def test_lora_dropout_with_experts_is_one_line(tmp_path, capsys):
    model = save_tiny_model("gpt_oss", tmp_path / "gpt_oss")
    with pytest.raises(SystemExit) as stop:
        main(["train", "--model-name-or-path", model, "--dataset-name", "builtin", "--output-dir",
              str(tmp_path / "run"), "--max-completion-length", "4", "--use-peft"])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.count("\n") == 1, err
    assert err.startswith("fastgrpo train: error: --lora-dropout 0.05: LoRA on the experts of GptOssForCausalLM "
                          "(--lora-experts, on by default: mlp.experts.gate_up_proj, mlp.experts.down_proj)"), err
    assert err.rstrip().endswith("set --lora-dropout to 0, or turn --lora-experts off to leave the experts frozen")


# -- experts as grouped GEMMs --------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", [*MOE, "qwen3_5_moe_text"])
def test_grouped_gemm_experts_equal_the_eager_loop(family):
    """transformers' grouped_mm experts (its default where torch has grouped_mm: the engine and the trainer run them)
    against its eager loop over the experts, fp32: the logits of 3 right-padded sequences and every parameter's
    gradient of a random projection of them."""
    model = tiny_model(family)
    assert model.config._experts_implementation == "grouped_mm"
    ids, mask = padded([[3 + (5 * i + j) % 12 for i in range(n)] for j, n in enumerate((7, 12, 4))])
    g = torch.randn(*ids.shape, model.config.vocab_size, generator=torch.Generator().manual_seed(0))
    results = {}
    for implementation in ("grouped_mm", "eager"):
        model.set_experts_implementation(implementation)
        model.zero_grad()
        logits = model(input_ids=ids, attention_mask=mask).logits
        (logits * g * mask[..., None]).sum().backward()
        results[implementation] = (logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()
                                                     if p.grad is not None})
    (grouped, grouped_grads), (eager, eager_grads) = results["grouped_mm"], results["eager"]
    torch.testing.assert_close(grouped, eager, atol=1e-5, rtol=1e-5)
    assert grouped_grads.keys() == eager_grads.keys() and any(".experts." in n for n in grouped_grads)
    for name, grad in grouped_grads.items():
        torch.testing.assert_close(grad, eager_grads[name], atol=1e-5, rtol=1e-4, msg=name)


def test_the_trainer_runs_grouped_gemm_experts(tmp_path):
    """A loaded MoE policy keeps transformers' grouped_mm experts (with LoRA on them too)."""
    model = save_tiny_model("qwen3_moe", tmp_path / "qwen3_moe")
    for lora in (False, True):
        trainer = Trainer(TrainConfig(model_name_or_path=model, dataset_name="builtin", max_completion_length=4,
                                      output_dir=str(tmp_path / f"run{lora}"), report_to=["none"], disable_tqdm=True,
                                      use_peft=lora, lora_dropout=0.0))
        net = trainer.engine.hf_model
        assert net.config._experts_implementation == "grouped_mm"
        trainer.folder.release(remove_new=True)
