"""Exact checksums of a training state's tensors: what the per-step fingerprints and the guards compare.

An exact 64-bit checksum of every parameter, buffer, gradient and optimizer-state tensor (:func:`tensor_checksums`),
the digest of the state right after an optimizer step (:func:`state_digest`), and under FSDP2 every process's share
of it (:class:`ShardPeerDigest`). Below the program digests (:mod:`hf_unlearn.trace.digests`) and the guards
(:mod:`hf_unlearn.trace.guards`), which both read them.
"""

from __future__ import annotations

import hashlib
import json

import torch

from . import module_tree
from .dtensors import all_shards, local
from .workers import map_tensors, nbytes


def state_tensors(model, optimizer, grads: bool = False) -> list[tuple[str, torch.Tensor]]:
    """Parameters, buffers (and gradients) of the model and the optimizer's state tensors, named (under FSDP2, this
    process's shards: :mod:`hf_unlearn.trace.sharding`)."""
    out = _own_state_tensors(model, optimizer, grads)
    return [(n, local(t)) for n, t in out]



def _own_state_tensors(model, optimizer, grads: bool) -> list[tuple[str, torch.Tensor]]:
    out = []
    tree = module_tree.walk(model)  # one walk of the module tree, for the names below too
    params = tree.parameters
    for n, p in params:
        out.append((n, p))
        if grads and p.grad is not None:
            out.append((f"{n} (gradient)", p.grad))
    out += tree.buffers
    if optimizer is not None:
        inner = getattr(optimizer, "optimizer", optimizer)
        names = {id(p): n for n, p in params}
        for g in inner.param_groups:
            for p in g["params"]:
                st = inner.state.get(p, {})
                for k, v in sorted(st.items()):  # a loaded state dict may hold the keys in another order
                    if torch.is_tensor(v):
                        out.append((f"optimizer state {k} of {names.get(id(p), '?')}", v))
    return out

def gradient_tensors(model) -> list[tuple[str, torch.Tensor]]:
    """The gradients ``optimizer.step()`` is about to use, named ``<param> (gradient)`` (this process's, as
    :func:`state_tensors` lists them): what the recording's and every replay's gradient digest read."""
    return [(n, t) for n, t in state_tensors(model, None, grads=True) if n.endswith("(gradient)")]

_INTS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_COLUMNS = 4096
_MIX = (0x5851F42D4C957F2D, 0x14057B7EF767814F)  # odd 63-bit multipliers: position weights mod 2**64


def tensor_checksums(tensors) -> dict[str, int]:
    """An exact 64-bit checksum of every tensor's raw bytes, by name: any edit of any element changes it (an edit
    through ``.data`` included, which no version counter sees).

    On the CPU, xxh3 over the bytes (about the cost of reading them once). On an accelerator, integer sums of the
    bits over rows and columns of a ``(n / 4096, 4096)`` view, each weighted by its position, computed on the device
    and read back once for all tensors: a changed element changes its row's and its column's sums, a swap of two
    different elements too; only an edit built to keep every row and column sum (a deliberate rectangle of equal and
    opposite changes) escapes it."""
    out, pending, on_cpu = {}, [], []
    for name, t in tensors:
        t = t.detach()
        if not t.is_contiguous():
            t = t.contiguous()
        if t.device.type == "cpu":
            on_cpu.append((name, t))
        else:
            pending.append((name, device_checksum(t.reshape(-1))))
    sums = map_tensors(_xxh3, [f for _, f in on_cpu], [nbytes(f) for _, f in on_cpu])  # on every allowed core
    out.update({name: value for (name, _), value in zip(on_cpu, sums)})
    if pending:
        values = torch.stack([v for _, v in pending]).cpu().tolist()
        out.update({name: v for (name, _), v in zip(pending, values)})
    return out



def _xxh3(t: torch.Tensor) -> int:
    """xxh3 of a contiguous CPU tensor's raw bytes (a thousand tensors a step: as few torch calls as possible)."""
    import xxhash

    if not t.numel():
        return 0
    try:
        buf = t.numpy()  # its own bytes, through the buffer protocol
    except TypeError:  # a dtype numpy lacks (bfloat16, float8): the same bytes as uint8
        buf = t.reshape(-1).view(torch.uint8).numpy()
    return xxhash.xxh3_64_intdigest(buf)


def device_checksum(flat: torch.Tensor) -> torch.Tensor:
    """Position-weighted row and column sums of a flat tensor's bits (int64 wrapping arithmetic), a 0-d tensor on
    its device (see :func:`tensor_checksums`)."""
    flat = flat.reshape(-1)
    bits = flat.view(_INTS.get(flat.element_size(), torch.uint8))
    n = bits.numel()
    rows = n // _COLUMNS
    total = torch.zeros((), dtype=torch.int64, device=flat.device)
    if rows:
        head = bits[: rows * _COLUMNS].view(rows, _COLUMNS)
        total = total + (head.sum(1, dtype=torch.int64) * _weights(rows, 0, flat.device)).sum()
        total = total + (head.sum(0, dtype=torch.int64) * _weights(_COLUMNS, 1, flat.device)).sum()
    tail = bits[rows * _COLUMNS:]
    if tail.numel():
        total = total + (tail.to(torch.int64) * _weights(tail.numel(), 1, flat.device)).sum()
    return total + n



def _weights(n: int, which: int, device) -> torch.Tensor:
    return (torch.arange(1, n + 1, dtype=torch.int64, device=device) * _MIX[which]) | 1



# What a per-step fingerprint's state digest covers (its ``"k"``): "trainable" (the trainable parameters and the
# buffers, what an optimizer step writes and the next forward reads); a run recorded before it has none: "all"
# (every parameter, buffer and optimizer-state tensor, every step)
STEP_SCOPE = "trainable"


def step_state_tensors(model, optimizer=None, scope: str = STEP_SCOPE) -> list[tuple[str, torch.Tensor]]:
    """The tensors a per-step fingerprint reads exactly (see :data:`STEP_SCOPE`).

    Why not the whole state every step: frozen weights and optimizer moments are most of its bytes (all of a LoRA
    run's), and reading them every step was most of the recording's overhead. Nothing is left unproven by it: a
    frozen weight or a moment that differs changes the trainable parameters at the next step that reads it (the
    forward, the update), and the whole state, every byte, is compared by SHA-256 at every kept checkpoint, the
    final one included (:func:`hf_unlearn.trace.hashing.checkpoint_hashes`). A difference is named a step later at
    worst, never missed."""
    if scope != STEP_SCOPE:
        return state_tensors(model, optimizer)
    tree = module_tree.walk(model)
    out = [(n, p) for n, p in tree.parameters if p.requires_grad]
    out += tree.buffers
    return [(n, local(t)) for n, t in out]


def state_digest(model, optimizer, scope: str = STEP_SCOPE) -> str:
    """The exact digest of the state after an optimizer step (:func:`step_state_tensors`), for the per-step
    fingerprints: the recording and every replay compute it at the same point. Under FSDP2 it covers every
    process's shards (:func:`hf_unlearn.trace.sharding.all_shards`: every process must call it)."""
    return exact_digest(all_shards(tensor_checksums(step_state_tensors(model, optimizer, scope)), model))



def exact_digest(sums: dict) -> str:
    return hashlib.sha256(json.dumps(sorted(sums.items())).encode()).hexdigest()[:16]



class ShardPeerDigest:
    """On a process other than the main one of a sharded recording: joins the main process's per-step digest
    (:func:`all_shards`) after every optimizer step (the main process's guard gathers the checksums then)."""

    def __init__(self, model, optimizer):
        inner = getattr(optimizer, "optimizer", optimizer)
        self._hook = inner.register_step_post_hook(
            lambda *a: all_shards(tensor_checksums(step_state_tensors(model)), model))

    def close(self) -> None:
        self._hook.remove()

