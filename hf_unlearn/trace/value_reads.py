"""Whether code a replay does not run read tensor values: the evidence that its behaviour may follow the data.

A watched callback (one replays do not run) that edits gradients or parameters only when they are not what it expects
changes nothing on the recorded run, so the guards see no change and the proof, which replays without it, matches
every step; a deletion trains on other values, where the same callback acts (issue #41, wave 5). Whether it *would*
act cannot be shown without running it; that it *looked* can: any torch function applied to a tensor inside its
event, other than reading metadata (shape, dtype, ``.grad``, ``requires_grad``, ...), is a read of values (or a
write). A callback that never touches a tensor's values (a logging callback reading ``logs``, an early stopping
callback reading ``metrics``) cannot decide from them.

Not seen: code run under ``torch._C.DisableTorchFunction`` (which turns torch function modes off), reads through
raw pointers, and decisions from Python numbers derived from tensors elsewhere (the logged loss, an evaluation's
metrics): a callback that acts only when ``logs["loss"]`` is what no recorded step logged is such a decision.
"""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

# methods that read a tensor's metadata, not its values (properties such as .shape, .grad, .data are descriptors'
# __get__, also metadata)
METADATA = frozenset({"size", "dim", "numel", "nelement", "element_size", "is_floating_point", "is_complex",
                      "is_contiguous", "stride", "storage_offset", "get_device", "__len__", "__hash__", "ndimension",
                      "is_signed", "has_names", "is_inference", "is_set_to", "requires_grad_"})


def _name(func) -> str:
    return getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or repr(func)


class ValueReads(TorchFunctionMode):
    """A torch function mode that notes the first function applied to a tensor's values (``first``) while it is on."""

    def __init__(self):
        super().__init__()
        self.first: str | None = None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.first is None:
            name = _name(func)
            short = name.rsplit(".", 1)[-1]
            if name != "getset_descriptor.__get__" and short not in METADATA and any(
                    isinstance(x, torch.Tensor) for x in tree_flatten((args, kwargs))[0]):
                self.first = name.replace("TensorBase.", "Tensor.").replace("getset_descriptor.__set__",
                                                                            "a tensor attribute set")
        return func(*args, **kwargs)
