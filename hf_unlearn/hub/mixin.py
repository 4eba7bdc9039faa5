"""``UnlearningHubMixin``: model cards and Hub pushes for hf_unlearn trainers, in the style of ``trl``.

A trainer that implements ``unlearning_card_info()`` (the trainer contract) and lists this mixin before ``Trainer``
gets ``create_model_card()`` (renders ``README.md`` into ``output_dir`` from ``model_cards/``) and
``push_to_hub(repo_id)`` (one commit with weights, tokenizer, state-hash manifest and card; optionally a
``deletion-NNNN`` tag). Editors and replay outputs, which are not trainers, use the function forms
:func:`write_model_card` and :func:`hf_unlearn.hub.publish.push_unlearned`.

Intermediate pushes of the Trainer (``push_to_hub=True`` with a ``hub_strategy``) are switched off: they upload the
whole output directory, which holds the raw forget ids (``unlearning_info.json``) and mid-unlearning checkpoints.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..utils import atomic_write_text
from .cards import render_model_card
from .publish import PushResult, build_manifest, push_unlearned, safetensors_files, save_card_info

logger = logging.getLogger(__name__)


def write_model_card(output_dir: str | os.PathLike, card_info: Mapping[str, Any], *, repo_id: str | None = None,
                     base_model: str | None = None, datasets: list[str] | None = None, license: str = "apache-2.0",
                     extra_tags: list[str] | str | None = None, key: bytes | None = None) -> str:
    """Render the card for the model saved in ``output_dir`` into ``output_dir/README.md`` and return it.

    Also stores ``card_info`` as ``unlearning_info.json`` (local only) so ``hf-unlearn hub push OUT`` can publish
    the directory later. The card carries the state-hash roots when the weights are already saved.
    """
    from .keys import load_key

    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_card_info(out, card_info)
    exact = (card_info.get("extra") or {}).get("exact_deletion") or {}
    manifest = build_manifest(out, optimizer_root=exact.get("optimizer_root", "")) if safetensors_files(out) else None
    card = render_model_card(card_info, key=key if key is not None else load_key(), repo_id=repo_id,
                             base_model=base_model, datasets=datasets, license=license, manifest=manifest,
                             extra_tags=extra_tags)
    atomic_write_text(out / "README.md", card)
    return card


class UnlearningHubMixin:
    """Mix into a ``transformers.Trainer`` subclass that implements ``unlearning_card_info()``."""

    def unlearning_card_info(self) -> dict[str, Any]:  # pragma: no cover - the contract, implemented by trainers
        raise TypeError(f"{type(self).__name__} mixes in UnlearningHubMixin but does not define unlearning_card_info()")

    def _card_defaults(self) -> dict[str, Any]:
        name = getattr(getattr(self.model, "config", None), "_name_or_path", None) or None
        base_model = name if name and "/" in name and not os.path.exists(name) else None
        return {"base_model": base_model}

    def create_model_card(self, model_name: str | None = None, dataset_name: str | None = None,
                          tags: str | list[str] | None = None, *, base_model: str | None = None,
                          datasets: list[str] | None = None, license: str | None = None,
                          finetuned_from: str | None = None, **kwargs) -> str | None:
        """Write ``README.md`` (and the local ``unlearning_info.json``) into ``args.output_dir``.

        Takes trl's arguments (``model_name``, ``dataset_name``, ``tags``) and transformers' ``finetuned_from``
        and ``license`` (default apache-2.0); other transformers card arguments are ignored.
        """
        if not self.is_world_process_zero():
            return None
        datasets = datasets or ([dataset_name] if dataset_name else None)
        return write_model_card(self.args.output_dir, self.unlearning_card_info(),
                                repo_id=model_name or self.args.hub_model_id,
                                base_model=base_model or finetuned_from or self._card_defaults()["base_model"],
                                datasets=datasets, license=license or "apache-2.0", extra_tags=tags)

    def push_to_hub(self, repo_id: str | None = None, commit_message: str | None = None, *, tag: str | None = None,
                    deletion: bool = False, private: bool | None = None, token: str | None = None,
                    revision: str = "main", base_model: str | None = None, datasets: list[str] | None = None,
                    license: str = "apache-2.0", trace_dir: str | os.PathLike | None = None,
                    tags: list[str] | str | None = None, **kwargs) -> PushResult | None:
        """Save the model and publish it to ``repo_id`` (default ``args.hub_model_id``) in one commit."""
        self.save_model(self.args.output_dir)
        if not self.is_world_process_zero():
            return None
        repo_id = repo_id or self.args.hub_model_id
        if not repo_id:
            from ..errors import UnlearnError

            raise UnlearnError("push_to_hub needs a repo id: trainer.push_to_hub('org/name') or hub_model_id=")
        info = self.unlearning_card_info()
        save_card_info(self.args.output_dir, info)
        return push_unlearned(
            self.args.output_dir, repo_id, card_info=info, tag=tag, deletion=deletion, revision=revision,
            private=self.args.hub_private_repo if private is None else private,
            token=token or self.args.hub_token, base_model=base_model or self._card_defaults()["base_model"],
            datasets=datasets, license=license, trace_dir=trace_dir, commit_message=commit_message, extra_tags=tags,
        )

    def _push_from_checkpoint(self, checkpoint_folder):
        logger.warning("hf_unlearn: intermediate Hub pushes are off for unlearning trainers (the output dir holds "
                       "raw forget ids and partial states); call trainer.push_to_hub() when training ends")
