"""``UnlearningHubMixin``: model cards and Hub pushes for hf_unlearn trainers, in the style of ``trl``.

A trainer that implements ``unlearning_card_info()`` (the trainer contract) and lists this mixin before ``Trainer``
gets ``create_model_card()`` (renders ``README.md`` into ``output_dir`` from ``model_cards/``) and
``push_to_hub(repo_id)`` (one commit with weights, tokenizer, state-hash manifest and card; optionally a
``deletion-NNNN`` tag). Editors and replay outputs, which are not trainers, use the function forms
:func:`write_model_card` and :func:`hf_unlearn.hub.publish.push_unlearned`.

A PEFT (LoRA) model is published merged into its base weights, so the repository loads with plain
``transformers``; the card lists the adapter's settings. Counts the trainer computed itself (``extra.num_forget``,
``extra.num_retain``, ``extra.global_step``) are declared not to be ids when they equal the trainer's own state;
any other number equal to a forget id needs ``not_ids=`` (see :mod:`hf_unlearn.hub.leaks`).

Intermediate pushes of the Trainer (``push_to_hub=True`` with a ``hub_strategy``) are switched off: they upload the
whole output directory, which holds the raw forget ids (``unlearning_info.json``) and mid-unlearning checkpoints.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..utils import WeightsFollowUmask, atomic_write_text
from .cards import hub_model_id, render_model_card
from .keys import load_key
from .publish import PushResult, build_manifest, peft_settings, push_unlearned, safetensors_files, save_card_info

logger = logging.getLogger(__name__)


def write_model_card(output_dir: str | os.PathLike, card_info: Mapping[str, Any], *, repo_id: str | None = None,
                     base_model: str | None = None, datasets: list[str] | None = None, license: str = "apache-2.0",
                     extra_tags: list[str] | str | None = None, key: bytes | None = None,
                     not_ids: Mapping[str, Any] | None = None, merged_adapter: Mapping[str, Any] | None = None) -> str:
    """Render the card for the model saved in ``output_dir`` into ``output_dir/README.md`` and return it.

    Also stores ``card_info`` as ``unlearning_info.json`` (local only) so ``hf-unlearn hub push OUT`` can publish
    the directory later. The card carries the state-hash roots when the weights are already saved.
    """
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_card_info(out, card_info)
    exact = (card_info.get("extra") or {}).get("exact_deletion") or {}
    manifest = build_manifest(out, optimizer_root=exact.get("optimizer_root", "")) if safetensors_files(out) else None
    card = render_model_card(card_info, key=key if key is not None else load_key(), repo_id=repo_id,
                             base_model=base_model, datasets=datasets, license=license, manifest=manifest,
                             extra_tags=extra_tags, not_ids=not_ids, merged_adapter=merged_adapter)
    atomic_write_text(out / "README.md", card)
    return card


class UnlearningHubMixin(WeightsFollowUmask):
    """Mix into a ``transformers.Trainer`` subclass that implements ``unlearning_card_info()``."""

    def unlearning_card_info(self) -> dict[str, Any]:  # pragma: no cover - the contract, implemented by trainers
        raise TypeError(f"{type(self).__name__} mixes in UnlearningHubMixin but does not define unlearning_card_info()")

    def _unwrapped_model(self):
        accelerator = getattr(self, "accelerator", None)
        return accelerator.unwrap_model(self.model) if accelerator is not None else self.model

    def _card_defaults(self) -> dict[str, Any]:
        model = self._unwrapped_model()
        adapter = peft_settings(model)
        name = getattr(getattr(model, "config", None), "_name_or_path", None)
        return {"base_model": hub_model_id(name) or (adapter or {}).get("base_model"), "merged_adapter": adapter}

    def _card_info(self) -> dict[str, Any]:
        """``unlearning_card_info()`` with the adapter's settings as values and the trainer's own counts declared."""
        info = dict(self.unlearning_card_info())
        adapter = peft_settings(self._unwrapped_model())
        if adapter and isinstance(info.get("hyperparameters"), Mapping) and "peft" in info["hyperparameters"]:
            info["hyperparameters"] = {**info["hyperparameters"], "peft": adapter}
        facts = {"num_forget": len(set(info.get("forget_ids") or [])),
                 "global_step": int(getattr(getattr(self, "state", None), "global_step", -1))}
        retain = getattr(self, "retain_dataset", None)
        if retain is not None:
            facts["num_retain"] = len(retain)
        extra = info.get("extra") or {}
        declared = {f"extra.{k}": v for k, v in facts.items() if k in extra and extra[k] == v}
        info["not_ids"] = {**declared, **(info.get("not_ids") or {})}
        return info

    def create_model_card(self, model_name: str | None = None, dataset_name: str | None = None,
                          tags: str | list[str] | None = None, *, base_model: str | None = None,
                          datasets: list[str] | None = None, license: str | None = None,
                          finetuned_from: str | None = None, not_ids: Mapping[str, Any] | None = None,
                          **kwargs) -> str | None:
        """Write ``README.md`` (and the local ``unlearning_info.json``) into ``args.output_dir``.

        Takes trl's arguments (``model_name``, ``dataset_name``, ``tags``) and transformers' ``finetuned_from``
        and ``license`` (default apache-2.0); other transformers card arguments are ignored.
        """
        if not self.is_world_process_zero():
            return None
        datasets = datasets or ([dataset_name] if dataset_name else None)
        defaults = self._card_defaults()
        return write_model_card(self.args.output_dir, self._card_info(),
                                repo_id=model_name or self.args.hub_model_id,
                                base_model=base_model or finetuned_from or defaults["base_model"],
                                datasets=datasets, license=license or "apache-2.0", extra_tags=tags, not_ids=not_ids,
                                merged_adapter=defaults["merged_adapter"])

    def push_to_hub(self, repo_id: str | None = None, commit_message: str | None = None, *, tag: str | None = None,
                    deletion: bool = False, private: bool | None = None, token: str | None = None,
                    revision: str = "main", base_model: str | None = None, datasets: list[str] | None = None,
                    license: str = "apache-2.0", trace_dir: str | os.PathLike | None = None,
                    tags: list[str] | str | None = None, not_ids: Mapping[str, Any] | None = None,
                    **kwargs) -> PushResult | None:
        """Save the model and publish it to ``repo_id`` (default ``args.hub_model_id``) in one commit.

        ``deletion=True`` takes the next ``deletion-NNNN`` tag; ``trace_dir`` publishes a recorded run's provenance;
        ``not_ids`` allows numbers that merely equal a forget id, per field. A PEFT model is published merged.
        The card pushed is also written to ``output_dir/README.md``.
        """
        self.save_model(self.args.output_dir)
        if not self.is_world_process_zero():
            return None
        repo_id = repo_id or self.args.hub_model_id
        if not repo_id:
            from ..errors import UnlearnError

            raise UnlearnError("push_to_hub needs a repo id: trainer.push_to_hub('org/name') or hub_model_id=")
        info = self._card_info()
        save_card_info(self.args.output_dir, info)
        model = self._unwrapped_model()
        merged = peft_settings(model) is not None  # publish the merged model, saved from memory
        return push_unlearned(
            model if merged else self.args.output_dir, repo_id, card_info=info, tag=tag, deletion=deletion,
            revision=revision, private=self.args.hub_private_repo if private is None else private,
            token=token or self.args.hub_token, base_model=base_model or self._card_defaults()["base_model"],
            datasets=datasets, license=license, trace_dir=trace_dir, commit_message=commit_message, extra_tags=tags,
            not_ids=not_ids, tokenizer=self.processing_class if merged else None, local_dir=self.args.output_dir,
        )

    def _push_from_checkpoint(self, checkpoint_folder):
        logger.warning("hf_unlearn: intermediate Hub pushes are off for unlearning trainers (the output dir holds "
                       "raw forget ids and partial states); call trainer.push_to_hub() when training ends")
