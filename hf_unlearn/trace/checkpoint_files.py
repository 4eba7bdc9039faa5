"""The pieces of a checkpoint folder every writer uses: its path and format, safetensors written atomically, the
optimizer state flattened to tensors, the tied aliases.

Both writers, :mod:`hf_unlearn.trace.checkpoints` (one process) and :mod:`hf_unlearn.trace.shards` (every process
of an FSDP2 run), build on them; the folder's layout is described in :mod:`hf_unlearn.trace.checkpoints`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from ..utils import weights_follow_umask

CHECKPOINT_FORMAT = "hf_unlearn.checkpoint.v2"


def checkpoint_dir(run: Path, step: int) -> Path:
    return Path(run) / "checkpoints" / f"step-{step:08d}"



def tied_aliases(state_dict) -> dict[str, str]:
    """``alias -> first name`` for state-dict entries that are one tensor (a tied embedding and LM head)."""
    first: dict = {}
    tied = {}
    for name, t in state_dict.items():
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype,
               str(t.device))
        if key in first:
            tied[name] = first[key]
        else:
            first[key] = name
    return tied



def _save_safetensors(tensors: dict, path: Path) -> None:
    """Write a safetensors file atomically (safetensors writes from the tensors' memory, no copy)."""
    from safetensors.torch import save_file

    tmp = path.with_name(path.name + ".tmp")
    save_file({n: t.contiguous() for n, t in tensors.items()}, str(tmp))
    weights_follow_umask(tmp)
    os.replace(tmp, path)



def _json_groups(groups: list[dict]) -> tuple[list[dict], dict] | None:
    """Param groups without their parameter lists as JSON, plus which values were tuples (None: not JSON)."""
    out, tuples = [], {}
    for i, g in enumerate(groups):
        out.append(dict(g))
        tuples[str(i)] = [k for k, v in g.items() if isinstance(v, tuple)]
    try:
        json.dumps(out)
    except (TypeError, ValueError):
        return None
    return out, tuples



def _flatten_optimizer(osd: dict) -> tuple[dict, dict] | None:
    """``optimizer.state_dict()`` as safetensors tensors and a JSON index (None if it is not that simple)."""
    import torch

    tensors, scalars = {}, {}
    for idx, entries in osd.get("state", {}).items():
        for k, v in entries.items():
            if torch.is_tensor(v):
                tensors[f"state.{idx}.{k}"] = v.detach().to("cpu")
            else:
                scalars.setdefault(str(idx), {})[k] = v
    groups = _json_groups(osd.get("param_groups", []))
    try:
        json.dumps(scalars)
    except (TypeError, ValueError):
        return None
    if groups is None or any(not isinstance(i, int) for i in osd.get("state", {})):
        return None
    return tensors, {"param_groups": groups[0], "tuples": groups[1], "scalars": scalars,
                     "indices": sorted(osd.get("state", {}))}

