"""Publishing unlearned models to the Hugging Face Hub and checking them there.

``cards`` renders model cards from the Jinja templates in ``model_cards/``; ``keys`` turns raw sample ids into keyed
tags (HMAC with a key that stays local); ``publish`` pushes weights, tokenizer, state-hash manifest, card and
publishable provenance in one commit; ``verify`` downloads a revision and recomputes its state hashes;
``mixin`` gives trainers ``create_model_card``/``push_to_hub``; ``server`` is a local Hub-compatible server.
Modules import ``huggingface_hub`` only inside functions, so ``HF_ENDPOINT`` can be set late.
"""
