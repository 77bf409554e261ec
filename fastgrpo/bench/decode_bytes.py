"""Bytes a decode step moves on a GPU, per decoder layer and for the rest of the step, counted op by op.

The engine's fused layers and sampler against transformers' modules and the PyTorch sampler
(fastgrpo.bench.memory_trace.count_decode_bytes, on fake CPU tensors at real shapes: nothing runs, nothing is
allocated). Times are bytes over 3.35 TB/s (H100 SXM HBM3 at peak): a model on paper, not a measurement.

    fastgrpo bench decode-bytes          # Qwen2.5-1.5B and Qwen2.5-7B, 512 sequences at context 768; ~30 s
    fastgrpo bench decode-bytes --models qwen3.5-9b    # a hybrid: a row per kind of layer

A hybrid's recurrent layer (Qwen3.5's Gated DeltaNet) reads and writes each sequence's state every step: the state
column is that traffic at its least (each row's state read once and written once), beside what the engine's path
counts (it gathers the rows' states from their slots, steps them, and writes them back).

A mixture-of-experts layer's experts run as grouped GEMMs (transformers' grouped_mm experts, one launch for the
gate/up projection of every (token, expert) pair and one for the down projection): the experts column is what those
ops are handed, every expert's weights, the most the kernel reads (it skips experts no row routes to). The least is
on paper, per number of rows R: the experts R rows hit, E (1 - (1 - k/E)^R) of E at k a token when routing is
uniform (what the load-balancing loss pushes towards), their weights read once; transformers' eager loop reads the
same weights but launches about 8 kernels per expert hit and reads the hit list back to the host every layer.

    fastgrpo bench decode-bytes --models qwen3-30b-a3b     # an MoE: its experts' bytes and their least per R

Writes <out-dir>/decode-bytes-<date>.md (and .json).
"""

import argparse
import datetime
import json
from pathlib import Path

from fastgrpo import bench as harness

HBM = 3.35e12  # bytes/s: H100 SXM HBM3 at peak
MB = 1e6


def add_arguments(parser: argparse.ArgumentParser) -> None:
    models = sorted(p.name for p in harness.MODELS.iterdir() if (p / "config.json").is_file())
    parser.add_argument("--models", nargs="+", choices=models, default=["qwen2.5-1.5b", "qwen2.5-7b"])
    parser.add_argument("--sequences", type=int, default=512)
    parser.add_argument("--context", type=int, default=768)
    parser.add_argument("--out-dir", default="benchmarks/results", help="where the .json and .md results go")


def experts_hit(num_experts: int, top_k: int, rows: int) -> float:
    """Distinct experts `rows` tokens route to when each picks k of E uniformly: E (1 - (1 - k/E)^rows)."""
    return num_experts * (1 - (1 - top_k / num_experts) ** rows)


def experts_on_paper(models: list[str], batches=(1, 16, 64, 512), itemsize: int = 2) -> list[str]:
    """The MoE models' least expert bytes per layer and decode step, by rows R (bf16 weights, uniform routing)."""
    from transformers import AutoConfig

    from fastgrpo.train.shapes import model_shapes

    lines = []
    for name in models:
        shapes = model_shapes(AutoConfig.from_pretrained(harness.MODELS / name))
        layer = next((layer for layer in shapes.per_layer if layer.experts), None)
        if layer is None:
            continue
        per_expert = layer.expert_weights // layer.experts * itemsize  # gate, up and down of one expert
        moe_layers = sum(1 for layer in shapes.per_layer if layer.experts)
        if not lines:
            lines = ["", "Experts on paper (bf16; routing uniform; R rows a step): the experts R rows hit, their "
                     "weights read once per layer, and the step's time for them at 3.35 TB/s. A step of R tokens "
                     "must read at least these; the grouped GEMMs read them and skip the others; the eager loop "
                     "reads the same with about 8 launches per expert hit.", "",
                     "| model | R | experts hit of E (k a token) | expert weights per layer | all MoE layers / HBM | "
                     "eager loop launches per layer |", "|---|---|---|---|---|---|"]
        for R in batches:
            hit = experts_hit(layer.experts, layer.top_k, R)
            lines.append(f"| {name} | {R} | {hit:.1f} of {layer.experts} ({layer.top_k}) | "
                         f"{hit * per_expert / MB:.0f} MB | {moe_layers * hit * per_expert / HBM * 1e3:.2f} ms | "
                         f"~{8 * hit:.0f} |")
    return lines


def run(args: argparse.Namespace) -> dict:
    from transformers import AutoConfig

    from fastgrpo.bench.memory_trace import count_decode_bytes

    for option, value in (("--sequences", args.sequences), ("--context", args.context)):
        if value < 1:
            raise SystemExit(f"{option} must be >= 1, got {value}")
    harness.check_out_dir(args.out_dir)
    rows, record = [], {}
    for name in args.models:
        config = AutoConfig.from_pretrained(harness.MODELS / name)
        kinds = list(dict.fromkeys(getattr(config.get_text_config(), "layer_types", None) or [None]))
        per_kind = {kind: (config.get_text_config().layer_types.count(kind) if kind else config.num_hidden_layers)
                    for kind in kinds}  # fmt: skip
        counts = {(kind, path): count_decode_bytes(harness.MODELS / name, fused=path == "fused",
                                                   num_sequences=args.sequences, context_length=args.context,
                                                   layer_type=kind if len(kinds) > 1 else None)
                  for kind in kinds for path in ("transformers", "fused")}  # fmt: skip
        if len(kinds) == 1:
            record[name] = {"num_hidden_layers": config.num_hidden_layers,
                            **{path: c for (_, path), c in counts.items()}}
        else:
            record[name] = {"layers": per_kind, **{f"{kind}, {path}": c for (kind, path), c in counts.items()}}
        heads = {path: c["head"] for (kind, path), c in counts.items() if c["head"] is not None}
        steps = {path: sum(head.values()) for path, head in heads.items()}
        for (kind, path), c in counts.items():
            layer, layers = c["layer"], per_kind[kind]
            non_gemm = layer["elementwise"] + layer["fused"]
            steps[path] += layers * (non_gemm + layer["gemm"] + layer["experts"] + c["attention_kv_bytes"])
        for (kind, path), c in counts.items():
            layer, layers = c["layer"], per_kind[kind]
            non_gemm = layer["elementwise"] + layer["fused"]
            sampler = heads[path]["elementwise"] + heads[path]["fused"]
            label = name if len(kinds) == 1 else f"{name}, {layers} {kind} layers"
            rows.append(f"| {label} | {path} | {sum(c['layer_ops'].values())} ({c['layer_ops']['gemm']}) | "
                        f"{non_gemm / MB:.1f} MB | {layer['gemm'] / MB:.1f} MB | {layer['experts'] / MB:.0f} MB | "
                        f"{c['attention_kv_bytes'] / MB:.0f} MB | {c['state_bytes'] / MB:.0f} MB | "
                        f"{sampler / MB:.0f} MB | {layers * non_gemm / HBM * 1e3:.2f} ms | "
                        f"{sampler / HBM * 1e3:.2f} ms | {steps[path] / HBM * 1e3:.2f} ms |")
    date = datetime.date.today().isoformat()
    lines = [
        f"# Decode step bytes, counted ({date})",
        "",
        f"`fastgrpo bench decode-bytes`: one decode step of {args.sequences} sequences at context {args.context}, "
        "bf16, counted op by op on fake tensors (fastgrpo.bench.memory_trace.BytesMoved). *transformers*: the model's "
        "own modules with the paged attention function, then the PyTorch sampler over an fp32 copy of the logits; "
        "*fused*: the engine's decode layers with their CUDA kernels and the fused sampler. The attention kernel (the "
        "same on both) is the K/V column. A hybrid gets a row per kind of layer; its recurrent layers step their "
        "state from the rows' slots (counted in the non-GEMM bytes), and the state column is the least that takes "
        "(each row's state read and written once). The whole step's bytes are the model's: every kind of layer "
        "and the rest of the step. Times are bytes / 3.35 TB/s: on paper, not measured.",
        "",
        "| model | path | launches per layer (GEMMs) | per layer, besides GEMMs and attention | GEMMs per layer | "
        "experts' grouped GEMMs per layer | attention K/V per layer | recurrent state read + written per layer, at "
        "least | sampler + final norm | these layers' non-GEMM bytes / HBM | sampler / HBM | whole step's bytes / "
        "HBM |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
        *rows,
        *experts_on_paper(args.models),
    ]
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"decode-bytes-{date}.md").write_text("\n".join(lines) + "\n")
    (out / f"decode-bytes-{date}.json").write_text(json.dumps(record, indent=1) + "\n")
    print("\n".join(lines))
    return record
