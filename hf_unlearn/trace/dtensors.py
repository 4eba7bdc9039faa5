"""The full logical tensors of a sharded (FSDP2 ``DTensor``) state, at the ground of the engine.

Hashing, checkpoints, shards and the per-step checksums all see a sharded state through these few functions (this
process's shard, the full tensor gathered); what the engine records and refuses of a sharded run is
:mod:`hf_unlearn.trace.sharding`'s story.
"""

from __future__ import annotations

from . import module_tree


def is_sharded(t) -> bool:
    return isinstance(t, _dtensor())


def _dtensor():
    """``DTensor``, imported at the first call (a recorded step asks about each of its ~1,000 tensors a few times)."""
    global _DTENSOR
    if _DTENSOR is None:
        from torch.distributed.tensor import DTensor

        _DTENSOR = DTensor
    return _DTENSOR


_DTENSOR = None



def local(t):
    """This process's shard of ``t`` (``t`` itself when it is not a DTensor)."""
    return t.to_local() if is_sharded(t) else t



def full(t):
    """The full logical tensor of ``t`` (gathered from every process: a collective, every process must call it)."""
    return t.full_tensor() if is_sharded(t) else t



def full_tensors(tensors: dict) -> dict:
    """``tensors`` with every DTensor replaced by its full logical tensor, in the dict's order (a collective)."""
    return {k: full(v) for k, v in tensors.items()}



def full_optimizer_state(osd: dict) -> dict:
    """An optimizer ``state_dict()`` with every DTensor state replaced by its full tensor (a collective: every
    process holds the same parameter indices and keys, so they gather in the same order); unchanged when nothing in
    it is sharded."""
    if not any(is_sharded(v) for st in osd["state"].values() for v in st.values()):
        return osd
    return {**osd, "state": {i: {k: full(v) for k, v in st.items()} for i, st in osd["state"].items()}}



def model_is_sharded(model) -> bool:
    return any(is_sharded(p) for _, p in module_tree.walk(model).parameters)



def all_shards(sums: dict, model) -> dict:
    """Per-tensor checksums of this process's shards -> ``name -> [checksum of rank 0, rank 1, ...]`` (an
    all-gather: every process calls it at the same point); unchanged for a model that is not sharded."""
    if not model_is_sharded(model):
        return sums
    import torch.distributed as dist

    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, sums)
    return {name: [g[name] for g in gathered] for name in sums}

