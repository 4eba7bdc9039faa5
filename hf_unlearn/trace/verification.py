"""Bit-exact verification of a replay against the oracle, and distances of the naive baselines.

Parameters and optimizer state (moments and step counts, named ``<param>.<key>``) are compared tensor by
tensor on their raw bytes; the SHA-256 state-hash roots of :mod:`hf_unlearn.trace.hashing` are reported too.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..errors import UnlearnError
from .hashing import StateHashes, optimizer_tensors, tensor_hash


def _named_optimizer(state: dict) -> dict[str, torch.Tensor]:
    return optimizer_tensors(state["optimizer"], state.get("param_names"))


def state_roots(state: dict) -> StateHashes:
    params = {n: tensor_hash(n, t) for n, t in state["model"].items()}
    opt = {n: tensor_hash(n, t) for n, t in _named_optimizer(state).items()}
    return StateHashes(params=params, optimizer=opt)


def _compare(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> dict:
    mismatched, elements, diff_elems, sq = [], 0, 0, 0.0
    for name in sorted(set(a) | set(b)):
        x, y = a.get(name), b.get(name)
        if x is None or y is None or x.shape != y.shape or x.dtype != y.dtype:
            mismatched.append(name)
            continue
        x, y = x.detach().cpu().contiguous(), y.detach().cpu().contiguous()
        elements += x.numel()
        same_bytes = torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8))
        if not same_bytes:
            mismatched.append(name)
            xb, yb = x.reshape(-1).view(torch.uint8).reshape(x.numel(), -1), y.reshape(-1).view(torch.uint8).reshape(
                y.numel(), -1)
            diff_elems += int((xb != yb).any(dim=1).sum())
            if x.is_floating_point():
                sq += float(((x.double() - y.double()) ** 2).sum())
            else:
                sq += float(((x.double() - y.double()) ** 2).sum())
    return {"identical": not mismatched, "tensors": len(set(a) | set(b)), "mismatched_tensors": mismatched,
            "elements": elements, "mismatched_elements": diff_elems, "l2": sq ** 0.5}


def compare_states(a: dict, b: dict) -> dict:
    """Compare two checkpoint dicts (``model``, ``optimizer``, ``param_names``) bit for bit."""
    params = _compare(a["model"], b["model"])
    opt = _compare(_named_optimizer(a), _named_optimizer(b))
    ha, hb = state_roots(a), state_roots(b)
    return {
        "identical": params["identical"] and opt["identical"] and ha.root == hb.root,
        "params": params,
        "optimizer": opt,
        "roots": {"a": {"params": ha.params_root, "optimizer": ha.optimizer_root},
                  "b": {"params": hb.params_root, "optimizer": hb.optimizer_root}},
    }


def load_state(path) -> dict:
    """A final state from a run folder (its last checkpoint), a checkpoint folder, or a ``.pt`` file."""
    from .run import list_checkpoints, load_checkpoint

    path = Path(path)
    if path.is_file():
        return torch.load(path, map_location="cpu", weights_only=True)
    if (path / "state.pt").exists():
        return load_checkpoint(path)
    cps = list_checkpoints(path)
    if not cps:
        raise UnlearnError(f"{path} holds no checkpoint: pass a replay/oracle output folder, a checkpoint folder or "
                           "a .pt state file")
    return load_checkpoint(cps[max(cps)])


def verify(replay_out, oracle_out) -> dict:
    """Compare a replay with the oracle; add the distances of any baselines stored in ``oracle_out/baselines``."""
    oracle = load_state(oracle_out)
    report = compare_states(load_state(replay_out), oracle)
    baselines = {}
    for f in sorted(Path(oracle_out).glob("baselines/*.pt")):
        cmp = compare_states(load_state(f), oracle)
        baselines[f.stem] = {"params_mismatched_elements": cmp["params"]["mismatched_elements"],
                             "params_elements": cmp["params"]["elements"], "params_l2": cmp["params"]["l2"],
                             "optimizer_l2": cmp["optimizer"]["l2"], "identical": cmp["identical"]}
    report["baselines"] = baselines
    _record_verification(Path(replay_out), Path(oracle_out), report)
    return report


def _record_verification(replay_out: Path, oracle_out: Path, report: dict) -> None:
    """Keep the verdict next to the replay (``verification.json``) so its model card can state it."""
    if not replay_out.is_dir():
        return
    import json

    from ..utils import atomic_write_text

    summary = {"identical": report["identical"], "oracle": oracle_out.name, "roots": report["roots"],
               "params_mismatched_elements": report["params"]["mismatched_elements"],
               "optimizer_mismatched_elements": report["optimizer"]["mismatched_elements"]}
    atomic_write_text(replay_out / "verification.json", json.dumps(summary, indent=1))


verify_replay = verify  # the top-level name: ``hf_unlearn.verify_replay(replay_out, oracle_out)``
