"""Views and metadata are not value reads; every way from a view to the values still is (issue #41 over-refusal).

A watched callback (one replays do not run) that read tensor values and changed nothing blocks deletions past that
step (:mod:`hf_unlearn.trace.value_reads`). Taking a view (``p.view(-1)``, ``p.t()``, ``p[0]``, ``p.detach()``,
``p.data``, a DTensor's ``to_local()``) or reading metadata (``numel()``, ``shape``, ``requires_grad``) used to count
as a read: a callback logging its trainable parameter count blocked every deletion. A view holds no value of its own;
what reads one later (``.item()``, a comparison, ``repr``, ``.numpy()``, ``.tolist()``, ``data_ptr``) is still seen.
"""

from __future__ import annotations

import copy
import ctypes
import pickle
import warnings

import pytest
import torch
from transformers import TrainerCallback

from .test_trace_instep_attacks import AT, _record, _refused_or_counterfactual


def _disabled(f):
    def run(p):
        with torch._C.DisableTorchFunction():
            return f(p)
    return run


NOT_READS = {  # what a callback logging shapes and parameter counts does
    "numel of the trainable": lambda p: sum(q.numel() for q in [p] if q.requires_grad),
    "view shape": lambda p: p.view(-1).shape, "reshape": lambda p: p.reshape(3, 4).size(), "t": lambda p: p.t().shape,
    "T": lambda p: p.T.shape, "index": lambda p: p[0], "slice of a view": lambda p: p.view(-1)[1:3].shape,
    "detach": lambda p: p.detach(), ".data": lambda p: p.data.shape, "grad view": lambda p: p.grad.view(-1).shape,
    "metadata": lambda p: (p.size(), p.dim(), len(p), p.dtype, p.device, p.requires_grad, p.is_contiguous(),
                           p.stride(), p.grad is None),
    "split and iterate": lambda p: [r.shape for r in p] + [s.shape for s in p.split(2)],
    "expand": lambda p: p.unsqueeze(0).expand(2, 4, 3).shape, "flatten": lambda p: torch.flatten(p).shape,
    "cpu of a cpu tensor": lambda p: p.cpu(), "to its own dtype": lambda p: p.to(torch.float32),
}
READS = {
    "item of a view": lambda p: p.view(-1)[0].item(), "branch on a view": lambda p: bool(p.view(-1)[0] > 0.5),
    "T.abs().max()": lambda p: p.T.abs().max(), "Tensor.__repr__": lambda p: torch.Tensor.__repr__(p.view(-1)),
    "print": lambda p: str(p[0]), "format": lambda p: f"{p[0, 0]:.3f}", "float": lambda p: float(p.detach()[0, 0]),
    "equal": lambda p: torch.equal(p.view(-1), p.view(-1)), "tolist": lambda p: p.view(-1).tolist(),
    "numpy of a view": lambda p: p.detach().view(-1).numpy(), "__array__": lambda p: p.detach().__array__(),
    "untyped_storage": lambda p: p.view(-1).untyped_storage()[0],
    "data_ptr and ctypes": lambda p: ctypes.c_float.from_address(p.view(-1).data_ptr()).value,
    "pickle": lambda p: pickle.dumps(p.detach()), "clone": lambda p: p.clone(), "deepcopy": lambda p: copy.deepcopy(p),
    "to another dtype": lambda p: p.to(torch.float64), "reshape that copies": lambda p: p.t().reshape(-1),
    "index by a tensor": lambda p: p[torch.tensor([0])], "index by a 0-dim tensor": lambda p: p[torch.tensor(1)], "in-place edit of a view": lambda p: p.data.view(-1)[0].add_(0),
    "setitem": lambda p: p.data.__setitem__(0, 1.0),
    "a view under DisableTorchFunction": _disabled(lambda p: p.grad.view(-1)),
    "numpy under DisableTorchFunction": _disabled(lambda p: p.data.numpy()),
}


@pytest.mark.parametrize("read,how", [(False, k) for k in NOT_READS] + [(True, k) for k in READS],
                         ids=lambda x: x if isinstance(x, str) else ("read" if x else "not"))
def test_views_and_metadata_are_not_reads_and_what_reads_a_view_is(read, how):
    from hf_unlearn.trace.value_reads import ValueReads

    p = torch.nn.Parameter(torch.arange(12.0).view(4, 3))
    p.grad = torch.ones(4, 3)
    with ValueReads() as reads, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # float() of a tensor that requires grad
        (READS if read else NOT_READS)[how](p)
    assert (reads.first is not None) == read, (how, reads.first)


# ---- real runs ---------------------------------------------------------------------------------------------------
def _shape_logger():
    """A script's own callback (watched: defined in a function) that logs the trainable parameter count and shapes,
    taken through views, and the gradients' shapes: no value read."""

    class ShapeLogger(TrainerCallback):
        def __init__(self):
            self.seen = []

        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
            self.seen.append([tuple(p.grad.view(-1).shape) for p in model.parameters() if p.grad is not None])

        def on_optimizer_step(self, args, state, control, model=None, **kwargs):
            ps = list(model.parameters())
            self.seen.append((sum(p.numel() for p in ps if p.requires_grad), [tuple(p.shape) for p in ps],
                              [p.view(-1).shape[0] + p.reshape(-1).numel() + len(p.detach()) + p[0].dim()
                               + p.data.ndim for p in ps], [p.t().shape for p in ps if p.dim() == 2],
                              [(p.dtype, p.device, p.is_contiguous()) for p in ps]))

        def on_log(self, args, state, control, model=None, logs=None, **kwargs):
            self.seen.append(sum(p.numel() for p in model.parameters() if p.requires_grad))

    return ShapeLogger()


def test_a_callback_logging_parameter_counts_and_shapes_through_views_verifies(tmp_path):
    """Before, ``p.view(-1).shape`` (and ``.reshape``, ``.t()``, ``p[0]``, ``.detach()``, ``.data``) in a watched
    callback was a value read and a step-3 deletion was refused; now it is VERIFIED and equal to a plain Trainer with
    the same callback."""
    logger = _shape_logger()
    tok, data, run = _record(tmp_path, "llama", [logger], logging_steps=1)
    assert logger.seen  # it ran at every step
    assert _refused_or_counterfactual(tmp_path, "llama", run, tok, data, AT, lambda: [_shape_logger()], "",
                                      logging_steps=1) == "verified"


def _stored_view(guard, model):
    return float(guard.view.double().sum())  # a view taken in on_init_end, read in a watched event


ROUTES = {  # how a watched callback reaches the final norm weight's values behind a view
    "a view stored on the callback, read later": _stored_view,
    "a branch on an element of a view": lambda g, m: float(m.model.norm.weight.view(-1)[0] > 0.9999),
    "T.abs().max()": lambda g, m: m.model.norm.weight.unsqueeze(1).T.abs().max(),
    "Tensor.__repr__": lambda g, m: torch.Tensor.__repr__(m.model.norm.weight.view(-1)[:4]),
    "data_ptr and ctypes": lambda g, m: ctypes.c_float.from_address(m.model.norm.weight.view(-1).data_ptr()).value,
    "untyped_storage": lambda g, m: bytes(m.model.norm.weight.view(-1).untyped_storage()[:4]),
    "numpy of a view": lambda g, m: float(m.model.norm.weight.detach().view(-1).numpy()[0]),
    "tolist": lambda g, m: m.model.norm.weight.view(-1).tolist()[0],
}


def _view_guard(seen: dict, route: str):
    """A watched callback that reads the final norm weight by ``route`` after each optimizer step and shrinks it
    through a view when the value is not the one it saw at that step first: a no-op on every recorded step, active
    on a deletion's (the plain Trainer's counterfactual runs it with what the recording saw)."""

    class ViewGuard(TrainerCallback):
        def on_init_end(self, args, state, control, model=None, **kwargs):
            self.view = model.model.norm.weight.view(-1)

        def on_optimizer_step(self, args, state, control, model=None, **kwargs):
            value = ROUTES[route](self, model)
            if seen.setdefault(state.global_step, value) != value:
                with torch.no_grad():
                    model.model.norm.weight.view(-1).mul_(0.99)

    return ViewGuard()


def _edits_through_a_view():
    class ViewGuard(TrainerCallback):
        def on_optimizer_step(self, args, state, control, model=None, **kwargs):
            if state.global_step == AT + 1:
                with torch.no_grad():
                    model.model.norm.weight.view(-1)[:2].mul_(0.5)  # an edit, through a view
    return ViewGuard()


@pytest.mark.parametrize("route", list(ROUTES))
def test_a_value_read_behind_a_view_is_still_refused(tmp_path, route):
    """ATTACK: each way from a view to the values, in a callback that edits the weight only when it is not what it saw
    on the recorded run; the deletion is refused before any compute, naming the callback's event (else it is VERIFIED
    and must equal the plain Trainer's counterfactual, which the edit moves off)."""
    seen: dict = {}
    tok, data, run = _record(tmp_path, "llama", [_view_guard(seen, route)])
    assert seen  # it ran at every step
    assert _refused_or_counterfactual(tmp_path, "llama", run, tok, data, AT, lambda: [_view_guard(seen, route)],
                                      "ViewGuard.on_optimizer_step") == "refused"


def test_an_edit_through_a_view_is_a_change(tmp_path):
    """ATTACK: an in-place edit of a view of the weight changes the parameter: a change of the run, refused."""
    tok, data, run = _record(tmp_path, "llama", [_edits_through_a_view()])
    assert _refused_or_counterfactual(tmp_path, "llama", run, tok, data, AT, lambda: [_edits_through_a_view()],
                                      "ViewGuard.on_optimizer_step") == "refused"
