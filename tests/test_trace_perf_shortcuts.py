"""The recording's cheaper checks keep their meaning: each shortcut taken to cut the recording overhead (issue #41's
benchmark) is compared here with the slow computation it replaces, on inputs built to fool it."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import TrainerCallback

from .test_trace_common import get_recorded, get_trace_data, record, tiny


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_all_finite_agrees_with_the_elementwise_check(dtype):
    """One read (a sum) instead of a boolean tensor as large as the weights: a NaN, an infinity of either sign, or
    both infinities (whose sum is NaN) anywhere are found; finite values whose sum overflows are not taken for one."""
    from hf_unlearn.trace.guards import all_finite

    g = torch.Generator().manual_seed(0)
    base = torch.randn(4099, generator=g).to(dtype)
    biggest = torch.full((4099,), torch.finfo(dtype).max, dtype=dtype)
    cases = [base, biggest, -biggest, base[:0], base[::3]]  # empty, strided
    for bad in (float("nan"), float("inf"), float("-inf")):
        for where in (0, 2048, 4098):
            for t in (base, biggest):
                u = t.clone()
                u[where] = bad
                cases.append(u)
    both = base.clone()
    both[5], both[9] = float("inf"), float("-inf")
    cases.append(both)
    for t in cases:
        assert all_finite(t) == bool(torch.isfinite(t).all()), (t.dtype, t.numel())


def test_a_weight_edited_to_nan_is_still_named_by_the_recording(tmp_path):
    """first_non_finite (the checkpoint's NaN check) reads each weight once; it names the same parameter."""
    from hf_unlearn.trace.recording import first_non_finite

    tok, _ = get_trace_data()
    model = tiny(tok)
    assert first_non_finite(model) is None
    names = [n for n, _ in model.named_parameters()]
    with torch.no_grad():
        dict(model.named_parameters())[names[3]].view(-1)[7] = float("inf")
        dict(model.named_parameters())[names[5]].view(-1)[0] = float("nan")
    assert first_non_finite(model) == names[3]


def test_the_sealed_output_root_read_from_the_final_checkpoint_is_the_models(tmp_path):
    """A plain run's lineage output root is read from the final checkpoint written as training ends (not hashed a
    second time): it equals the root of the trained model's weights computed from memory, and the root
    lineage.output_root recomputes from the checkpoint."""
    from hf_unlearn.trace import open_run
    from hf_unlearn.trace.lineage import output_root, weights_root

    tok, data = get_trace_data()
    trainer = record(tok, data.select(range(16)), tmp_path, every=1)
    header = json.loads((tmp_path / "trace" / "header.json").read_text())
    live = weights_root(trainer.accelerator.unwrap_model(trainer.model).state_dict())
    assert header["lineage"]["output_root"] == live == output_root(open_run(tmp_path / "trace"))


def test_the_recorded_run_still_names_its_output_root():
    header = json.loads((get_recorded() / "header.json").read_text())
    assert len(header["lineage"]["output_root"]) == 64


def test_a_function_changed_in_place_changes_the_program_digest():
    """A function's code, defaults or closure replaced in place (the function, its class and its module stay the same
    objects) is a change of the program the digest sees, at every snapshot (no cache keyed by identities hides it)."""
    from transformers.models.llama import modeling_llama as ml

    from hf_unlearn.trace.digests import describe_difference, program_state

    tok, _ = get_trace_data()
    model = tiny(tok)
    before = program_state(model)

    def negated(x):
        return -x

    def identity(self, x):
        return x

    edits = [(ml.rotate_half, "__code__", negated.__code__), (ml.LlamaMLP.forward, "__code__", identity.__code__),
             (ml.eager_attention_forward, "__defaults__", (0.5,))]
    for fn, attr, value in edits:
        saved = getattr(fn, attr)
        try:
            setattr(fn, attr, value)
            assert describe_difference(before, program_state(model)), (fn, attr)
        finally:
            setattr(fn, attr, saved)
        assert describe_difference(before, program_state(model)) is None


def test_a_function_read_once_is_read_again_when_anything_its_text_depends_on_changes(monkeypatch):
    """Functions' texts are kept between snapshots (digests._FUNCTIONS) only while what they depend on is unchanged:
    keyword-only defaults set later, a renamed qualname, defaults replaced by equal-comparing ones of another bit
    pattern (0.0 -> -0.0), a module-level function replaced, a mutable default changed in place (never kept), a
    closure's cell replaced (never kept). Each is a difference; undone, none is. The kept text equals the text read
    without the cache, entry for entry."""
    from transformers.models.llama import modeling_llama as ml

    from hf_unlearn.trace import digests
    from hf_unlearn.trace.digests import describe_difference, program_state

    tok, _ = get_trace_data()
    model = tiny(tok)
    program_state(model)  # fills the cache
    before = program_state(model)

    def plain(x, scale=0.0):
        return x * scale

    def with_list(x, seen=[]):  # noqa: B006 (the point: a mutable default)
        return x

    factor = 1.0

    def closing(x):
        return x * factor

    attrs = [(ml.LlamaMLP.forward, "__kwdefaults__", {"extra": 1}), (ml.rotate_half, "__qualname__", "rotate_other")]
    for fn, attr, value in attrs:
        saved = getattr(fn, attr)
        setattr(fn, attr, value)
        try:
            assert describe_difference(before, program_state(model)), (fn, attr)
        finally:
            setattr(fn, attr, saved)
        assert describe_difference(before, program_state(model)) is None

    for fn in (plain, with_list, closing):
        monkeypatch.setattr(ml, "user_helper", fn, raising=False)
        base = program_state(model)
        assert program_state(model) == base
        if fn is plain:
            fn.__defaults__ = (-0.0,)
        elif fn is with_list:
            fn.__defaults__[0].append(1)
        else:
            closing.__closure__[0].cell_contents = 2.0
        what = describe_difference(base, program_state(model))
        assert "code module transformers.models.llama.modeling_llama" in what, fn
    monkeypatch.delattr(ml, "user_helper")

    cached = program_state(model)
    monkeypatch.setattr(digests, "_FUNCTIONS", _NeverKept())
    assert program_state(model) == cached


class _Marker:
    """A class a kept namespace names (renaming it is a change)."""


class _Target:
    def act(self):
        return 1


class _OtherTarget:
    def act(self):
        return 1


def _wrap(fn):
    def wrapper(*a, **k):
        return fn(*a, **k)
    return wrapper


class _Setting:
    """A decorator's state object: written as its class and attributes."""

    def __init__(self):
        self.k = 1


def _with(setting):
    def decorate(fn):
        def wrapper(*a, **k):
            return fn(*a, **k) * setting.k
        return wrapper
    return decorate


_SETTING = _Setting()


class _UserLayer(torch.nn.Module):
    """A module whose class namespace holds each kind of entry a kept digest must pin."""

    kind = _Marker
    holder = _Marker()

    def forward(self, x, scale=1):
        return x * scale

    def keyed(self, x, *, k=1):
        return x * k

    @_wrap
    def decorated(self, x):
        return x

    bound = _wrap(_Target().act)  # a bound method in a closure: written as its function and its object's class

    @_with(_SETTING)
    def scaled(self, x):
        return x


def test_a_kept_namespace_digest_equals_a_fresh_one_after_every_edit(monkeypatch):
    """Classes' and modules' code digests are kept between snapshots (digests._NAMESPACES) while the objects they
    depend on are the same: every edit of one of those objects, made in place, gives the digest a fresh read gives
    (the cache cleared), and the edited program differs from the original."""
    from transformers.models.llama import modeling_llama as ml

    from hf_unlearn.trace import digests
    from hf_unlearn.trace.digests import describe_difference, program_state

    tok, _ = get_trace_data()
    model = tiny(tok)
    model.add_module("user_layer", _UserLayer())
    monkeypatch.setitem(vars(ml), "user_marker", _Marker)  # a module global class, named by the module's digest
    original = program_state(model)
    assert program_state(model) == original and id(_UserLayer) in digests._NAMESPACES  # kept

    def fresh():
        kept = program_state(model)
        saved = dict(digests._NAMESPACES)
        digests._NAMESPACES.clear()
        try:
            return kept, program_state(model)
        finally:
            digests._NAMESPACES.update(saved)

    def other(self, x, scale=1):
        return -x

    inner = _UserLayer.__dict__["decorated"].__closure__[0]
    forward = _UserLayer.__dict__["forward"]
    edits = [
        (lambda: setattr(_UserLayer, "forward", other), lambda: setattr(_UserLayer, "forward", forward)),
        (_UserLayer.forward, "__code__", other.__code__),
        (_UserLayer.forward, "__defaults__", (True,)),  # 1 == True: an equality test would keep the old text
        (_UserLayer.forward, "__defaults__", (1.0,)),
        (_UserLayer.forward, "__qualname__", "_UserLayer.renamed"),
        (_UserLayer.keyed.__kwdefaults__, "k", True),  # a dict edited in place
        (inner, "cell_contents", other),  # the decorated function replaced inside its wrapper's closure
        (inner.cell_contents, "__code__", other.__code__),  # the wrapped function's code, one level down
        (_Marker, "__qualname__", "_Renamed"),  # the class a class attribute and a module global name
        (_Marker, "__module__", "elsewhere"),
        (_UserLayer.holder, "__func__", other),  # an object in the namespace given a __func__ later
        (_UserLayer.bound.__closure__[0].cell_contents.__self__, "__class__", _OtherTarget),  # a bound method's object, of another class now
        (_SETTING, "k", True),  # an object's attribute, in a closure (below the depth the digest writes out)
        (_SETTING, "extra", 1),  # an attribute added
        (ml.rotate_half, "__code__", other.__code__),
        (ml, "rotate_half", other),
    ]
    for edit in edits:
        if callable(edit[0]) and len(edit) == 2:
            do, undo = edit
        else:
            obj, attr, value = edit
            is_dict = isinstance(obj, dict)
            saved = obj[attr] if is_dict else getattr(obj, attr, digests._MISSING)

            def do(obj=obj, attr=attr, value=value, is_dict=is_dict):
                obj.__setitem__(attr, value) if is_dict else setattr(obj, attr, value)

            def undo(obj=obj, attr=attr, saved=saved, is_dict=is_dict):
                if is_dict:
                    obj[attr] = saved
                elif saved is digests._MISSING:
                    delattr(obj, attr)
                else:
                    setattr(obj, attr, saved)
        do()
        try:
            kept, read = fresh()
            assert kept == read, (edit, describe_difference(read, kept))
            assert describe_difference(original, kept) or edit[0] is _SETTING, edit
        finally:
            undo()
        kept, read = fresh()
        assert kept == read == original, edit
    assert _UserLayer.__dict__["forward"] is forward


def test_a_kept_optimizer_class_digest_follows_torchs_profiling_wrapper():
    """The optimizer class whose ``step`` torch wrapped in its profiling wrapper is kept too: what the wrapper wraps
    replaced, or the step it would inherit changed on a base class, gives the digest a fresh read gives."""
    from hf_unlearn.trace import digests
    from hf_unlearn.trace.digests import program_state

    class Opt(torch.optim.SGD):
        def step(self, closure=None):  # its own (an SGD made earlier in this process left SGD.step wrapped, and
            return super().step(closure)  # torch wraps an inherited step only once, on the class that defines it)

    model = torch.nn.Linear(2, 2)
    opt = Opt(model.parameters(), lr=0.1)  # the first optimizer of this class: torch wraps Opt.step
    assert getattr(Opt.__dict__["step"], "hooked", False)
    original = program_state(model, opt)
    assert id(Opt) in digests._NAMESPACES  # kept, wrapper and all

    def step(self, closure=None):
        return None

    wrapper = Opt.__dict__["step"]
    wrapped, sgd = wrapper.__wrapped__, torch.optim.SGD.__dict__["step"]
    for do, undo in ((lambda: setattr(wrapper, "__wrapped__", step), lambda: setattr(wrapper, "__wrapped__", wrapped)),
                     (lambda: setattr(torch.optim.SGD, "step", step), lambda: setattr(torch.optim.SGD, "step", sgd))):
        do()
        try:
            kept = program_state(model, opt)
            saved = dict(digests._NAMESPACES)
            digests._NAMESPACES.clear()
            assert kept == program_state(model, opt)
            digests._NAMESPACES.update(saved)
            assert kept != original
        finally:
            undo()
        assert program_state(model, opt) == original


class _NeverKept(dict):
    """A function-text cache that never answers (every text read afresh)."""

    def get(self, key, default=None):
        return default


def _odd_program(tok):
    """A tiny model (PEFT LoRA on it) and an optimizer whose attributes take every branch of program_state: NaN, an
    IntEnum, a bool, empty and non-empty hook dicts (with kwargs, always called), empty containers of each kind, an
    empty dict under a key ending in "hooks" that is not torch's, a key FSDP2 names like its per-module state."""
    import enum

    from peft import LoraConfig, get_peft_model

    class Mode(enum.IntEnum):
        A = 1

    model = get_peft_model(tiny(tok), LoraConfig(r=2, target_modules=["q_proj"], lora_dropout=0.0))
    mods = [m for _, m in model.named_modules()]
    mods[3].__dict__.update(nan_value=float("nan"), mode=Mode.A, flag=True, empty_list=[], empty_tuple=(),
                            empty_set=set(), empty_frozen=frozenset(), empty_dict={}, my_hooks={},
                            **{"__composable_api_state_key_1": 3})
    mods[4].register_forward_hook(_user_hook, with_kwargs=True, always_call=True)
    mods[5].register_forward_pre_hook(_user_pre_hook)
    return model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])


def _user_hook(module, args, kwargs, output):
    return output


def _user_pre_hook(module, args):
    return None


def test_the_program_digests_shortcuts_give_what_the_general_path_gives(monkeypatch):
    """program_state's fast paths (plain values, empty containers and hook dicts) write what Digester's general path
    writes, entry for entry, on a program built to take every branch."""
    from hf_unlearn.trace import digests

    tok, _ = get_trace_data()
    model, optimizer = _odd_program(tok)
    fast = digests.program_state(model, optimizer)
    monkeypatch.setattr(digests, "_EXACT_PLAIN", frozenset())
    monkeypatch.setattr(digests, "_EMPTY", {})
    monkeypatch.setattr(digests, "_HOOK_DICTS", ())
    general = digests.program_state(model, optimizer)
    assert list(fast) == list(general)
    assert {k: repr(v) for k, v in fast.items()} == {k: repr(v) for k, v in general.items()}
    assert any("_user_hook" in str(v) for v in fast.values()) and any("_user_pre_hook" in str(v) for v in fast.values())


def test_a_tensor_attribute_is_read_by_its_bytes_unless_it_is_one_of_the_models_own_tensors():
    """A tensor a module holds as an attribute is digested by its bytes (an edit through .data changes the program);
    one of the model's own parameters (the very object: a GGUF-loaded model's GGUFOrigin holds them all) is digested
    by name, its values being the exact checksums' at every step: an optimizer step no longer reads as a program
    change of a GGUF-loaded model trained whole (it did, at every step), and the attribute pointed at another tensor
    of the same bytes still is one."""
    from hf_unlearn.models import GGUF_MARK, mark_gguf
    from hf_unlearn.trace.digests import describe_difference, program_state

    tok, _ = get_trace_data()
    model = tiny(tok)
    model.model.layers[0].mlp.scale_hint = torch.ones(3)
    before = program_state(model)
    model.model.layers[0].mlp.scale_hint.data[1] = 2.0
    assert "scale_hint" in describe_difference(before, program_state(model))

    model = tiny(tok)
    mark_gguf(model, "model.gguf", torch.float32)
    before = program_state(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model(input_ids=torch.tensor([[1, 2, 3]]), labels=torch.tensor([[1, 2, 3]])).loss.backward()
    optimizer.step()
    assert describe_difference(before, program_state(model)) is None
    origin = getattr(model, GGUF_MARK)
    key = next(iter(origin.params))
    origin.params[key] = (origin.params[key][0].clone(), origin.params[key][1])
    assert GGUF_MARK in describe_difference(before, program_state(model))


@pytest.mark.parametrize("targets", [dict(target_modules=["q_proj", "v_proj"]),
                                     dict(target_modules=["q_proj", "lm_head"], modules_to_save=["embed_tokens"])])
def test_the_merged_copy_sharing_the_frozen_base_is_the_deep_copys_merge_and_leaves_the_model(targets):
    """lineage.merged_copy (the sealed output root of a PEFT run) shares with the live model what the merge only
    reads: its weights equal ``copy.deepcopy(model).merge_and_unload()``'s bit for bit (LoRA on attention, on a tied
    head, a module saved whole), and the live model keeps its adapters and every bit of its tensors."""
    import copy

    from peft import LoraConfig, get_peft_model

    from hf_unlearn.trace.lineage import base_weights, merged_copy

    tok, _ = get_trace_data()
    model = get_peft_model(tiny(tok), LoraConfig(r=2, lora_dropout=0.0, **targets))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(torch.randn(p.shape, generator=g) * 0.1)  # a trained adapter (B is zero at initialisation)
    live = {n: t.clone() for n, t in model.state_dict().items()}
    merged, expected = merged_copy(model).state_dict(), copy.deepcopy(model).merge_and_unload().state_dict()
    assert list(merged) == list(expected)
    assert all(torch.equal(merged[n], expected[n]) for n in expected)
    base = base_weights(live)  # the live model's base weights under the plain names
    assert any(n in base and not torch.equal(expected[n], base[n]) for n in expected)  # the adapter was merged
    now = model.state_dict()
    assert list(now) == list(live) and all(torch.equal(now[n], live[n]) for n in live)


def test_a_lora_runs_sealed_output_root_is_its_merged_checkpoints(tmp_path):
    """The output root a LoRA recording seals (merged_copy, sharing the frozen base) is the root lineage computes
    from the run's final checkpoint merged the way a later stage's recording finds its parent."""
    from peft import LoraConfig, get_peft_model

    from hf_unlearn.trace import open_run
    from hf_unlearn.trace.lineage import output_root

    tok, data = get_trace_data()
    model = get_peft_model(tiny(tok), LoraConfig(r=2, lora_dropout=0.0, target_modules=["q_proj", "v_proj"]))
    record(tok, data.select(range(8)), tmp_path, model=model, every=2, learning_rate=1e-2)
    header = json.loads((tmp_path / "trace" / "header.json").read_text())
    assert header["lineage"]["output_root"] == output_root(open_run(tmp_path / "trace"))


def test_the_dummy_weight_probe_runs_on_the_shortest_real_row_with_tokens_to_train_on():
    """The probe's forward and backward passes cost its row's tokens: it takes the shortest of the first rows, not
    one with an empty token column (a pair without a completion shows nothing) nor one with nothing to train on."""
    from datasets import Dataset

    from hf_unlearn.trace.recorder.preflight import probe_row

    pairs = Dataset.from_dict({"id": [10, 11, 12, 13], "prompt_ids": [[1] * 30, [1], [1, 2], [1] * 5],
                               "chosen_ids": [[2] * 30, [], [3], [2] * 5], "rejected_ids": [[4] * 30, [5], [6, 7], [4]]})
    assert probe_row(pairs, "id") == {"prompt_ids": [1, 2], "chosen_ids": [3], "rejected_ids": [6, 7]}
    rows = Dataset.from_dict({"id": ["a", "b", "c"], "input_ids": [[1] * 9, [1, 2], [1, 2, 3]],
                              "completion_mask": [[1] * 9, [0, 0], [0, 1, 1]]})
    assert probe_row(rows, "id") == {"input_ids": [1, 2, 3], "completion_mask": [0, 1, 1]}
    masks = Dataset.from_dict({"id": [1, 2], "input_ids": [[1] * 4, [1]], "assistant_masks": [[1] * 4, [0]]})
    assert probe_row(masks, "id")["input_ids"] == [1] * 4
    labels = Dataset.from_dict({"id": [1, 2], "input_ids": [[1] * 4, [1]], "labels": [[1] * 4, [-100]]})
    assert probe_row(labels, "id")["input_ids"] == [1] * 4
    none = Dataset.from_dict({"id": [1], "input_ids": [[]]})
    assert probe_row(none, "id") == {"input_ids": []}  # no candidate: the first row, as before


def test_the_dpo_probe_runs_on_a_pairs_first_tokens_with_unequal_rows():
    """The DPO preflight's two passes cost their pair's tokens: they run on the last prompt tokens and the first
    chosen and rejected ones of the shortest real pair, rows of unequal lengths where the pair's are; a row with other
    token columns is kept whole. (The coupled-loss and dummy-gradient attacks are refused on such a pair:
    tests/test_trace_dpo_attacks.py and tests/test_trace_dpo.py run them on TOFU pairs, which it cuts.)"""
    from hf_unlearn.trace.preference import probe_pair

    row = {"prompt_ids": list(range(10)), "chosen_ids": list(range(20, 50)), "rejected_ids": list(range(60, 80))}
    assert probe_pair(row) == {"prompt_ids": [8, 9], "chosen_ids": [20, 21], "rejected_ids": [60]}
    short = {"prompt_ids": [1], "chosen_ids": [2], "rejected_ids": [5, 6, 7, 8, 9]}
    assert probe_pair(short) == {"prompt_ids": [1], "chosen_ids": [2], "rejected_ids": [5, 6]}  # still unequal
    same = {"prompt_ids": [1], "chosen_ids": [2, 3], "rejected_ids": [5, 6]}
    assert probe_pair(same) == same  # equal rows stay equal: no padding the pair does not have
    longer = {"prompt_ids": [1], "chosen_ids": [2, 3, 4], "rejected_ids": [5, 6, 7]}
    assert probe_pair(longer) == {"prompt_ids": [1], "chosen_ids": [2, 3], "rejected_ids": [5, 6]}
    images = {**row, "pixel_values": [[0.5]]}
    assert probe_pair(images) is images


def test_an_adapter_disabled_references_root_is_the_start_root_hashed_once(tmp_path):
    """A LoRA DPO recording with ref_model=None takes its reference's params_root from the lineage's start root (the
    base weights hashed once as training starts, not again at construction): it is the root reference_root computes
    from the base (the slow path), and an edit of the base between construction and train() is in it. A
    modules_to_save adapter (whose reference_root names more tensors) still hashes its reference itself."""
    from peft import LoraConfig, get_peft_model
    from trl import DPOTrainer

    from hf_unlearn.trace import open_run, trace_recording
    from hf_unlearn.trace.preference import is_start_root
    from hf_unlearn.trace.reference import reference_root

    from .test_trace_dpo import dpo_config, pairs, saved_model

    tok, data = pairs(n=4)
    base = tmp_path / "base"
    lora = LoraConfig(r=2, lora_dropout=0.0, target_modules=["q_proj", "v_proj"])
    trainer = trace_recording(DPOTrainer)(
        model=saved_model(base, tok), args=dpo_config(tmp_path / "rec", max_steps=1), train_dataset=data,
        processing_class=tok, peft_config=lora, trace_checkpoint_steps=1)
    assert trainer._trace_reference["params_root"] is None
    edited = saved_model(base, tok)
    with torch.no_grad():  # between construction and train(): the reference trains against the edited base
        for m in (edited, trainer.accelerator.unwrap_model(trainer.model).get_base_model()):
            m.model.norm.weight.mul_(2.0)
    trainer.train()
    run = open_run(tmp_path / "rec" / "trace")
    ref = run.header["reference_model"]
    assert ref["kind"] == "adapter_disabled"
    assert ref["params_root"] == run.header["lineage"]["start_root"] == reference_root(edited)
    assert ref["params_root"] != reference_root(saved_model(base, tok))
    assert is_start_root(get_peft_model(saved_model(base, tok), lora))
    saved = LoraConfig(r=2, target_modules=["q_proj"], modules_to_save=["lm_head"])
    assert not is_start_root(get_peft_model(saved_model(base, tok), saved))


class _EditFrozen(TrainerCallback):
    """A callback that writes a frozen base weight after the first optimizer step: in place (its version counter
    moves), through ``.data`` (which no version counter sees), or replaces it with a new tensor."""

    def __init__(self, how: str):
        self.how = how

    def on_step_end(self, args, state, control, model=None, **kw):
        if state.global_step == 1 and self.how == "replaced":  # a new tensor; the old one freed
            module = model.get_submodule("base_model.model.model.layers.0.mlp.up_proj")
            module.weight = torch.nn.Parameter(module.weight.detach() + 0.5, requires_grad=False)
        elif state.global_step == 1 and self.how:
            weight = dict(model.named_parameters())["base_model.model.model.layers.0.mlp.up_proj.weight"]
            with torch.no_grad():
                (weight.data if self.how == "data" else weight).add_(0.5)


@pytest.mark.parametrize("how", ["", "in place", "data", "replaced"])
def test_a_lora_runs_sealed_output_root_reuses_start_hashes_only_for_the_bytes_its_output_holds(tmp_path, how,
                                                                                                monkeypatch):
    """Sealing a LoRA run takes the frozen base's hashes from those the lineage computed as training started (the
    frozen store saved at step 0, the tensor's stamp unchanged) instead of hashing the base again: the root is the one
    hashing every tensor gives, and the run's output_root (its final checkpoint merged). A frozen weight written in
    place during training is hashed again (the checkpoint stores it); one written through .data keeps the start's
    hash, which binds the store's bytes the final checkpoint references, so the sealed root is still output_root(run)
    (hashing the live model would have sealed a root of bytes no checkpoint holds); one replaced is hashed again."""
    from peft import LoraConfig, get_peft_model

    from hf_unlearn.trace import lineage, open_run

    reused = []
    slow = lineage.weights_hashes

    def spy(state, known=None):
        out = slow(state, known)
        reused.append(sum(1 for n in out if known and n in known and out[n] == known[n][1]))
        return out

    monkeypatch.setattr(lineage, "weights_hashes", spy)
    tok, data = get_trace_data()
    model = get_peft_model(tiny(tok), LoraConfig(r=2, lora_dropout=0.0, target_modules=["q_proj", "v_proj"]))
    trainer = record(tok, data.select(range(8)), tmp_path, model=model, every=2, learning_rate=1e-2,
                     trainer_kwargs={"callbacks": [_EditFrozen(how)]})
    header = json.loads((tmp_path / "trace" / "header.json").read_text())
    sealed = header["lineage"]["output_root"]
    assert sealed == lineage.output_root(open_run(tmp_path / "trace"))
    assert reused[1] > 0  # the sealing's call (the first: the lineage at the start) reused the start's hashes
    if how != "data":  # the live model is the output: hashing it whole gives the same root
        assert sealed == lineage.live_output_root(trainer.model, header)
    else:
        assert sealed != lineage.live_output_root(trainer.model, header)


@pytest.mark.parametrize("family,targets", [
    ("llama", dict(target_modules=["q_proj", "v_proj"])),
    ("llama", dict(target_modules=["q_proj", "v_proj", "down_proj"], use_dora=True)),
    ("llama", dict(target_modules=["q_proj", "lm_head"])),  # a tied head: the whole-model copy
    ("llama", dict(target_modules=["q_proj"], modules_to_save=["embed_tokens"])),  # a wrapper: the same
    ("gpt2", dict(target_modules=["c_attn"], fan_in_fan_out=True)),  # Conv1D, a bias
    ("gpt2", dict(target_modules=["c_attn", "c_fc"], fan_in_fan_out=True, lora_bias=True)),  # the merge writes a bias
])
def test_the_merged_state_merging_each_tuner_layer_alone_is_the_deep_copys_merge(family, targets):
    """lineage.merged_state (the sealed output root of a PEFT run: each tuner layer copied and merged alone, the rest
    the live model's) is ``copy.deepcopy(model).merge_and_unload().state_dict()`` bit for bit, names and order
    included, in bf16 too; the live model keeps its adapters and every bit of its tensors."""
    import copy

    from peft import LoraConfig, get_peft_model

    from hf_unlearn.models import build_tiny_model
    from hf_unlearn.trace.lineage import merged_state

    tok, _ = get_trace_data()
    for dtype in (torch.float32, torch.bfloat16):
        base = build_tiny_model(family, tok, hidden_size=32, num_layers=2, num_heads=2, seed=0).to(dtype)
        model = get_peft_model(base, LoraConfig(r=2, lora_dropout=0.0, **targets))
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for p in model.parameters():
                if p.requires_grad:
                    p.add_((torch.randn(p.shape, generator=g) * 0.1).to(p.dtype))
        live = {n: t.clone() for n, t in model.state_dict().items()}
        fast, expected = merged_state(model), copy.deepcopy(model).merge_and_unload().state_dict()
        assert list(fast) == list(expected), (family, targets)
        assert all(fast[n].dtype == expected[n].dtype and torch.equal(fast[n], expected[n]) for n in expected)
        now = model.state_dict()
        assert list(now) == list(live) and all(torch.equal(now[n], live[n]) for n in live)
        assert not any(getattr(m, "merged_adapters", []) for m in model.modules())


def test_the_sft_probe_runs_on_a_window_around_the_rows_first_token_to_train_on():
    """The SFT dummy-weight probe's pass costs its row's tokens: it runs on 8 consecutive tokens around the first
    token to train on (a completion or assistant mask, labels), every token column cut alike; a short row or one with
    other columns is kept whole. (A loss with a term on every token is still refused: tests/test_trace_sft.py.)"""
    from hf_unlearn.trace.recorder.probe import probe_window

    row = {"input_ids": list(range(30)), "completion_mask": [0] * 20 + [1] * 10, "attention_mask": [1] * 30}
    assert probe_window(row) == {"input_ids": list(range(16, 24)), "completion_mask": [0] * 4 + [1] * 4,
                                 "attention_mask": [1] * 8}
    late = {"input_ids": list(range(30)), "labels": [-100] * 28 + [28, 29]}
    assert probe_window(late) == {"input_ids": list(range(22, 30)), "labels": [-100] * 6 + [28, 29]}
    both = {"input_ids": list(range(12)), "assistant_masks": [0, 1] * 6, "completion_mask": [0, 0, 0, 1] * 3}
    assert probe_window(both)["input_ids"] == list(range(0, 8))  # the first token both masks train: 3
    plain = {"input_ids": list(range(20))}
    assert probe_window(plain) == {"input_ids": list(range(8))}
    for kept in ({"input_ids": [1, 2, 3]}, {"input_ids": list(range(20)), "position_ids": list(range(20))}):
        assert probe_window(kept) is kept


def test_a_resumed_lora_dpo_recording_hashes_its_adapter_disabled_reference_and_completes(tmp_path):
    """A resumed recording keeps its earlier lineage (no start root computed as it resumes): the adapter-disabled
    reference is hashed when the header is built, compared with the one the earlier steps recorded, and the run
    completes with the same root."""
    from peft import LoraConfig
    from trl import DPOTrainer

    from hf_unlearn.trace import open_run, trace_recording

    from .test_trace_dpo import dpo_config, pairs, saved_model

    class Crash(TrainerCallback):  # defined here: not importable, so not replayed
        def on_step_end(self, args, state, control, **kwargs):
            control.should_training_stop = state.global_step == 3

    tok, data = pairs(n=12)

    def recorder(callbacks=()):
        return trace_recording(DPOTrainer)(
            model=saved_model(tmp_path / "base", tok), args=dpo_config(tmp_path / "rec", max_steps=4,
                                                                       save_strategy="steps", save_steps=2),
            train_dataset=data, processing_class=tok, callbacks=list(callbacks), trace_checkpoint_steps=2,
            peft_config=LoraConfig(r=2, lora_dropout=0.0, target_modules=["q_proj", "v_proj"]))

    recorder([Crash()]).train()
    first = json.loads((tmp_path / "rec" / "trace" / "header.json").read_text())["reference_model"]["params_root"]
    resumed = recorder()
    resumed.train(resume_from_checkpoint=str(tmp_path / "rec" / "checkpoint-2"))
    assert resumed.state.global_step == 4
    header = open_run(tmp_path / "rec" / "trace").header
    assert header["reference_model"]["params_root"] == first == header["lineage"]["start_root"]


def test_one_walk_of_the_module_tree_reads_what_the_separate_walks_read():
    """`program_controls` walks the module tree once (a LoRA model has about 1,000 modules) instead of five times:
    each part is still what its own walk gives (`named_parameters(remove_duplicate=False)` for the trainable names,
    `named_modules()`/`named_parameters()` for the rest), on a model built to tell them apart: a tied embedding, a
    frozen weight, a module under two names, a parameter shared by two modules, a `None` parameter, module and
    parameter hooks, a replaced `forward` and a global module hook."""
    from torch.nn.modules import module as torch_module
    from transformers import LlamaConfig, LlamaForCausalLM

    from hf_unlearn.trace.guards import MODULE_HOOKS, PLAIN, TENSOR_HOOKS, _hook_name, program_controls

    m = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                     num_key_value_heads=2, vocab_size=64, tie_word_embeddings=True))
    m.model.layers[0].mlp.register_forward_hook(lambda *a: None)
    m.lm_head.weight.register_hook(lambda g: g)  # the tied weight: named once, by its first name
    m.model.layers[0].mlp.forward = lambda x: x
    m.twice = m.model.layers[0]
    m.model.layers[1].mlp.gate_proj.weight.requires_grad_(False)
    m.model.layers[1].mlp.down_proj.register_parameter("shared", m.model.norm.weight)
    m.model.layers[1].mlp.up_proj.register_parameter("absent", None)
    handle = torch_module.register_module_forward_hook(lambda *a: None)
    try:
        got = program_controls(m, torch.optim.AdamW(m.parameters()))
        found = [("torch.nn (global)", a, fn) for a in MODULE_HOOKS
                 for fn in (getattr(torch_module, f"_global{a}", None) or {}).values()]
        for name, mod in m.named_modules():
            found += [(name or "(the model)", a, fn) for a in MODULE_HOOKS for fn in getattr(mod, a).values()]
            found += [(name or "(the model)", "forward", vars(mod)["forward"])] if "forward" in vars(mod) else []
        found += [(n, a, fn) for n, p in m.named_parameters() for a in TENSOR_HOOKS
                  for fn in (getattr(p, a, None) or {}).values()]
    finally:
        handle.remove()
    assert got["trainable"] == [n for n, p in m.named_parameters(remove_duplicate=False) if p.requires_grad]
    assert "twice.mlp.gate_proj.weight" in got["trainable"] and "lm_head.weight" in got["trainable"]
    assert list(got["modules"]) == [n for n, _ in m.named_modules()] and "twice" not in got["modules"]
    assert got["modules"]["model.layers.0.mlp"] == {k: v for k, v in vars(m.model.layers[0].mlp).items()
                                                    if not k.startswith("_") and isinstance(v, PLAIN)}
    assert got["hooks"] == sorted(f"{w}.{a.strip('_')}: {n}" for w, a, fn in found if (n := _hook_name(fn)))
    assert len(got["hooks"]) == 4 and any(h.startswith("model.embed_tokens.weight.backward_hooks") for h in got["hooks"])
    assert len(got["code"]) == len({type(mod) for mod in m.modules()})


def test_the_kept_program_digest_is_a_fresh_one_after_every_edit_equality_cannot_see():
    """state_digest_of keeps the last state's digest while the state is written out alike: values that compare
    equal but are written otherwise (1 and True, 0.0 and -0.0, [1] and [True]) are a new digest."""
    import hashlib

    from hf_unlearn.trace import digests

    def fresh(state):
        h = hashlib.sha256()
        for k in sorted(state):
            h.update(f"{k}\0{state[k]!r}\n".encode())
        return h.hexdigest()[:16]

    base = {"args.lr": 0.001, "module a: flag": 1, "module a: zero": 0.0, "torch sdp": [True, False],
            "code class X": "abc", "args.none": None}
    edits = [{}, {"module a: flag": True}, {"module a: zero": -0.0}, {"torch sdp": [1, False]},
             {"code class X": "abd"}, {"args.new": 1}, {"args.lr": 0.001 + 1e-18}, {"args.none": "None"}]
    for edit in edits + edits[::-1]:
        state = {**base, **edit}
        assert digests.state_digest_of(state) == fresh(state), edit
        assert digests.state_digest_of(dict(state)) == fresh(state), edit  # kept: the same digest
    dropped = {k: v for k, v in base.items() if k != "args.none"}
    assert digests.state_digest_of(dropped) == fresh(dropped)


def test_a_container_of_plain_values_is_written_as_the_general_path_writes_it():
    import random

    from hf_unlearn.trace.digests import MAX_ITEMS, Digester, _short

    rng = random.Random(0)
    pool = [0, 1, -1, 2**70, 0.0, -0.0, 1.5, float("nan"), float("inf"), True, False, None, "", "a'b", 'q"', "é\n"]
    values = [{}, [], {"default": 8}, ["default"], {1: "x", "y": None, 2.5: True}, [[1], 2], {"a": [1]},
              list(range(MAX_ITEMS + 1)), {i: i for i in range(MAX_ITEMS + 1)}]
    values += [{rng.choice(pool[9:]) if i % 2 else f"k{i}": rng.choice(pool) for i in range(rng.randint(0, 6))}
               for _ in range(200)]
    values += [[rng.choice(pool) for _ in range(rng.randint(0, 6))] for _ in range(200)]
    for v in values:
        fast, general = Digester(), Digester()
        assert fast.leaf(v) == _short(general.text(v, 0)), v


def test_a_full_fine_tunes_step_0_checkpoint_takes_the_hashes_the_lineage_took(tmp_path, monkeypatch):
    """A full fine-tune's step-0 checkpoint holds the weights the lineage hashed as training started, in the same
    stamps: their hashes are taken from there instead of hashing every weight again; later checkpoints hash what
    they hold, and the step-0 checkpoint's hashes are the ones its files give."""
    from hf_unlearn.trace import checkpoints
    from hf_unlearn.trace.checkpoints import checkpoint_dir, load_checkpoint

    seen = []
    slow = checkpoints.checkpoint_hashes

    def spy(state, known=None, plain=None):
        seen.append((state["step"], set(known or ()), set(state["model"])))
        return slow(state, known, plain)

    monkeypatch.setattr(checkpoints, "checkpoint_hashes", spy)
    tok, data = get_trace_data()
    record(tok, data.select(range(16)), tmp_path, every=1)
    steps = [s[0] for s in seen]
    recording = seen[:steps.index(0, 1)] if steps.count(0) > 1 else seen  # then the self-check's replay hashes
    (_, known, names), = [s for s in recording if s[0] == 0]
    assert known == names and names  # every weight's hash was the lineage's
    assert all(not known for step, known, _ in recording if step > 0)
    d = checkpoint_dir(tmp_path / "trace", 0)
    assert slow(load_checkpoint(d, verify=False), plain=True) == json.loads((d / "hashes.json").read_text())
    checkpoints.verify_checkpoint_files(d)
