"""How a question/answer pair becomes token ids: :class:`PromptFormat`, one named, documented setting.

Two conventions, each a value of the dataclass:

* ``PromptFormat()`` (hf_unlearn's, what every training and evaluation here uses by default): the chat template's user
  turn alone (when the tokenizer has a template), or ``"Question: {q}\\nAnswer:"``; prompt and answer are tokenised
  apart (``" " + answer`` after a plain prompt) and EOS is appended, so the answer tokens are the answer's own
  tokenisation whatever precedes it.
* :meth:`PromptFormat.open_unlearning` (OpenUnlearning's ``preprocess_chat_instance`` with the ``template_args`` of its
  model configs, commit d3d7cf9): per model family a system prompt ``"You are a helpful assistant."``, Llama-3.x's
  fixed ``date_string`` (``"10 Apr 2025"``) passed to ``apply_chat_template``, Llama-2-chat's ``[INST] q [/INST]``
  wrapper (no chat template, answer directly after ``[/INST]``), and for base models ``"Question: q\\nAnswer: "`` with
  its trailing space; the whole conversation is tokenised at once and the answer tokens are those after the
  prompt's own tokenisation (``joint=True``). With a plain prompt the trailing space of ``Answer: `` is a token of
  its own in the prompt but merges into the first answer token in the full text (``" The"``), so that first answer
  token is never scored: OpenUnlearning's numbers are computed that way.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, replace
from typing import Any

from ..errors import UnlearnError

IGNORE_INDEX = -100
OU_SYSTEM_PROMPT = "You are a helpful assistant."
OU_DATE_STRING = "10 Apr 2025"  # OpenUnlearning's Llama-3.x model configs fix the date the template prints
PROMPT_FORMATS = ("hf-unlearn", "open-unlearning")


@dataclass(frozen=True)
class PromptFormat:
    """A prompt convention (see the module docstring).

    Args:
        chat_template: use the tokenizer's chat template (None: when it has one).
        system_prompt: a system turn before the question (chat templates only).
        date_string: passed to ``apply_chat_template`` (Llama-3.x templates print it; others ignore it).
        user_start, user_end, assistant_start: the plain prompt is ``user_start + question + user_end +
            assistant_start`` (hf_unlearn: ``"Question: "``, ``"\\n"``, ``"Answer:"``; OpenUnlearning ``"Answer: "``;
            Llama-2-chat ``"[INST] "``, ``" [/INST]"``, ``""``).
        joint: False = prompt and answer tokenised apart (a leading space before the answer when the plain prompt
            does not end in whitespace), EOS appended; True = OpenUnlearning's: the whole conversation tokenised at
            once, the answer = the tokens after the prompt's own tokenisation, EOS appended unless it ends with it.
        name: a label for results and tables.
    """

    chat_template: bool | None = None
    system_prompt: str | None = None
    date_string: str | None = None
    user_start: str = "Question: "
    user_end: str = "\n"
    assistant_start: str = "Answer:"
    joint: bool = False
    name: str = "hf-unlearn"

    @classmethod
    def open_unlearning(cls, tokenizer) -> PromptFormat:
        """OpenUnlearning's ``template_args`` for ``tokenizer``'s model family, chosen from its chat template:
        Llama-3.x (``<|start_header_id|>``): template + system prompt + ``date_string``; Llama-2-chat (``[INST]``):
        the ``[INST] ... [/INST]`` wrapper without the template; Gemma (``<start_of_turn>``, whose template refuses a
        system turn): the template alone; any other template (Qwen2.5, Phi-3.5, Zephyr, SmolLM2): template + system
        prompt; no template (Llama-2, Phi-1.5 base models): ``Question: q\\nAnswer: ``."""
        template = getattr(tokenizer, "chat_template", None) or ""
        if not isinstance(template, str):  # several named templates: the default one decides
            template = str(dict(template).get("default", template))
        base = cls(joint=True, name="open-unlearning")
        if not template:
            return replace(base, chat_template=False, assistant_start="Answer: ")
        if "[INST]" in template:
            return replace(base, chat_template=False, user_start="[INST] ", user_end=" [/INST]", assistant_start="")
        if "<start_of_turn>" in template:
            return replace(base, chat_template=True)
        if "<|start_header_id|>" in template:
            return replace(base, chat_template=True, system_prompt=OU_SYSTEM_PROMPT, date_string=OU_DATE_STRING)
        return replace(base, chat_template=True, system_prompt=OU_SYSTEM_PROMPT)

    def resolve(self, tokenizer) -> PromptFormat:
        """This format with ``chat_template`` decided for ``tokenizer`` (refused when asked for and missing)."""
        has = has_chat_template(tokenizer)
        if self.chat_template and not has:
            raise UnlearnError(
                f"a chat template was asked for but tokenizer {getattr(tokenizer, 'name_or_path', '')!r} has none; "
                "use plain prompts (use_chat_template=False / --chat-template no) or a tokenizer with a template")
        return self if self.chat_template is not None else replace(self, chat_template=has)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    # -- text and ids ---------------------------------------------------------------------------------------------
    def _messages(self, question: str) -> list[dict]:
        system = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        return [*system, {"role": "user", "content": question}]

    def _template(self, tokenizer, messages, *, tokenize: bool, generation: bool):
        extra = {"date_string": self.date_string} if self.date_string is not None else {}
        out = tokenizer.apply_chat_template(messages, tokenize=tokenize, add_generation_prompt=generation, **extra)
        if tokenize and isinstance(out, Mapping):  # transformers >= 5 returns a BatchEncoding
            out = out["input_ids"]
        return list(out) if tokenize else out

    def prompt_text(self, tokenizer, question: str) -> str:
        """The prompt the model is trained and evaluated with (generation starts right after it)."""
        if self.resolve(tokenizer).chat_template:
            return self._template(tokenizer, self._messages(question), tokenize=False, generation=True)
        return self.user_start + question + self.user_end + self.assistant_start

    def prompt_ids(self, tokenizer, question: str, max_length: int | None = None) -> list[int]:
        """Token ids of the prompt exactly as :meth:`encode` builds them (the generation prompt)."""
        fmt = self.resolve(tokenizer)
        if fmt.chat_template and fmt.joint:
            return fmt._template(tokenizer, fmt._messages(question), tokenize=True, generation=True)
        ids = tokenizer(fmt.prompt_text(tokenizer, question), add_special_tokens=not fmt.chat_template)["input_ids"]
        return ids[:max_length] if fmt.joint and max_length else ids

    def encode(self, tokenizer, question: str, answer: str, max_length: int = 256) -> dict[str, list[int]]:
        """``input_ids``, ``attention_mask`` and ``labels`` (``-100`` on the prompt) of one QA pair; raises if no
        answer token is left."""
        fmt = self.resolve(tokenizer)
        eos = tokenizer.eos_token_id
        prompt = fmt.prompt_ids(tokenizer, question, max_length)
        if fmt.joint:
            if fmt.chat_template:
                chat = [*fmt._messages(question), {"role": "assistant", "content": answer}]
                full = fmt._template(tokenizer, chat, tokenize=True, generation=False)[:max_length]
            else:
                full = tokenizer(fmt.prompt_text(tokenizer, question) + answer, add_special_tokens=True)["input_ids"]
                full = full[:max_length]
            if eos is not None and (not full or full[-1] != eos):
                full = full + [eos]
            answer_ids = full[len(prompt):]
            prompt_part = full[:len(prompt)]  # the full text's own tokens (they can differ from the prompt's at the
            # border: OpenUnlearning feeds the full text and masks as many positions as the prompt has tokens)
        else:
            prompt_part = prompt
            spaced = fmt.chat_template or not fmt.assistant_start or fmt.assistant_start[-1].isspace()
            answer_ids = tokenizer(answer if spaced else " " + answer, add_special_tokens=False)["input_ids"]
            if eos is not None:
                answer_ids = answer_ids + [eos]
            answer_ids = answer_ids[:max(0, max_length - len(prompt))]
        if not answer_ids:
            raise UnlearnError(
                f"the answer is empty after truncation to max_length={max_length} (prompt has {len(prompt)} tokens); "
                "raise max_length")
        input_ids = prompt_part + answer_ids
        return {"input_ids": input_ids, "attention_mask": [1] * len(input_ids),
                "labels": [IGNORE_INDEX] * len(prompt_part) + answer_ids}


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def prompt_format(spec, tokenizer=None) -> PromptFormat:
    """A :class:`PromptFormat` from ``spec``: a PromptFormat, None (hf_unlearn's, template when the tokenizer has
    one), a bool (``use_chat_template``), ``"hf-unlearn"`` or ``"open-unlearning"`` (needs ``tokenizer``: the family
    decides), or a dict of its fields (as results store it)."""
    if isinstance(spec, PromptFormat):
        return spec
    if spec is None or isinstance(spec, bool):
        return PromptFormat(chat_template=spec)
    if isinstance(spec, Mapping):
        try:
            return PromptFormat(**spec)
        except TypeError as e:
            raise UnlearnError(f"prompt_format: {e}") from None
    if spec == "hf-unlearn":
        return PromptFormat()
    if spec == "open-unlearning":
        if tokenizer is None:
            raise UnlearnError("prompt_format='open-unlearning' depends on the model family: pass the tokenizer")
        return PromptFormat.open_unlearning(tokenizer)
    raise UnlearnError(f"prompt_format must be a PromptFormat, a bool or one of {', '.join(PROMPT_FORMATS)}; "
                       f"got {spec!r}")
