"""The deleting process's code compared with the recording's (issue #41 item 2, hf_unlearn/trace/program_code.py).

A training script that monkeypatches a function before ``train()`` (here ``transformers.loss.loss_utils.
fixed_cross_entropy``) runs code a fresh ``hf-unlearn forget`` does not have. When the patch changes nothing on the
recorded rows, the environment probe and the proof match, and a replay without it is VERIFIED against the
counterfactual of a program the user never ran. Each test builds that counterfactual itself (a plain ``Trainer`` with
the patch, the deleted row's labels -100, the recorded normalisers) and requires a refusal before any compute naming
the code, or VERIFIED and equal to it.
"""

from __future__ import annotations

import json
import re
import warnings

import pytest
import torch
from transformers import TrainerCallback

from hf_unlearn.errors import UnlearnError

from .conftest import run_cli
from .test_trace_common import config_model, get_trace_data, record
from .test_trace_fidelity import independent_counterfactual

KW = dict(gradient_accumulation_steps=1, max_steps=4)


def _patched_cross_entropy(original):
    """``fixed_cross_entropy`` doubled when a microbatch has fewer labelled tokens than the step's normaliser: with one
    microbatch a step never on the recorded rows, always where a deletion made a row's labels -100."""
    def fixed_cross_entropy(source, target, num_items_in_batch=None, ignore_index=-100, **kwargs):
        out = original(source, target, num_items_in_batch, ignore_index, **kwargs)
        if num_items_in_batch is not None and int((target != ignore_index).sum()) < int(num_items_in_batch):
            out = out * 2
        return out
    return fixed_cross_entropy


class _Patched:
    """The training script's patch, applied and removed."""

    def __init__(self):
        from transformers.loss import loss_utils

        self.module, self.original = loss_utils, loss_utils.fixed_cross_entropy

    def __enter__(self):
        self.module.fixed_cross_entropy = _patched_cross_entropy(self.original)

    def __exit__(self, *exc):
        self.module.fixed_cross_entropy = self.original


def _record_patched(tmp, family: str):
    tok, data = get_trace_data()
    data = data.select(range(16))
    with _Patched():
        record(tok, data, tmp / "rec", model=config_model(family, tok), every=2, **KW)
    return tok, data, tmp / "rec" / "trace"


@pytest.fixture(scope="module")
def patched_run(tmp_path_factory):
    """A tiny GQA Llama (one key/value head) recorded with the patch in place (the script patched before train())."""
    return _record_patched(tmp_path_factory.mktemp("patched"), "llama")


def _ids(run, step):
    from hf_unlearn.trace import open_run

    return open_run(run).ids_at_steps([step])[:1]


def test_the_recording_seals_its_code(patched_run):
    _, _, run = patched_run
    code = json.loads((run / "header.json").read_text())["fidelity"]["guards"]["code"]
    assert "module transformers.loss.loss_utils" in code and "class torch:Tensor" in code
    assert "class transformers.models.llama.modeling_llama:LlamaAttention" in code
    assert "class transformers.trainer:Trainer" in code  # the recorded trainer class, not the recording's subclass
    assert "class torch.optim.adamw:AdamW" in code and "module torch.optim.adam" in code  # Adam.step calls adam()
    assert not [k for k in code if "__main__" in k or "hf_unlearn" in k], code


def test_a_seal_written_by_another_release_is_named_not_blamed_on_the_modules(patched_run):
    """A release that digests more of a module (the registries of functions) cannot recompute an older release's
    digests: every module would differ and the refusal would blame code the user never changed. The seal carries its
    format; another format refuses naming the release that recorded the run, before any compute."""
    from hf_unlearn.trace.program_code import CODE_FORMAT, code_differences

    header = json.loads((patched_run[2] / "header.json").read_text())
    assert header["fidelity"]["guards"]["code_format"] == CODE_FORMAT
    del header["fidelity"]["guards"]["code_format"]  # what the releases before formats were numbered wrote
    with pytest.raises(UnlearnError, match=r"written by another hf_unlearn release \(code digest format 1, this "
                                           r"release computes format 2; recorded with hf_unlearn ") as e:
        code_differences(header)
    assert "\n" not in str(e.value)


@pytest.mark.slow  # (the default suite stays under 15 minutes on 2 cores; `make test-slow`)
def test_a_patch_neutral_on_the_recorded_rows_is_refused_in_a_process_without_it(patched_run, tmp_path):
    """Without the patch (a fresh ``hf-unlearn forget``, or this process with it removed) a step-0 deletion was
    VERIFIED with the oracle off the plain Trainer with the patch (21 of 21 tensors); now refused before any compute,
    naming the module."""
    _refused_without_the_patch(patched_run[2], _ids(patched_run[2], 0), tmp_path)


def _refused_without_the_patch(run, ids, tmp_path):
    tmp_path.mkdir(parents=True, exist_ok=True)
    request = tmp_path / "ids.jsonl"
    request.write_text("".join(json.dumps(i) + "\n" for i in ids))
    proc = run_cli("forget", run, "--ids", request, "--out", tmp_path / "cli", "--no-progress", "--oracle")
    assert proc.returncode != 0, proc.stdout[-2000:]
    err = proc.stderr.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert "other code than the recorded run did: module transformers.loss.loss_utils;" in err, err  # it alone
    assert "same patches applied" in err, err
    assert not (tmp_path / "cli").exists()  # before any compute

    from hf_unlearn import forget

    with pytest.raises(UnlearnError, match=r"other code than the recorded run did: module transformers\.loss\."
                                           r"loss_utils") as e:
        forget(run, ids, tmp_path / "here", oracle=True, progress=False)
    assert "\n" not in str(e.value)
    assert not (tmp_path / "here").exists()


_CLI_WITH_THE_PATCH = """
import sys
from tests.test_trace_program_code import _Patched
_Patched().__enter__()  # the training script's patch module, imported before the deletion
from hf_unlearn.cli import main
raise SystemExit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize("step,cli", [(0, True), pytest.param(3, False, marks=pytest.mark.slow)])
def test_with_the_patch_in_place_the_deletion_is_verified_and_equals_the_counterfactual(patched_run, tmp_path, step,
                                                                                       cli):
    """The same code in the deleting process (the patch imported, as the refusal says; in a fresh process running the
    CLI, and in this one): VERIFIED, and the oracle equals a plain Trainer with the patch, the deleted row's labels
    -100 and the recorded normalisers; the receipt says how many code entries were compared."""
    _verified_with_the_patch(patched_run, "llama", step, tmp_path, cli=cli)


def _verified_with_the_patch(recorded, family, step, tmp_path, cli=False):
    import os
    import subprocess
    import sys

    from hf_unlearn import forget
    from hf_unlearn.trace import open_run
    from hf_unlearn.trace.run import load_checkpoint

    from .conftest import ROOT

    tok, data, run = recorded
    ids = _ids(run, step)
    if cli:
        tmp_path.mkdir(parents=True, exist_ok=True)
        (tmp_path / "ids.jsonl").write_text("".join(json.dumps(i) + "\n" for i in ids))
        proc = subprocess.run([sys.executable, "-c", _CLI_WITH_THE_PATCH, "forget", str(run), "--ids",
                               str(tmp_path / "ids.jsonl"), "--out", str(tmp_path / "del"), "--no-progress",
                               "--oracle"], capture_output=True, text=True, cwd=str(ROOT),
                              env={**os.environ, "PYTHONPATH": str(ROOT)})
        assert proc.returncode == 0, proc.stderr[-2000:]
        evidence = json.loads((tmp_path / "del" / "receipt.json").read_text())["evidence"]
    else:
        with _Patched():
            evidence = forget(run, ids, tmp_path / "del", oracle=True, progress=False).evidence
    assert evidence["verified"] is True, evidence
    assert evidence["environment_probe"]["code"]["compared"] > 20, evidence["environment_probe"]
    with _Patched():
        plain = independent_counterfactual(tok, data, config_model(family, tok), run, ids, tmp_path / "plain", **KW)
    oracle = load_checkpoint(open_run(tmp_path / "del" / "oracle").final_checkpoint())["model"]
    assert not [n for n, t in oracle.items() if not torch.equal(t, plain[n])]


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen2", "gpt_neox"])
def test_the_patch_on_other_architectures(tmp_path, family):
    """Qwen2 with grouped-query attention and GPT-NeoX: a step-0 and a mid-run deletion without the patch refused before
    any compute (the CLI in a fresh process and this process), with it VERIFIED and equal to the counterfactual."""
    recorded = _record_patched(tmp_path, family)
    for step in (0, 2):
        _refused_without_the_patch(recorded[2], _ids(recorded[2], step), tmp_path / f"refused{step}")
        _verified_with_the_patch(recorded, family, step, tmp_path / f"verified{step}")


@pytest.mark.slow  # a forget with its oracle (~10 s)
def test_a_run_recorded_before_code_was_sealed_keeps_working_and_says_so(patched_run, tmp_path):
    """A run whose header seals no code digests (recorded before this release) is deleted as before; the receipt and
    forget's output say the code was not compared."""
    from hf_unlearn import forget

    from .test_trace_common import copy_run, write_sealed_header

    _, _, run = patched_run
    old = copy_run(run, tmp_path / "old")
    header = json.loads((old / "header.json").read_text())
    del header["fidelity"]["guards"]["code"]
    write_sealed_header(old, header)
    lines = []
    with _Patched():  # the recording's code, so the VERIFIED below is the counterfactual's (tested above)
        receipt = forget(old, _ids(old, 0), tmp_path / "del", oracle=True, progress=False, log=lines.append)
    assert receipt.evidence["verified"] is True
    code = receipt.evidence["environment_probe"]["code"]
    assert code["compared"] == 0 and "no code digests" in code["why"], code
    assert any("code NOT compared" in line for line in lines), lines


def test_the_code_seal_is_stable_across_processes_and_names_what_differs(patched_run, monkeypatch):
    """The digests recomputed here equal the sealed ones (the patch in place); a class method patched, a class missing
    and a module not importable are each named."""
    from hf_unlearn.trace.program_code import code_differences, code_now

    _, _, run = patched_run
    header = json.loads((run / "header.json").read_text())
    with _Patched():
        assert code_differences(header) == []
    from transformers.models.llama import modeling_llama

    monkeypatch.setattr(modeling_llama.LlamaMLP, "forward", lambda self, x: x)
    with _Patched():
        assert code_differences(header) == ["class transformers.models.llama.modeling_llama:LlamaMLP"]
    now = code_now(["class transformers.models.llama.modeling_llama:NoSuchClass", "module no_such_module_hfu",
                    "class __main__:ScriptClass"])
    assert now == {"class transformers.models.llama.modeling_llama:NoSuchClass": "not defined here",
                   "module no_such_module_hfu": "not importable here (ModuleNotFoundError)",
                   "class __main__:ScriptClass": "not defined here (a class of the training script: run the "
                                                 "deletion from it)"}


_SIDE_EFFECTS = """
import json, torch
from transformers import LlamaConfig, LlamaForCausalLM
from hf_unlearn.trace.digests import Digester, _class_code
def digests():
    return [_class_code(c, Digester()) for c in (torch.nn.Linear, torch.optim.AdamW, torch.optim.Adam)]
before = digests()
model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                     num_attention_heads=2, num_key_value_heads=1))  # initialize_weights: smart_apply
torch.optim.AdamW(model.parameters())  # Optimizer.__init__ wraps AdamW.step (step.hooked)
print(json.dumps([before, digests(), hasattr(torch.nn.Module, "smart_apply"), "step" in vars(torch.optim.AdamW)]))
"""


def test_what_frameworks_set_on_classes_while_a_program_runs_is_not_a_code_difference():
    """In a fresh process: a model initialised (transformers sets ``torch.nn.Module.smart_apply``) and an AdamW built
    (torch wraps ``AdamW.step`` in its profiling wrapper, on the class) change no class's code digest. Before, every
    module class's digest differed between the recording process and a fresh ``forget``, which skips initialisation."""
    import subprocess
    import sys

    from .conftest import ROOT

    out = subprocess.run([sys.executable, "-c", _SIDE_EFFECTS], capture_output=True, text=True, cwd=str(ROOT),
                         env={**__import__("os").environ, "PYTHONPATH": str(ROOT)}, check=True)
    before, after, smart_apply, wrapped = json.loads(out.stdout.splitlines()[-1])
    assert smart_apply and wrapped  # the side effects happened
    assert before == after


@pytest.mark.slow  # a two-stage recording and a two-stage forget with oracles in a fresh process (~40 s)
@pytest.mark.parametrize("lora", [False, True])
def test_a_pipeline_recorded_here_is_deleted_by_a_fresh_cli_with_its_code_compared(tmp_path, lora):
    """No over-refusal: SFT then SFT (stage 2 a LoRA on stage 1's model, or a full fine-tune), recorded in this
    process, deleted by ``hf-unlearn forget STAGE1 STAGE2`` in a fresh one: VERIFIED, every stage's code compared."""
    from .test_trace_common import ids_at_step
    from .test_trace_pipeline import record_pipeline

    s1, s2 = record_pipeline(tmp_path / "runs", lora=lora)
    (tmp_path / "ids.jsonl").write_text("".join(json.dumps(i) + "\n" for i in ids_at_step(s1, 0)[:1]))
    proc = run_cli("forget", s1, s2, "--ids", tmp_path / "ids.jsonl", "--out", tmp_path / "del", "--no-progress",
                   "--oracle")
    assert proc.returncode == 0, proc.stderr[-2000:]
    evidence = json.loads((tmp_path / "del" / "receipt.json").read_text())["evidence"]
    assert evidence["verified"] is True
    assert all(s["environment_probe"]["code"]["compared"] > 20 for s in evidence["pipeline"]), evidence["pipeline"]


class _TorchPatch:
    """The training script's ``torch.rsqrt = ...`` (what ``LlamaRMSNorm`` calls): its result scaled on a microbatch
    padded to one of ``lengths`` (those of the steps the environment probe does not re-run)."""

    def __init__(self):
        self.original, self.lengths = torch.rsqrt, set()

    def __enter__(self):
        original, lengths = self.original, self.lengths

        def rsqrt(x, *args, **kwargs):
            out = original(x, *args, **kwargs)
            return out * 1.25 if x.dim() == 3 and x.shape[-2] in lengths else out

        torch.rsqrt = rsqrt
        return self

    def __exit__(self, *exc):
        torch.rsqrt = self.original


class _RegistryPatch:
    """The training script's ``ALL_ATTENTION_FUNCTIONS["sdpa"] = ...`` (transformers' attention registry, which
    ``LlamaAttention.forward`` looks its function up in at every call): the attention output scaled on a microbatch
    padded to one of ``lengths``. No class, module-level function or model attribute changes."""

    def __init__(self):
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        self.registry, self.original, self.lengths = ALL_ATTENTION_FUNCTIONS, ALL_ATTENTION_FUNCTIONS["sdpa"], set()

    def __enter__(self):
        original, lengths = self.original, self.lengths

        def sdpa(module, query, *args, **kwargs):
            out, weights = original(module, query, *args, **kwargs)
            return (out * 1.25 if query.shape[-2] in lengths else out), weights

        self.registry["sdpa"] = sdpa
        return self

    def __exit__(self, *exc):
        self.registry._local_mapping.pop("sdpa", None)


class _KernelPatch:
    """The training script's CPU kernel for ``aten::neg`` through ``torch.library`` (Llama's ``rotate_half`` calls the
    operator): exact negation, halved on a tensor whose second-last size is one of ``lengths``. No Python namespace
    changes: the dispatcher runs it."""

    def __init__(self):
        self.lengths, self.library = set(), None

    def __enter__(self):
        lengths = self.lengths

        def neg(x):
            out = x * -1.0
            return out * 0.5 if x.dim() >= 2 and x.shape[-2] in lengths else out

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch warns that a kernel is overridden: what the attack does
            self.library = torch.library.Library("aten", "IMPL")
            self.library.impl("neg", neg, "CPU")
        return self

    def __exit__(self, *exc):
        self.library._destroy()


class _AliasKernelPatch(_KernelPatch):
    """The same on an alias key: ``aten::linear`` for ``CompositeImplicitAutograd`` (the dispatcher lists it as
    ``CompositeImplicitAutograd[alias]``): the result halved on a microbatch of one of ``lengths``."""

    def __enter__(self):
        lengths = self.lengths

        def linear(x, weight, bias=None):
            out = torch.matmul(x, weight.t()) if bias is None else torch.addmm(bias, x.flatten(0, -2),
                                                                              weight.t()).unflatten(0, x.shape[:-1])
            return out * 0.5 if x.dim() >= 2 and x.shape[-2] in lengths else out

        self.library = torch.library.Library("aten", "IMPL")
        self.library.impl("linear", linear, "CompositeImplicitAutograd")
        return self


class _SavedTensorHooks:
    """The training script's ``torch.autograd.graph.saved_tensors_hooks`` around everything (activation compression):
    the unpacked tensor halved when it is one of ``lengths`` long. autograd's C++ state: no namespace shows it."""

    def __init__(self):
        self.lengths, self.context = set(), None

    def __enter__(self):
        lengths = self.lengths

        def unpack(x):
            return x * 0.5 if x.dim() >= 2 and x.shape[-2] in lengths and x.is_floating_point() else x

        self.context = torch.autograd.graph.saved_tensors_hooks(lambda x: x, unpack)
        self.context.__enter__()
        return self

    def __exit__(self, *exc):
        self.context.__exit__(*exc)


@pytest.mark.parametrize("patched,named", [(_TorchPatch, "module torch;"),
                                           pytest.param(_RegistryPatch, "module transformers.", marks=pytest.mark.slow),
                                           pytest.param(_KernelPatch, "the kernels of torch's operators registered "
                                                        "through torch.library (recorded: aten::neg/CPU; here: none)",
                                                        marks=pytest.mark.slow),
                                           pytest.param(_AliasKernelPatch, "the kernels of torch's operators "
                                                        "registered through torch.library (recorded: "
                                                        "aten::linear/CompositeImplicitAutograd; here: none)",
                                                        marks=pytest.mark.slow),
                                           pytest.param(_SavedTensorHooks, "autograd's saved-tensor hooks "
                                                        "(torch.autograd.graph.saved_tensors_hooks; recorded: set, "
                                                        "here: none)", marks=pytest.mark.slow)])
def test_a_patch_acting_only_at_steps_the_probe_skips_is_refused_without_it(tmp_path, patched, named):
    """Attack: the training script sets ``torch.rsqrt``, or transformers' attention registry entry, to a function
    that differs only on microbatches of the steps the probe does not re-run (their padded lengths, learnt from a first
    recording's plan), or a kernel of ``aten::neg`` registered through ``torch.library``. Before: ``torch``'s own
    namespace, then the registry (a mapping, not a function) and the kernel (no Python namespace at all), were not
    sealed, and a step-0 deletion in a process without the patch was VERIFIED while its oracle differed from a plain
    Trainer with the patch, the deleted row's labels -100 and the recorded normalisers (21 of 21 tensors; 63 entries
    with the optimizer's for the registry). Now: refused before any compute naming the module; with the patch in
    place VERIFIED and equal to that counterfactual."""
    from hf_unlearn import forget
    from hf_unlearn.trace import open_run
    from hf_unlearn.trace.proof import probe_steps
    from hf_unlearn.trace.run import load_checkpoint

    tok, data = get_trace_data()
    data = data.select(range(16))
    with patched() as patch:
        record(tok, data, tmp_path / "order", model=config_model("llama", tok), every=2, **KW)
        order = open_run(tmp_path / "order" / "trace")
        probed = set(probe_steps(order))
        lengths = {}
        for e in order.plan:
            lengths.setdefault(e.step in probed, set()).add(max(e.lens))
        patch.lengths |= lengths[False] - lengths.get(True, set())
        record(tok, data, tmp_path / "rec", model=config_model("llama", tok), every=2, **KW)
    run = open_run(tmp_path / "rec" / "trace")
    assert patch.lengths
    ids = run.ids_at_steps([0])[:1]
    with pytest.raises(UnlearnError, match=r"other code than the recorded run did: " + re.escape(named)) as e:
        forget(run.path, ids, tmp_path / "without", oracle=True, progress=False)
    assert "\n" not in str(e.value) and not (tmp_path / "without").exists()
    with patch:
        assert forget(run.path, ids, tmp_path / "with", oracle=True, progress=False).evidence["verified"] is True
        plain = independent_counterfactual(tok, data, config_model("llama", tok), run.path, ids, tmp_path / "plain",
                                           **KW)
    oracle = load_checkpoint(open_run(tmp_path / "with" / "oracle").final_checkpoint())["model"]
    assert not [n for n, t in oracle.items() if not torch.equal(t, plain[n])]


@pytest.mark.parametrize("where,name,entry", [
    ("torch", "_foreach_mul_", "module torch"),  # what a foreach optimizer step calls
    ("torch.autograd", "backward", "module torch.autograd"),
    ("torch.nn.utils", "clip_grad_norm_", "module torch.nn.utils"),  # what Accelerator.clip_grad_norm_ calls
    ("accelerate.utils.operations", "send_to_device", "module accelerate.utils.operations"),
    ("transformers.trainer", "get_model_param_count", "module transformers.trainer"),
])
def test_the_functions_a_step_calls_by_name_are_sealed(patched_run, monkeypatch, where, name, entry):
    """A function of torch's top level, autograd, gradient clipping, Accelerate's helpers or the trainer's module,
    replaced (by a wrapper computing the same, as a patch neutral on the recorded rows would): named."""
    import importlib

    from hf_unlearn.trace.program_code import code_differences

    header = json.loads((patched_run[2] / "header.json").read_text())
    module = importlib.import_module(where)
    original = getattr(module, name)
    monkeypatch.setattr(module, name, lambda *a, **k: original(*a, **k))
    with _Patched():
        assert code_differences(header) == [entry]


@pytest.mark.parametrize("where,registry,key,entry", [
    ("transformers.modeling_utils", "ALL_ATTENTION_FUNCTIONS", "sdpa", "module transformers.models.llama.modeling_llama"),
    ("transformers.masking_utils", "ALL_MASK_ATTENTION_FUNCTIONS", "sdpa", "module transformers.masking_utils"),
    ("transformers.loss.loss_utils", "LOSS_MAPPING", "ForCausalLM", "module transformers.loss.loss_utils"),
])
def test_a_registry_entry_the_script_replaced_is_sealed(patched_run, monkeypatch, where, registry, key, entry):
    """Transformers looks the attention function, the mask function and the loss up by name in module-level
    registries at every call; an entry replaced (by a wrapper computing the same, as a patch neutral on the recorded
    rows would) changes no class nor module function: named, in every module that holds the registry."""
    import importlib

    from hf_unlearn.trace.program_code import code_differences

    header = json.loads((patched_run[2] / "header.json").read_text())
    mapping = getattr(importlib.import_module(where), registry)
    original = mapping[key]
    monkeypatch.setitem(mapping, key, lambda *a, **k: original(*a, **k))
    with _Patched():
        assert entry in code_differences(header)
    monkeypatch.undo()
    with _Patched():
        assert code_differences(header) == []


def test_a_registry_is_kept_between_steps_and_an_entry_changed_in_place_is_seen(monkeypatch):
    """The per-step digest keeps a module's text while everything it read is the same objects; a registry holding a
    ``functools.partial`` and a bound method (transformers' mask registry, ``torch._deprecated_attrs``) is kept too
    (it was read again at every step: the tiny model's whole-program digest went from 12 to 24 ms), and what can
    change in place (the partial's keywords, an entry rebound) is still seen."""
    import functools
    import sys
    import types

    from hf_unlearn.trace import digests

    def mask(x, k=1):
        return x

    class Holder:
        def method(self):
            return 1

    module = types.ModuleType("hfu_test_registry")
    module.REGISTRY = {"partial": functools.partial(mask, k=1), "method": Holder().method, "plain": mask}
    monkeypatch.setitem(sys.modules, module.__name__, module)
    first = digests._module_code(module, digests.Digester())
    assert digests._module_code(module, digests.Digester()) == first
    assert id(module) in digests._NAMESPACES  # kept, not read again at every step
    module.REGISTRY["partial"].keywords["k"] = 2
    second = digests._module_code(module, digests.Digester())
    assert second != first
    module.REGISTRY["plain"] = lambda x, k=1: x
    assert digests._module_code(module, digests.Digester()) != second


@pytest.mark.slow  # two recording launches, two forgets with oracles and a counterfactual (~30 s)
def test_a_recording_resumed_without_the_first_launchs_patch_is_refused(tmp_path):
    """Attack: stopped after step 4 (a callback's early stop: the first launch sealed the run) with the patch in place,
    resumed (``resume_from_checkpoint``) in a process without it. Before: the seal was the resumed process's code, so
    a step-1 deletion without the patch was VERIFIED while its oracle differed from a plain Trainer with the patch on
    steps 0..3, the deleted row's labels -100 and the recorded normalisers (21 of 21 tensors). Now the resume is
    refused, naming the module; resumed with the patch, the run seals it, a deletion without it is refused and one
    with it is VERIFIED and equal to that counterfactual."""

    from hf_unlearn.trace import open_run

    from .test_trace_neutral_attacks import _differs_from_counterfactual, _forget_outcome, stopped_at_4_then_resumed

    tok, data = get_trace_data()
    data = data.select(range(24))
    trainer = stopped_at_4_then_resumed(tmp_path, tok, data, [])
    with _Patched():
        trainer(trainer.stop_at_4).train()
    resume = str(tmp_path / "rec" / "checkpoint-4")
    with pytest.raises(UnlearnError, match=r"cannot be resumed in this process: it runs other code than the steps "
                                           r"before the stop did: module transformers\.loss\.loss_utils;") as e:
        trainer().train(resume_from_checkpoint=resume)
    assert "\n" not in str(e.value)
    with _Patched():
        trainer().train(resume_from_checkpoint=resume)
    run = tmp_path / "rec" / "trace"
    assert "module transformers.loss.loss_utils" in open_run(run).header["fidelity"]["guards"]["code"]
    ids = open_run(run).ids_at_steps([1])[:1]
    kind, why = _forget_outcome(run, ids, tmp_path / "without")
    assert kind == "refused" and "other code than the recorded run did" in why, why

    with _Patched():
        kind, receipt = _forget_outcome(run, ids, tmp_path / "del")
    assert kind == "verified", receipt
    assert not _differs_from_counterfactual(tok, data, "llama", run, ids, tmp_path / "del", [_PatchedThroughout()])


class _PatchedThroughout(TrainerCallback):
    """The program that ran: the patch on every step of every launch (for the counterfactual)."""

    def __init__(self):
        self.patch = _Patched()

    def on_train_begin(self, args, state, control, **kwargs):
        self.patch.__enter__()

    def on_train_end(self, args, state, control, **kwargs):
        self.patch.__exit__()


def test_a_patch_applied_while_training_is_sealed_as_not_reproducible(tmp_path):
    """Attack: a watched callback (not replayed) sets ``torch.rsqrt`` to a wrapper at step 2 and leaves it: the seal
    taken at the first step lacks it, and so does a deleting process, while steps 2.. ran it. The recording ends
    sealed as not reproducible, naming the module; deletions are refused."""
    from transformers import TrainerCallback

    from hf_unlearn import forget
    from hf_unlearn.trace import open_run

    patch = _TorchPatch()

    class PatchAtStep2(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step == 2:
                patch.__enter__()

    tok, data = get_trace_data()
    try:
        record(tok, data.select(range(16)), tmp_path / "rec", model=config_model("llama", tok), every=2,
               trainer_kwargs={"callbacks": [PatchAtStep2()]}, **KW)
    finally:
        patch.__exit__()
    run = open_run(tmp_path / "rec" / "trace")
    why = run.header["fidelity"]["recording"]["why"]
    assert "the code the run's first step ran changed while it trained (module torch)" in why, why
    ids = run.ids_at_steps([2])[:1]
    with pytest.raises(UnlearnError):  # not proven (the proof at the end of the recording was not run)
        forget(run.path, ids, tmp_path / "del", oracle=True, progress=False)
    from hf_unlearn.trace import OracleReplayTrainer

    with pytest.raises(UnlearnError, match=r"does not reproduce this run \(the code the run's first step ran changed"):
        OracleReplayTrainer(run, ids, out_dir=tmp_path / "oracle")  # built, as after a `trace prove`: refused


def test_a_torch_function_patched_for_one_step_and_put_back_is_a_program_change_of_that_step(tmp_path):
    """Attack: a watched callback (not replayed) sets ``torch.rsqrt`` to a wrapper when step 2 begins and puts the
    original back when it ends: the code seal at the first step and the one at the end agree, and a deletion process
    without the patch matches both. The per-step digest reads ``torch``'s namespace too (digests.STEP_MODULES, kept
    between steps), so step 2 is a program change named with the module, and a deletion whose replay passes it is
    refused before any compute."""
    from transformers import TrainerCallback

    from hf_unlearn import forget
    from hf_unlearn.trace import open_run
    from hf_unlearn.trace.guards import program_changes

    patch = _TorchPatch()

    class PatchStep2(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step == 2:
                patch.__enter__()

        def on_step_end(self, args, state, control, **kwargs):
            patch.__exit__()

    tok, data = get_trace_data()
    try:
        record(tok, data.select(range(16)), tmp_path / "rec", model=config_model("llama", tok), every=2,
               trainer_kwargs={"callbacks": [PatchStep2()]}, **KW)
    finally:
        patch.__exit__()
    run = open_run(tmp_path / "rec" / "trace")
    changes = [c for c in program_changes(run.plan, run.header) if "code module torch" in c["what"]]
    assert changes and changes[0]["step"] == 2, program_changes(run.plan, run.header)
    ids = run.ids_at_steps([1])[:1]
    with pytest.raises(UnlearnError) as e:
        forget(run.path, ids, tmp_path / "del", oracle=True, progress=False)
    assert "\n" not in str(e.value) and not (tmp_path / "del").exists()


def test_a_resume_keeps_the_earlier_seal_and_the_first_step_it_covers(patched_run):
    """What a resumed launch takes from the earlier launch's header (one process here): its code entries, compared
    with this process's, and the first step the seal covers (0; an earlier ``code_from``; the resume step when the
    earlier launch sealed no code), which :func:`unsealed_code_refusal` holds deletions to."""
    from types import SimpleNamespace

    from hf_unlearn.trace.program_code import resumed_code_checked, unsealed_code_refusal

    _, _, run = patched_run
    header = json.loads((run / "header.json").read_text())
    with _Patched():
        assert resumed_code_checked(run, header, 4) == (header["fidelity"]["guards"]["code"], 0)
        header["fidelity"]["guards"]["code_from"] = 2
        assert resumed_code_checked(run, header, 4)[1] == 2
    with pytest.raises(UnlearnError, match="cannot be resumed in this process"):
        resumed_code_checked(run, header, 4)
    del header["fidelity"]["guards"]["code"]
    assert resumed_code_checked(run, header, 4) == ({}, 4) and resumed_code_checked(run, {}, 3) == ({}, 3)
    resumed = SimpleNamespace(path=run, header={"fidelity": {"guards": {"code": {}, "code_from": 4}}})
    assert unsealed_code_refusal(resumed, 4) is None and unsealed_code_refusal(resumed, None) is None
    assert "steps 0..3 ran is not sealed" in unsealed_code_refusal(resumed, 3)
    whole = json.loads((run / "header.json").read_text())  # a seal from step 0: every deletion goes on
    assert unsealed_code_refusal(SimpleNamespace(path=run, header=whole), 0) is None


def _killed_at_5(tmp_path, tok, data):
    """``trainer``: as :func:`~tests.test_trace_neutral_attacks.stopped_at_4_then_resumed`; its first launch, with the
    patch in place, killed by an exception a callback raises after optimizer step 5 (the Trainer checkpointed at 4):
    the run is left unsealed, as a crash leaves it."""
    from transformers import TrainerCallback

    from .test_trace_neutral_attacks import stopped_at_4_then_resumed

    class KilledAt5(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 5:
                raise RuntimeError("killed after step 5")

    trainer = stopped_at_4_then_resumed(tmp_path, tok, data, [])
    with _Patched(), pytest.raises(RuntimeError, match="killed after step 5"):
        trainer(KilledAt5()).train()
    header = json.loads((tmp_path / "rec" / "trace" / "header.json").read_text())
    assert not header.get("sealed")
    return trainer, header


@pytest.mark.slow  # two recording launches, two forgets with oracles and a counterfactual (~40 s)
def test_a_run_killed_after_its_first_steps_and_resumed_without_its_patch_is_refused(tmp_path):
    """Attack: the first launch (the patch in place) is killed by a callback's exception after step 5, before the
    run was sealed; it is resumed from the Trainer's ``checkpoint-4`` without the patch. Before: the code seal was
    written only when training ended, so the killed launch left none, the resume had nothing to compare with and
    sealed its own code: a step-1 deletion without the patch was VERIFIED against the counterfactual of a program
    that never ran (21 of 21 tensors off a plain Trainer with the patch). Now the seal is in the header from the first optimizer step, the resume without the patch is
    refused naming the module; the user's ordinary resume (with the patch) records on, and a deletion is refused
    without the patch and VERIFIED with it, equal to a plain Trainer with the patch on every step."""

    from hf_unlearn.trace import open_run

    from .test_trace_neutral_attacks import _differs_from_counterfactual, _forget_outcome

    tok, data = get_trace_data()
    data = data.select(range(24))
    trainer, header = _killed_at_5(tmp_path, tok, data)
    assert "module transformers.loss.loss_utils" in header["fidelity"]["guards"]["code"]
    resume = str(tmp_path / "rec" / "checkpoint-4")
    with pytest.raises(UnlearnError, match=r"cannot be resumed in this process: it runs other code than the steps "
                                           r"before the stop did: module transformers\.loss\.loss_utils;") as e:
        trainer().train(resume_from_checkpoint=resume)
    assert "\n" not in str(e.value)
    with _Patched():
        trainer().train(resume_from_checkpoint=resume)
    run = tmp_path / "rec" / "trace"
    sealed = open_run(run).header
    assert sealed["optimizer_steps"] == 6 and "code_from" not in sealed["fidelity"]["guards"]
    ids = open_run(run).ids_at_steps([1])[:1]
    kind, why = _forget_outcome(run, ids, tmp_path / "without")
    assert kind == "refused" and "other code than the recorded run did" in why, why

    with _Patched():
        kind, receipt = _forget_outcome(run, ids, tmp_path / "del")
    assert kind == "verified", receipt
    assert not _differs_from_counterfactual(tok, data, "llama", run, ids, tmp_path / "del", [_PatchedThroughout()])


@pytest.mark.slow  # two recording launches and three forgets (~40 s)
def test_a_resumed_launch_that_left_no_code_seal_refuses_deletions_of_its_steps(tmp_path):
    """The killed launch's header as a release that sealed code only at the end left it (no ``code``): the code steps
    0..3 ran is unknown. The resume records on (the user's flow) and seals its own code from step 4
    (``code_from``); a deletion of a row first trained at step 1 is refused before any compute, naming the unsealed
    steps (forget, and a replay built directly), while one of a row first trained at step 5 is VERIFIED."""
    from hf_unlearn.trace import ReplayTrainer, open_run

    from .test_trace_neutral_attacks import _forget_outcome

    tok, data = get_trace_data()
    data = data.select(range(24))
    trainer, header = _killed_at_5(tmp_path, tok, data)
    del header["fidelity"]["guards"]["code"]
    run = tmp_path / "rec" / "trace"
    (run / "header.json").write_text(json.dumps(header))
    with _Patched():
        trainer().train(resume_from_checkpoint=str(tmp_path / "rec" / "checkpoint-4"))
    sealed = open_run(run).header["fidelity"]["guards"]
    assert sealed["code_from"] == 4 and "module transformers.loss.loss_utils" in sealed["code"]
    opened = open_run(run)
    early = [i for i in opened.ids_at_steps([1]) if i not in opened.ids_at_steps(range(1))][:1]
    kind, why = _forget_outcome(run, early, tmp_path / "early")
    assert kind == "refused" and "the code optimizer steps 0..3 ran is not sealed" in why and "\n" not in why, why
    assert not (tmp_path / "early").exists()
    with _Patched(), pytest.raises(UnlearnError, match=r"first trained at optimizer step 1, and the code optimizer "
                                                        r"steps 0\.\.3 ran is not sealed"):
        ReplayTrainer(run, forget_ids=early, out_dir=tmp_path / "replay")
    late = [i for i in opened.ids_at_steps([5]) if i not in opened.ids_at_steps(range(5))][:1]
    assert late
    with _Patched():
        kind, receipt = _forget_outcome(run, late, tmp_path / "late")
    assert kind == "verified", receipt


@pytest.mark.slow  # one 2-process launch each: a recording and its resume (about 40 s)
@pytest.mark.parametrize("patched", [1, 0, -1])
def test_a_code_change_on_one_process_refuses_the_resume_on_every_process(tmp_path, patched):
    """A data-parallel recording stopped after step 2 and resumed with ``fixed_cross_entropy`` patched on one process
    only. Before: the resumed code was compared on process 0 alone; patched on process 1, the difference was never
    compared and the run trained on; patched on process 0, process 0 refused while process 1 went on into the next
    collective (it hangs while process 0 lives; here it died with gloo's "Connection closed by peer" once process 0
    exited, never with the refusal). Now both processes refuse in the same one line, naming the module and the
    patched process, before any step, and the launch ends within its timeout. Patched on neither (-1): the resume
    records on to step 4 and the run is proven at its end."""
    import os
    import sys

    from hf_unlearn.keys import load_key

    from .conftest import ROOT, free_port, run_launch

    load_key()  # the run key both processes read (made here: two processes making it at once would race)

    def cmd():
        return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                str(free_port()), str(ROOT / "tests" / "trace_rank_code.py"), str(tmp_path), str(patched)]

    proc = run_launch(cmd, tmp_path, cwd=str(ROOT), timeout=300,
                      env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = [json.loads((tmp_path / f"resume-{r}.json").read_text()) for r in (0, 1)]
    header = json.loads((tmp_path / "trace" / "header.json").read_text())
    if patched < 0:
        assert results == [{"trained": True}] * 2, results
        assert header["optimizer_steps"] == 4 and header["fidelity"]["recording"]["reproduced"] is True, header
        assert "module transformers.loss.loss_utils" in header["fidelity"]["guards"]["code"]
        return
    errors = [r.get("error") for r in results]
    assert errors[0] and errors[0] == errors[1], results
    assert "other code than the steps before the stop did: module transformers.loss.loss_utils" in errors[0]
    assert errors[0].endswith(f"(on process(es) {patched} of 2)") and "\n" not in errors[0], errors[0]
    assert header["sealed"] and header["optimizer_steps"] == 2  # the first launch's sealed run: the resume wrote none


@pytest.mark.parametrize("named", ["torch's Python files", "torch's C++ build tree"])
def test_a_kernel_that_names_torchs_own_files_as_where_it_was_registered_is_still_the_programs(named):
    """The file a kernel names is the registering code's word (``torch._C._dispatch_library(..., file, line)``): an
    ``aten::neg`` CPU kernel that says it was registered in torch's ``_tensor.py`` or in torch's C++ build tree is
    named by the seal, as the program's (it is registered over torch's own, which stays inactive)."""
    import gc
    import os

    import torch

    from hf_unlearn.trace.program_code import user_kernels

    where = (os.path.join(os.path.dirname(torch.__file__), "_tensor.py") if named.startswith("torch's Python")
             else "/__w/pytorch/pytorch/build/aten/src/ATen/RegisterCPU_3.cpp")
    assert user_kernels() == "none"
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "overriding a previously registered kernel"
        lib = torch._C._dispatch_library("IMPL", "aten", "", where, 1)
        lib.impl("neg", "CPU", lambda x: torch.mul(x, -0.5), False)
    try:
        assert torch.neg(torch.ones(1)).item() == -0.5
        assert user_kernels() == "aten::neg/CPU"
    finally:
        del lib
        gc.collect()
    assert torch.neg(torch.ones(1)).item() == -1.0 and user_kernels() == "none"
