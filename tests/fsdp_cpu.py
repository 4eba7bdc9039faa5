"""A CPU stand-in for FSDP in tests only: lets accelerate take its FSDP branch on CPU processes joined over gloo.

accelerate 1.15 (``AcceleratorState.__init__``) sets ``DistributedType.FSDP`` only for GPU-like process groups
(``MULTI_GPU``, ``MULTI_NPU``, ...): ``MULTI_CPU`` is not in its list, so ``Trainer(fsdp=True, fsdp_config=
{"fsdp_version": 2})`` under ``torchrun --nproc_per_node 2`` on CPUs keeps ``fsdp_plugin=None`` and trains as plain
data parallel, silently (``trainer.is_fsdp_enabled`` is False, every parameter a plain tensor). torch's FSDP2
(``fully_shard``) itself runs on CPU with gloo, and so does accelerate's FSDP2 preparation once the state says FSDP.

:func:`enable` wraps ``AcceleratorState.__init__`` so that, when an ``fsdp_plugin`` is given and the processes are
``MULTI_CPU``, it does what accelerate does for GPUs (``distributed_type = FSDP``, the plugin's mixed precision
policy set from the accelerator's mixed precision, ``fsdp_plugin`` kept) and nothing else. It is called by the test
launch scripts only (``tests/trace_fsdp.py``, ``tests/trace_fsdp_attacks.py``); the library never patches
accelerate.
:func:`assert_sharded` checks that the stand-in took effect (every parameter a DTensor).
"""

from __future__ import annotations


def enable() -> None:
    """Let accelerate take its FSDP branch on ``MULTI_CPU`` (gloo) processes, in this process (tests only)."""
    import accelerate.state as state
    from accelerate.utils import DistributedType

    init = state.AcceleratorState.__init__
    if getattr(init, "_cpu_fsdp_stand_in", False):
        return

    def __init__(self, *args, fsdp_plugin=None, **kwargs):
        init(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            self.distributed_type = DistributedType.FSDP  # what accelerate does for MULTI_GPU, mixed precision too
            if self._mixed_precision != "no":  # (bf16: FSDP2's MixedPrecisionPolicy, bf16 parameters and reduction)
                fsdp_plugin.set_mixed_precision(self._mixed_precision)
            self.fsdp_plugin = fsdp_plugin

    __init__._cpu_fsdp_stand_in = True
    state.AcceleratorState.__init__ = __init__


def assert_sharded(model) -> int:
    """Every parameter of ``model`` is an FSDP2 DTensor sharded on dim 0 over the processes, this process holding its
    chunk (the whole tensor at world size 1); returns how many there are."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Shard

    world = dist.get_world_size()
    params = list(model.named_parameters())
    for name, p in params:
        assert isinstance(p, DTensor), f"{name} is not sharded ({type(p).__name__})"
        assert p.placements == (Shard(0),) and p.device_mesh.size() == world, f"{name}: {p.placements}"
        rows = -(-p.shape[0] // world)  # torch.chunk's rows per process
        # to_local() is a view, not a value read: the watched callback that runs this blocks no deletion
        assert p.to_local().shape[0] == min(rows, max(0, p.shape[0] - dist.get_rank() * rows)), \
            f"{name}: the local shard is not this process's dim-0 chunk"
    return len(params)
