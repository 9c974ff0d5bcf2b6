"""An observation as the tokens that follow the model's turn, in the tokenizer's chat format.

With a chat template, the observation's messages are rendered after a model turn and the text the
template adds after that turn is the observation's: e.g. for Qwen
``\\n<|im_start|>user\\n<tool_response>...</tool_response><|im_end|>\\n<|im_start|>assistant\\n``
(the ``<|im_end|>`` that closes the turn is the model's own stop token, so it is not repeated; a
turn cut by its length gets it from here). Without a chat template the observation's text is
appended as it is.
"""

from __future__ import annotations

MARK = "\u2063TURN\u2063"  # stands for the model's turn in the template's rendering


class ObservationFormat:
    def __init__(self, tokenizer, role: str, *, chat: bool):
        self.tokenizer, self.role = tokenizer, role
        self.chat = chat and getattr(tokenizer, "chat_template", None) is not None
        if self.chat:
            self._history = [{"role": "user", "content": "U"}, {"role": "assistant", "content": MARK}]
            self._head = self._render(self._history, generation_prompt=False)
            if MARK not in self._head:
                raise ValueError("the tokenizer's chat template drops the assistant's message; it cannot "
                                 "render multi-turn episodes")
            self._after_turn = self._head[self._head.rindex(MARK) + len(MARK):]

    def _render(self, messages: list[dict], *, generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)

    def messages(self, observation: str | list[dict[str, str]]) -> list[dict[str, str]]:
        if isinstance(observation, str):
            return [{"role": self.role, "content": observation}]
        return [{"role": m.get("role", self.role), "content": m["content"]} for m in observation]

    def text(self, observation: str | list[dict[str, str]], stop_text: str | None) -> str:
        """The text after a model turn that ended with ``stop_text`` (the decoded stop token, or
        None for a turn cut by its length)."""
        if not self.chat:
            if isinstance(observation, str):
                return observation
            return "".join(m["content"] for m in observation)
        full = self._render(self._history + self.messages(observation), generation_prompt=True)
        if not full.startswith(self._head):
            raise ValueError("the tokenizer's chat template renders earlier turns differently once an observation "
                             "follows; it cannot continue episodes without re-rendering them")
        closing = self._after_turn
        if stop_text and closing.startswith(stop_text):
            closing = closing[len(stop_text):]
        return closing + full[len(self._head):]

    def ids(self, observation: str | list[dict[str, str]], stop_text: str | None) -> list[int]:
        return self.tokenizer(self.text(observation, stop_text), add_special_tokens=False)["input_ids"]
