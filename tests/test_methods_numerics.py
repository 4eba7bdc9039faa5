"""Numerics of every unlearning trainer: fp32 master weights for half-precision models, a hard stop on NaN/inf."""

from __future__ import annotations

import pytest
import torch

from hf_unlearn.errors import UnlearnError
from hf_unlearn.methods import GradAscentConfig, GradAscentTrainer

from .methods_helpers import memorised_model, tiny_data

COMMON = dict(report_to=[], use_cpu=True, disable_tqdm=True, save_strategy="no", logging_steps=1,
              per_device_train_batch_size=2, retain_loss="none", lr_scheduler_type="constant", weight_decay=0.0)


def _trainer(tmp_path, model=None, trainer_cls=GradAscentTrainer, peft_config=None, **kw):
    tok, forget, _ = tiny_data()
    args = GradAscentConfig(output_dir=str(tmp_path), **{**COMMON, **kw})
    return trainer_cls(model=model if model is not None else memorised_model(), args=args, forget_dataset=forget,
                       processing_class=tok, peft_config=peft_config)


def _sub_resolution(weight: torch.Tensor, lr: float) -> torch.Tensor:
    """Entries where one Adam step (about lr) is below half a bf16 ulp, so bf16 arithmetic rounds it away."""
    return weight.float().abs() > lr * 2 ** 9


@pytest.mark.parametrize("master", [True, False])
def test_bf16_updates_below_resolution_survive_only_with_fp32_master_weights(master, tmp_path):
    lr, steps = 2e-5, 12
    model = memorised_model().to(torch.bfloat16)
    trainer = _trainer(tmp_path, model, learning_rate=lr, max_steps=steps, fp32_master_weights=master)
    weight = trainer.model.model.layers[0].mlp.up_proj.weight
    before = weight.detach().clone()
    small = _sub_resolution(before, lr)
    assert small.float().mean() > 0.7  # most entries: a single update is below bf16 resolution
    trainer.train()
    after = trainer.model.model.layers[0].mlp.up_proj.weight
    assert after.dtype == torch.bfloat16 and next(trainer.model.parameters()).dtype == torch.bfloat16  # cast back
    moved = (after != before)[small].float().mean().item()
    print(f"master={master}: {moved:.1%} of the sub-resolution weights moved")
    if master:
        assert moved > 0.3, f"only {moved:.1%} of the sub-resolution weights moved with fp32 master weights"
    else:
        assert moved < 0.02, f"{moved:.1%} moved in pure bf16: the test does not measure rounding"


def test_half_precision_lora_adapter_trains_in_fp32_and_the_base_stays_half(tmp_path):
    from peft import LoraConfig, get_peft_model

    base = memorised_model().to(torch.bfloat16)
    model = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]), autocast_adapter_dtype=False)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    seen = {}
    trainer = _trainer(tmp_path, model, learning_rate=1e-3, max_steps=2)

    from transformers import TrainerCallback

    class DtypeSpy(TrainerCallback):
        def on_step_end(self, args, state, control, model=None, **kw):
            seen["adapter"] = {p.dtype for n, p in model.named_parameters() if "lora_" in n}
            seen["base"] = {p.dtype for n, p in model.named_parameters() if "lora_" not in n}

    trainer.add_callback(DtypeSpy())
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    assert seen == {"adapter": {torch.float32}, "base": {torch.bfloat16}}
    changed = {n for n, p in trainer.model.named_parameters() if not torch.equal(before[n], p)}
    assert changed and all("lora_" in n for n in changed)
    assert all(p.dtype == torch.bfloat16 for p in trainer.model.parameters())


def test_nan_loss_stops_training_naming_the_step_before_the_update(tmp_path):
    class NaNAtStep2(GradAscentTrainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            return loss * float("nan") if self.state.global_step == 1 else loss

    trainer = _trainer(tmp_path, trainer_cls=NaNAtStep2, learning_rate=1e-3, max_steps=4)
    after_step_1 = {}

    from transformers import TrainerCallback

    class Keep(TrainerCallback):
        def on_step_end(self, args, state, control, model=None, **kw):
            after_step_1.update({n: p.detach().clone() for n, p in model.named_parameters()})

    trainer.add_callback(Keep())
    with pytest.raises(UnlearnError, match=r"NaNAtStep2: the loss is nan at step 2; training stopped before"):
        trainer.train()
    assert trainer.state.global_step == 1
    for name, p in trainer.model.named_parameters():
        assert torch.equal(p, after_step_1[name]) and torch.isfinite(p).all(), name


def test_nan_gradient_with_a_finite_loss_stops_before_the_optimizer_step(tmp_path):
    trainer = _trainer(tmp_path, learning_rate=1e-3, max_steps=4, max_grad_norm=1.0)
    weight = trainer.model.model.layers[1].mlp.down_proj.weight
    weight.register_hook(lambda g: g * float("nan") if trainer.state.global_step == 2 else g)
    with pytest.raises(UnlearnError, match=r"gradient is not finite \(norm nan\) at step 3; training stopped"):
        trainer.train()
    assert trainer.state.global_step == 2
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())


def test_the_guards_can_be_switched_off(tmp_path):
    class NaNAlways(GradAscentTrainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch) * float("nan")

    trainer = _trainer(tmp_path, trainer_cls=NaNAlways, max_steps=2, stop_on_nonfinite=False)
    trainer.train()  # the Trainer's own behaviour: it runs on and the weights become NaN
    assert trainer.state.global_step == 2
    assert not all(torch.isfinite(p).all() for p in trainer.model.parameters())


def test_fp16_model_trains_in_fp32_and_comes_back_fp16(tmp_path):
    model = memorised_model().to(torch.float16)
    trainer = _trainer(tmp_path, model, learning_rate=1e-3, max_steps=1)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    assert all(p.dtype == torch.float16 for p in trainer.model.parameters())
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())
    assert all(not torch.equal(before[n], p) for n, p in trainer.model.named_parameters())
