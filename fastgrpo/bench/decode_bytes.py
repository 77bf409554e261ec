"""Bytes a decode step moves on a GPU, per decoder layer and for the rest of the step, counted op by op.

The engine's fused layers and sampler against transformers' modules and the PyTorch sampler
(fastgrpo.bench.memory_trace.count_decode_bytes, on fake CPU tensors at real shapes: nothing runs, nothing is
allocated). Times are bytes over 3.35 TB/s (H100 SXM HBM3 at peak): a model on paper, not a measurement.

    fastgrpo bench decode-bytes          # Qwen2.5-1.5B and Qwen2.5-7B, 512 sequences at context 768; ~30 s

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


def run(args: argparse.Namespace) -> dict:
    from transformers import AutoConfig

    from fastgrpo.bench.memory_trace import count_decode_bytes

    for option, value in (("--sequences", args.sequences), ("--context", args.context)):
        if value < 1:
            raise SystemExit(f"{option} must be >= 1, got {value}")
    harness.check_out_dir(args.out_dir)
    rows, record = [], {}
    for name in args.models:
        config = harness.MODELS / name
        layers = AutoConfig.from_pretrained(config).num_hidden_layers
        counts = {path: count_decode_bytes(config, fused=path == "fused", num_sequences=args.sequences,
                                           context_length=args.context) for path in ("transformers", "fused")}
        record[name] = {"num_hidden_layers": layers, **counts}
        for path, c in counts.items():
            layer, head = c["layer"], c["head"]
            non_gemm = layer["elementwise"] + layer["fused"]
            step = layers * (non_gemm + layer["gemm"] + c["attention_kv_bytes"]) + sum(head.values())
            sampler = head["elementwise"] + head["fused"]
            rows.append(f"| {name} | {path} | {sum(c['layer_ops'].values())} ({c['layer_ops']['gemm']}) | "
                        f"{non_gemm / MB:.1f} MB | {layer['gemm'] / MB:.1f} MB | "
                        f"{c['attention_kv_bytes'] / MB:.0f} MB | {sampler / MB:.0f} MB | "
                        f"{layers * non_gemm / HBM * 1e3:.2f} ms | {sampler / HBM * 1e3:.2f} ms | "
                        f"{step / HBM * 1e3:.2f} ms |")
    date = datetime.date.today().isoformat()
    lines = [
        f"# Decode step bytes, counted ({date})",
        "",
        f"`fastgrpo bench decode-bytes`: one decode step of {args.sequences} sequences at context {args.context}, "
        "bf16, counted op by op on fake tensors (fastgrpo.bench.memory_trace.BytesMoved). *transformers*: the model's "
        "own modules with the paged attention function, then the PyTorch sampler over an fp32 copy of the logits; "
        "*fused*: the engine's decode layers with their CUDA kernels and the fused sampler. The attention kernel (the "
        "same on both) is the K/V column. Times are bytes / 3.35 TB/s: on paper, not measured.",
        "",
        "| model | path | launches per layer (GEMMs) | per layer, besides GEMMs and attention | GEMMs per layer | "
        "attention K/V per layer | sampler + final norm | all layers' non-GEMM bytes / HBM | sampler / HBM | "
        "whole step's bytes / HBM |",
        "|---|---|---|---|---|---|---|---|---|---|",
        *rows,
    ]
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"decode-bytes-{date}.md").write_text("\n".join(lines) + "\n")
    (out / f"decode-bytes-{date}.json").write_text(json.dumps(record, indent=1) + "\n")
    print("\n".join(lines))
    return record
