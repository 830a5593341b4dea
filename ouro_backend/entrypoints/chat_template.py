"""A checkpoint's chat template: the HF `chat_template` of its tokenizer_config.json, rendered as transformers
renders it (a sandboxed jinja2 environment with `trim_blocks`, `lstrip_blocks` and loop controls; the
variables `messages`, `add_generation_prompt`, `bos_token`, `eos_token`; `raise_exception(msg)`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


class TemplateError(ValueError):
    """The template does not parse, refused the messages (its raise_exception) or failed to render them."""


class ChatTemplate:
    def __init__(self, source: str, bos_token: str = "", eos_token: str = ""):
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise TemplateError(message)

        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.globals["raise_exception"] = raise_exception
        try:
            self.template = env.from_string(source)
        except jinja2.TemplateError as e:
            raise TemplateError(f"the chat template does not parse: {e}") from e
        self.bos_token, self.eos_token = bos_token, eos_token

    @classmethod
    def of(cls, model_dir: str | Path) -> ChatTemplate | None:
        """The template of the checkpoint in `model_dir`; None when it has none (no tokenizer_config.json, or
        no `chat_template` in it). A list of named templates (HF's other form) gives its `default` one."""
        path = Path(model_dir) / "tokenizer_config.json"
        if not path.is_file():
            return None
        cfg = json.loads(path.read_text())
        source = cfg.get("chat_template")
        if isinstance(source, list):
            named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
            source = named.get("default")
        if not isinstance(source, str):
            return None

        def token(key: str) -> str:
            t = cfg.get(key) or ""
            return t.get("content", "") if isinstance(t, dict) else str(t)

        return cls(source, token("bos_token"), token("eos_token"))

    def render(self, messages: list[dict[str, Any]]) -> str:
        """The prompt for `messages` (dicts with at least `role` and `content`), ending with the assistant's
        turn. TemplateError if the template refuses them."""
        import jinja2

        try:
            return self.template.render(
                messages=messages, add_generation_prompt=True, bos_token=self.bos_token, eos_token=self.eos_token
            )
        except jinja2.TemplateError as e:
            raise TemplateError(f"the chat template failed on these messages: {e}") from e
