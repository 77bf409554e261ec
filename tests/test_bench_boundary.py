"""The measurement tools stay beside the product: only fastgrpo/bench, fastgrpo/check and the `fastgrpo` command line
import fastgrpo.bench, and the command line imports a suite only when `fastgrpo bench` runs it."""

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "fastgrpo"


def bench_imports(source: str) -> list[int]:
    """The lines of `source` that import fastgrpo.bench (a statement, `from fastgrpo import bench`, or
    importlib.import_module of a constant name), lazy imports inside functions included."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names = [node.module or ""] + [f"{node.module}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) == "import_module":
            names = [arg.value for arg in node.args[:1] if isinstance(arg, ast.Constant)]
        else:
            continue
        if any(name == "fastgrpo.bench" or name.startswith("fastgrpo.bench.") for name in names):
            found.append(node.lineno)
    return found


def test_only_the_benchmarks_the_check_and_the_command_line_import_the_benchmarks():
    allowed = {PACKAGE / "cli.py"}
    tools = (PACKAGE / "bench", PACKAGE / "check")  # `fastgrpo check` times through the suites: a tool, not the product
    product = [p for p in PACKAGE.rglob("*.py") if not any(t in p.parents for t in tools) and p not in allowed]
    assert len(product) > 30
    found = [f"{p.relative_to(PACKAGE.parent)}:{line}" for p in product for line in bench_imports(p.read_text())]
    assert found == []
    assert bench_imports((PACKAGE / "cli.py").read_text()) == []  # its suites: module names, imported when they run


def test_the_check_sees_each_form_of_import():
    for form in ("import fastgrpo.bench.loss", "from fastgrpo import bench", "from fastgrpo.bench import MODELS",
                 "def f():\n    importlib.import_module('fastgrpo.bench.step')"):
        assert len(bench_imports(form)) == 1, form
    assert bench_imports("from fastgrpo import benchmark_notes, loss\nimport fastgrpo.sampling\n") == []


CHECK = """
import json, sys
from fastgrpo.cli import main

seen = {}
for argv in (["train", "--help"], ["plan", "--help"], ["bench", "decode-bytes", "--help"]):
    try:
        main(argv)
    except SystemExit:
        pass
    seen[" ".join(argv[:2])] = sorted(m for m in sys.modules if m.startswith("fastgrpo.bench"))
print(json.dumps(seen))
"""


def test_fastgrpo_train_never_imports_the_benchmarks():
    out = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, cwd=PACKAGE.parent)
    assert out.returncode == 0, out.stderr[-3000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["train --help"] == [] and seen["plan --help"] == []
    # `fastgrpo bench decode-bytes`: the harness and that suite, not the other suites
    assert "fastgrpo.bench.decode_bytes" in seen["bench decode-bytes"]
    assert "fastgrpo.bench.loss" not in seen["bench decode-bytes"]
    assert "--sequences" in out.stdout


def test_fastgrpo_bench_lists_every_suite(capsys):
    from fastgrpo.cli import SUITES, main

    with pytest.raises(SystemExit) as done:
        main(["bench", "--help"])
    assert done.value.code == 0
    text = capsys.readouterr().out
    assert all(name in text for name in SUITES)
    assert {"agent", "architectures", "cpu-memory", "decode-bytes", "memory-plan", "loss", "sampling", "trl",
            "step", "windows", "routing-replay"} == set(SUITES)
