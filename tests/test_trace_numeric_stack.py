"""The numeric stack is part of the record (issue #31): CPU results depend on torch's thread count, so a deletion
run under ``HF_UNLEARN_THREADS=1`` of a run recorded with 2 threads gave another model, also "VERIFIED". Now the run
records its threads, CPU capability, versions and deterministic settings under the keyed seal; replays and the oracle
run with the recorded threads and refuse another capability or version before any compute."""

from __future__ import annotations

import contextlib
import json

import pytest
import torch

from .test_trace_common import get_trace_data, record, write_sealed_header
from .test_trace_fidelity import independent_counterfactual


@contextlib.contextmanager
def threads(n: int):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _model(family: str, tok):
    """Tiny LayerNorm models: LayerNorm's backward reduces its weight and bias gradients in per-thread chunks, so the
    thread count changes the bits at hidden size 32 already (a Llama, RMSNorm, showed no difference up to hidden 768
    on a batch of 4 rows on the 2-core test machine; the issue saw one at 768 with larger batches)."""
    from transformers import PhiConfig, PhiForCausalLM

    from hf_unlearn.models import build_tiny_model

    if family == "phi":
        torch.manual_seed(0)
        return PhiForCausalLM(PhiConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=2, num_key_value_heads=2, pad_token_id=tok.pad_token_id,
                                        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id))
    return build_tiny_model(family, tok, hidden_size=32, num_layers=2, num_heads=2, seed=0)


KW = dict(gradient_accumulation_steps=1, max_steps=3)


def _record(tmp_path, family: str):
    tok, data = get_trace_data()
    data = data.select(range(12))
    with threads(2):
        record(tok, data, tmp_path / "rec", model=_model(family, tok), every=1, **KW)
    return tok, data, tmp_path / "rec" / "trace"


def _forget(run, forget, out, monkeypatch, capsys, *extra):
    from hf_unlearn.cli import main
    from hf_unlearn.data.ids import write_ids

    write_ids(out.parent / f"{out.name}.jsonl", forget)
    code = main(["forget", str(run), "--ids", str(out.parent / f"{out.name}.jsonl"), "--out", str(out), "--no-progress",
                 *extra])
    return code, capsys.readouterr()


@pytest.mark.parametrize("family", ["gpt_neox", *[pytest.param(f, marks=pytest.mark.slow) for f in ("gpt2", "phi")]])
def test_a_deletion_under_one_thread_replays_with_the_recorded_two(tmp_path, family, monkeypatch, capsys):
    """Record with 2 threads; forget with HF_UNLEARN_THREADS=1: the replay and the oracle run with 2 threads, VERIFIED,
    and the oracle equals a plain Trainer counterfactual computed with 2 threads, not the one computed with 1."""
    from hf_unlearn.trace import open_run
    from hf_unlearn.trace.recorder import RecordingHooks as TraceRecordingMixin  # the hooks replays run too
    from hf_unlearn.trace.run import load_checkpoint

    tok, data, run = _record(tmp_path, family)
    stack = json.loads((run / "header.json").read_text())["numeric_stack"]
    assert stack["threads"] == 2 and stack["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert stack["torch"] == torch.__version__ and "deterministic_algorithms" in stack["deterministic"]
    forget = open_run(run).ids_at_steps([0])[:1]  # step 0: no recorded checkpoint between could catch a drift
    seen = []
    step = TraceRecordingMixin.training_step

    def spy(self, *args, **kwargs):
        seen.append(torch.get_num_threads())
        return step(self, *args, **kwargs)

    monkeypatch.setattr(TraceRecordingMixin, "training_step", spy)
    monkeypatch.setenv("HF_UNLEARN_THREADS", "1")
    code, out = _forget(run, forget, tmp_path / "out", monkeypatch, capsys, "--oracle")
    assert code == 0, out.err[-2000:]
    assert "VERIFIED bit-identical" in out.out and "2 torch thread(s)" in out.out
    assert seen and set(seen) == {2}  # every microbatch of the replay and the oracle
    assert torch.get_num_threads() == 1  # the CLI's setting is the process's again after the replays
    receipt = json.loads((tmp_path / "out" / "receipt.json").read_text())
    assert "2 torch thread(s)" in receipt["evidence"]["numeric_stack"]
    oracle = load_checkpoint(open_run(tmp_path / "out" / "oracle").final_checkpoint())["model"]
    monkeypatch.undo()
    with threads(2):
        two = independent_counterfactual(tok, data, _model(family, tok), run, forget, tmp_path / "cf2", **KW)
    with threads(1):
        one = independent_counterfactual(tok, data, _model(family, tok), run, forget, tmp_path / "cf1", **KW)
    assert all(torch.equal(t, two[n]) for n, t in oracle.items())
    assert any(not torch.equal(t, one[n]) for n, t in oracle.items())  # the thread count does change the numbers


@pytest.mark.parametrize("key,value", [("cpu_capability", "AVX2" if torch.backends.cpu.get_cpu_capability() != "AVX2"
                                        else "AVX512"), ("torch", "2.0.0"), ("onednn", "0.1")])
def test_another_capability_or_version_is_refused_before_compute(tmp_path, key, value, monkeypatch, capsys):
    from hf_unlearn.trace import open_run
    from hf_unlearn.trace.replay import ReplayTrainer

    _, _, run = _record(tmp_path, "gpt_neox")
    header = json.loads((run / "header.json").read_text())
    header["numeric_stack"][key] = value
    write_sealed_header(run, header)  # as if recorded on that stack (the test holds the key)
    monkeypatch.setattr(ReplayTrainer, "_replay", lambda self: pytest.fail("computed before refusing"))
    code, out = _forget(run, open_run(run).ids_at_steps([1])[:1], tmp_path / "out", monkeypatch, capsys)
    assert code == 1
    assert f"numeric stack is not the recorded run's: {key}" in out.err and repr(value) in out.err


def test_the_stack_is_under_the_keyed_seal_and_older_runs_state_the_gap(tmp_path, monkeypatch, capsys):
    from hf_unlearn.trace import open_run
    from hf_unlearn.trace.run import write_sidecar

    _, _, run = _record(tmp_path, "gpt_neox")
    original = (run / "header.json").read_text()
    header = json.loads(original)
    header["numeric_stack"]["threads"] = 1  # an edit without the run key
    (run / "header.json").write_text(json.dumps(header, indent=1, sort_keys=True))
    write_sidecar(run / "header.json")
    with pytest.raises(Exception, match="controls_mac does not match"):
        open_run(run)
    del header["numeric_stack"]  # a run recorded before the stack was: replays run with this process's threads,
    write_sealed_header(run, header)
    code, out = _forget(run, open_run(run).ids_at_steps([1])[:1], tmp_path / "refused", monkeypatch, capsys)
    # ... which the environment probe (step 0 re-run here with no deletion) finds give other bits: refused
    assert code != 0 and "the deleting environment does not reproduce the recorded run" in out.err, out.err[-2000:]
    assert not (tmp_path / "refused").exists()
    monkeypatch.setenv("HF_UNLEARN_THREADS", "2")
    with threads(2):  # in the recording's environment: accepted, with the gap stated
        code, out = _forget(run, open_run(run).ids_at_steps([1])[:1], tmp_path / "out", monkeypatch, capsys)
    assert code == 0, out.err[-2000:]
    receipt = json.loads((tmp_path / "out" / "receipt.json").read_text())
    assert receipt["evidence"]["numeric_stack"].startswith("the run records no numeric stack")


def test_a_stack_changed_during_training_is_a_hazard(tmp_path):
    from transformers import TrainerCallback

    tok, data = get_trace_data()

    class OneThreadLater(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 1:
                torch.set_num_threads(1)

    with threads(2):
        record(tok, data.select(range(8)), tmp_path / "rec", every=1, trainer_kwargs={"callbacks": [OneThreadLater()]},
               **KW)
    hazards = json.loads((tmp_path / "rec" / "trace" / "header.json").read_text())["hazards"]
    assert any("numeric stack changed while training (threads 2 -> 1" in h for h in hazards), hazards


def _confident_model(tok):
    """The tiny Llama with its (tied) output embeddings scaled up: most tokens' probabilities fall near e^-50, so the
    gradients of their rows are under 1e-19 and Adam's second moments of them are denormal floats."""
    from .test_trace_common import tiny

    torch.manual_seed(0)
    model = tiny(tok)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(100.0)
    return model


def _denormal_moments(out) -> int:
    from hf_unlearn.trace import open_run
    from hf_unlearn.trace.run import load_checkpoint

    state = load_checkpoint(open_run(out).final_checkpoint())["optimizer"]["state"]
    tiny = torch.finfo(torch.float32).tiny
    return sum(int(((t != 0) & (t.abs() < tiny)).sum()) for s in state.values() for t in s.values()
               if torch.is_tensor(t) and t.is_floating_point())


@pytest.mark.slow  # 13 s; the flash-kernel test below exercises the same pinning in the default suite
def test_a_deletion_in_a_process_that_flushes_denormals_replays_as_recorded(tmp_path, monkeypatch, capsys):
    """``torch.set_flush_denormal(True)`` in the deleting process (it has no getter, and the numeric stack did not
    record it): the oracle's Adam moments lost their denormal values and `forget` refused after compute, blaming the
    engine. Now the recorded mode is pinned like the thread count: VERIFIED, the oracle equal to a plain Trainer's
    counterfactual, the replay's moments still denormal where the run's were, and the caller's mode restored."""
    from hf_unlearn.trace import open_run
    from hf_unlearn.trace.run import load_checkpoint
    from hf_unlearn.trace.stack import flush_denormal

    tok, data = get_trace_data()
    data = data.select(range(16))
    kw = dict(gradient_accumulation_steps=1, max_steps=6)
    record(tok, data, tmp_path / "rec", model=_confident_model(tok), every=2, **kw)
    run = tmp_path / "rec" / "trace"
    assert open_run(run).header["numeric_stack"]["deterministic"]["flush_denormal"] is False
    assert _denormal_moments(run) > 0  # the run's moments hold denormals: a flushing replay loses them
    forget = open_run(run).ids_at_steps([3])[:1]
    assert torch.set_flush_denormal(True)
    try:
        code, out = _forget(run, forget, tmp_path / "del", monkeypatch, capsys, "--oracle")
        assert flush_denormal()  # the caller's mode, restored
    finally:
        torch.set_flush_denormal(False)
    assert code == 0 and "VERIFIED" in out.out, out.out + out.err
    assert _denormal_moments(tmp_path / "del" / "replay") > 0
    oracle = load_checkpoint(open_run(tmp_path / "del" / "oracle").final_checkpoint())["model"]
    plain = independent_counterfactual(tok, data, _confident_model(tok), run, forget, tmp_path / "plain", **kw)
    assert all(torch.equal(t, plain[n]) for n, t in oracle.items())


def test_a_mid_run_flush_of_denormals_is_a_stack_change(tmp_path):
    from transformers import TrainerCallback

    tok, data = get_trace_data()

    class FlushLater(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 1:
                torch.set_flush_denormal(True)

    try:
        record(tok, data.select(range(8)), tmp_path / "rec", every=1, trainer_kwargs={"callbacks": [FlushLater()]},
               **KW)
    finally:
        torch.set_flush_denormal(False)
    hazards = json.loads((tmp_path / "rec" / "trace" / "header.json").read_text())["hazards"]
    assert any("flush_denormal False -> True" in h for h in hazards), hazards


def test_per_backend_float32_precision_records_and_is_pinned(tmp_path, monkeypatch, capsys):
    """``TrainingArguments(tf32=True)`` on an Ampere GPU sets ``torch.backends.fp32_precision = "tf32"`` (torch >=
    2.9), after which torch's legacy getters raise: every recording crashed in the numeric stack's reader. Now both
    are read (the legacy ones as "per backend"), recorded, pinned for replays and restored after."""
    from hf_unlearn.trace import open_run

    tok, data = get_trace_data()
    torch.backends.fp32_precision = "tf32"
    try:
        record(tok, data.select(range(8)), tmp_path / "rec", every=1, **KW)
    finally:
        torch.backends.fp32_precision = "none"  # the legacy getters answer again
    run = tmp_path / "rec" / "trace"
    recorded = open_run(run).header["numeric_stack"]["deterministic"]
    assert recorded["fp32_precision"]["fp32_precision"] == "tf32"
    assert recorded["float32_matmul_precision"] == recorded["matmul_allow_tf32"] == "per backend"
    seen = []
    from hf_unlearn.trace import stack

    real = stack.apply_deterministic_settings
    monkeypatch.setattr(stack, "apply_deterministic_settings",
                        lambda s: (real(s), seen.append(torch.backends.fp32_precision)))
    code, out = _forget(run, open_run(run).ids_at_steps([1])[:1], tmp_path / "del", monkeypatch, capsys, "--oracle")
    assert code == 0 and "VERIFIED" in out.out, out.out + out.err
    receipt = json.loads((tmp_path / "del" / "receipt.json").read_text())
    assert "float32 precision fp32_precision=tf32" in receipt["evidence"]["numeric_stack"]
    assert "tf32" in seen and torch.backends.fp32_precision == "none"
    assert torch.get_float32_matmul_precision() == "highest"


def _tiny_run(tmp_path):
    """The tiny Llama recorded for 4 steps on 12 rows (a checkpoint every 2): tokenizer, rows, arguments, run."""
    from .test_trace_common import tiny

    tok, data = get_trace_data()
    data = data.select(range(12))
    kw = dict(gradient_accumulation_steps=1, max_steps=4)
    torch.manual_seed(0)
    record(tok, data, tmp_path / "rec", model=tiny(tok), every=2, **kw)
    return tok, data, kw, tmp_path / "rec" / "trace"


def test_a_deletion_in_a_process_without_the_flash_sdpa_kernel_replays_as_recorded(tmp_path, monkeypatch, capsys):
    """``torch.backends.cuda.enable_flash_sdp(False)`` changes a CPU SDPA's bits too (another kernel runs): a deleting
    process that set it (or imported a library that did) was refused by the environment probe, which could not name
    the cause. The SDPA kernel switches are pinned with the numeric stack now: VERIFIED, the oracle equal to a plain
    Trainer's counterfactual with the kernel on, and the caller's switch restored."""
    from hf_unlearn.trace import open_run
    from hf_unlearn.trace.run import load_checkpoint

    from .test_trace_common import tiny

    tok, data, kw, run = _tiny_run(tmp_path)
    assert open_run(run).header["numeric_stack"]["deterministic"]["flash_sdp"] is True
    forget = open_run(run).ids_at_steps([2])[:1]
    torch.backends.cuda.enable_flash_sdp(False)
    try:
        code, out = _forget(run, forget, tmp_path / "del", monkeypatch, capsys, "--oracle")
        assert not torch.backends.cuda.flash_sdp_enabled()  # the caller's, restored
    finally:
        torch.backends.cuda.enable_flash_sdp(True)
    assert code == 0 and "VERIFIED" in out.out, out.out + out.err
    oracle = load_checkpoint(open_run(tmp_path / "del" / "oracle").final_checkpoint())["model"]
    torch.manual_seed(0)
    plain = independent_counterfactual(tok, data, tiny(tok), run, forget, tmp_path / "plain", **kw)
    assert all(torch.equal(t, plain[n]) for n, t in oracle.items())


def test_a_deletion_in_a_process_with_gradients_off_trains_and_leaves_the_mode_as_it_was(tmp_path, monkeypatch,
                                                                                          capsys):
    """``torch.set_grad_enabled(False)`` left over from an evaluation in a notebook made every ``forget`` crash in its
    environment probe's first backward (a multi-page traceback). A deletion trains whatever the caller's mode: VERIFIED,
    the oracle equal to a plain Trainer's counterfactual, and gradients still off in the caller after."""
    from hf_unlearn.trace import open_run
    from hf_unlearn.trace.run import load_checkpoint

    from .test_trace_common import tiny

    tok, data, kw, run = _tiny_run(tmp_path)
    forget = open_run(run).ids_at_steps([2])[:1]
    torch.set_grad_enabled(False)
    try:
        code, out = _forget(run, forget, tmp_path / "del", monkeypatch, capsys, "--oracle")
        assert not torch.is_grad_enabled()  # the caller's, restored
    finally:
        torch.set_grad_enabled(True)
    assert code == 0 and "VERIFIED" in out.out, out.out + out.err
    oracle = load_checkpoint(open_run(tmp_path / "del" / "oracle").final_checkpoint())["model"]
    torch.manual_seed(0)
    plain = independent_counterfactual(tok, data, tiny(tok), run, forget, tmp_path / "plain", **kw)
    assert all(torch.equal(t, plain[n]) for n, t in oracle.items())


@pytest.mark.slow  # 10 s; test_the_default_dtype_is_recorded_and_pinned checks the pinning in the default suite
def test_a_deletion_in_a_process_whose_default_dtype_is_float64_replays_as_recorded(tmp_path, monkeypatch, capsys):
    """``torch.set_default_dtype(torch.float64)`` in the deleting process: `forget` was refused as "this process runs
    other code than the recorded run did: module torch" (set_default_dtype rebinds ``torch.Storage``), and a replay
    would have built its model in float64. The recorded default dtype is pinned now, for the code check and while the
    replay builds and trains: VERIFIED, float32, equal to a plain Trainer's counterfactual; the caller's restored."""
    from hf_unlearn.trace import open_run
    from hf_unlearn.trace.run import load_checkpoint

    from .test_trace_common import tiny

    tok, data, kw, run = _tiny_run(tmp_path)
    forget = open_run(run).ids_at_steps([2])[:1]
    torch.set_default_dtype(torch.float64)
    try:
        code, out = _forget(run, forget, tmp_path / "del", monkeypatch, capsys, "--oracle")
        assert torch.get_default_dtype() == torch.float64  # the caller's, restored
    finally:
        torch.set_default_dtype(torch.float32)
    assert code == 0 and "VERIFIED" in out.out, out.out + out.err
    oracle = load_checkpoint(open_run(tmp_path / "del" / "oracle").final_checkpoint())["model"]
    assert {t.dtype for t in oracle.values()} == {torch.float32}
    torch.manual_seed(0)
    plain = independent_counterfactual(tok, data, tiny(tok), run, forget, tmp_path / "plain", **kw)
    assert all(torch.equal(t, plain[n]) for n, t in oracle.items())


def test_the_default_dtype_is_recorded_and_pinned():
    from hf_unlearn.trace.stack import apply_deterministic_settings, deterministic_settings, recorded_default_dtype

    settings = deterministic_settings()
    assert settings["default_dtype"] == "float32"
    torch.set_default_dtype(torch.float64)
    try:
        with recorded_default_dtype({"numeric_stack": {"deterministic": settings}}):
            assert torch.get_default_dtype() == torch.float32
        assert torch.get_default_dtype() == torch.float64
        apply_deterministic_settings(settings)
        assert torch.get_default_dtype() == torch.float32
    finally:
        torch.set_default_dtype(torch.float32)


def test_a_recorded_hash_seed_is_required_of_the_deleting_process(tmp_path, monkeypatch, capsys):
    """Attack: a loss iterating a set of strings (its order follows Python's string hashing) from step 5 on, recorded
    under ``PYTHONHASHSEED=0`` and deleted under ``PYTHONHASHSEED=1``: the probe's steps did not reach it and the
    deletion was VERIFIED with every tensor off the counterfactual. A recorded seed is part of the numeric stack now:
    another one (or none) in the deleting process is refused before any compute, naming the seed to set."""
    from hf_unlearn.trace import open_run

    monkeypatch.setenv("PYTHONHASHSEED", "0")
    tok, data, kw, run = _tiny_run(tmp_path)
    assert json.loads((run / "header.json").read_text())["numeric_stack"]["environment"]["PYTHONHASHSEED"] == "0"
    forget = open_run(run).ids_at_steps([1])[:1]
    monkeypatch.setenv("PYTHONHASHSEED", "1")
    code, out = _forget(run, forget, tmp_path / "other", monkeypatch, capsys)
    assert code == 1 and "recorded with PYTHONHASHSEED=0 and this process has 1" in out.err
    assert "run with PYTHONHASHSEED=0" in out.err and not (tmp_path / "other").exists()
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    code, out = _forget(run, forget, tmp_path / "same", monkeypatch, capsys, "--oracle")
    assert code == 0 and "VERIFIED" in out.out
