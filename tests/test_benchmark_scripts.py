"""The benchmark scripts that reuse each other still agree on their interfaces.

``bench_qr_erase_e2e.py`` drives ``bench_methods.py``'s fine-tune, evaluation and MASC runner; when the latter was
rewritten for the fair benchmark, the former broke at its first call (an argument the new parser no longer had).
Running either script takes minutes, so this checks the seam: the arguments it passes parse, and the helpers it
calls exist with the parameters it passes.
"""

from __future__ import annotations

import importlib.util
import inspect

from .conftest import ROOT


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_qr_erase_e2e_drives_the_current_bench_methods():
    e2e, bm = _load("bench_qr_erase_e2e"), _load("bench_methods")
    args = e2e.parse_args(["--model", "some/model", "--authors", "3", "--out", "/tmp/x", "--seed", "2"])
    margs = e2e.methods_args(args, bm)  # an unknown option would exit here
    assert (margs.model, margs.authors, margs.out, margs.finetune_seed) == ("some/model", 3, "/tmp/x", 2)
    assert margs.masc_probe_size == 0 and margs.epochs == 5
    assert list(inspect.signature(bm.prepare_data).parameters)[:1] == ["args"]
    assert list(inspect.signature(bm.evaluate).parameters) == ["model", "tokenizer", "forget_ids", "retain_ids",
                                                               "args", "label"]
    assert list(inspect.signature(bm.run_one).parameters) == ["spec", "lr", "seed", "args", "ctx"]
    assert bm.parse_spec("masc[retain_loss=ce]") == ("masc", {"retain_loss": "ce"})
    assert {"forget_probability", "model_utility"} <= set(bm.SUMMARY_KEYS)


def test_benchmark_outputs_default_outside_the_repository():
    """A benchmark run with its defaults must not leave untracked files in the tree."""
    import re

    for script in sorted((ROOT / "benchmarks").glob("bench_*.py")):
        for default in re.findall(r'add_argument\("--out", default=([^,)]+)', script.read_text()):
            assert default == "None" or default.startswith("bench_output_dir("), (script.name, default)


def test_checkpoint_benchmark_takes_the_real_model_options():
    """bench_checkpoints.py's SmolLM2 mode (the figures in benchmarks/README.md) parses as documented; a deletion
    name it does not know is refused before any model is loaded."""
    import pytest

    bench = _load("bench_checkpoints")
    a = bench.parse_args(["--model", "m", "--kinds", "lora", "--lora-r", "16", "--steps", "200", "--seq-len", "32",
                          "--replay", "late,middle,early", "--even", "rule"])
    assert (a.kinds, a.lora_r, a.steps, a.seq_len, a.replay, a.even) == ("lora", 16, 200, 32,
                                                                          ["late", "middle", "early"], "rule")
    assert bench.parse_args([]).seq_len == 64 and bench.parse_args([]).replay == []  # the tiny default mode
    with pytest.raises(SystemExit):
        bench.parse_args(["--replay", "last"])
