"""Chat templates: OpenAI's chat messages as the one prompt a completion model continues, by the
Jinja template HF tokenizers carry (`tokenizer_config.json`'s `chat_template`, rendered as
transformers' `apply_chat_template` renders it: a sandboxed environment, `trim_blocks` and
`lstrip_blocks`, `raise_exception`, the tokenizer's special tokens as variables).

Which template: `--chat-template FILE` when given, else the tokenizer's; with neither,
/v1/chat/completions answers 400 saying so. Templates run in Jinja's immutable sandbox: a
template can loop and format, not reach Python objects or files.
"""
from __future__ import annotations

import datetime
import json
from pathlib import Path

from bloomtrain.errors import UserError


class TemplateError(ValueError):
    """The template refused the messages (its raise_exception), or failed on them."""


def template_source(tokenizer, path: str | None) -> str | None:
    """The chat template's text: the file `path` (--chat-template) when given, else the
    tokenizer's (a string, or the "default" of a list of named templates), else None."""
    if path is not None:
        try:
            return Path(path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise UserError(f"--chat-template {path}: cannot read it ({e})") from None
    # transformers 4.43+ saves it as chat_template.jinja beside tokenizer_config.json, and
    # reads that file first.
    where = getattr(tokenizer, "path", None)
    jinja = Path(where).parent / "chat_template.jinja" if where else None
    if jinja is not None and jinja.is_file():
        try:
            return jinja.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise UserError(f"{jinja}: cannot read it ({e})") from None
    found = tokenizer.config.get("chat_template")
    if isinstance(found, list):  # [{"name": ..., "template": ...}], as HF writes several
        named = {t.get("name"): t.get("template") for t in found if isinstance(t, dict)}
        found = named.get("default")
    return found if isinstance(found, str) and found.strip() else None


def _raise(message):
    raise TemplateError(message)


class ChatTemplate:
    def __init__(self, source: str, tokenizer):
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        # The environment transformers' apply_chat_template renders in: its tojson, its
        # strftime_now global (Llama 3's templates) and its {% generation %} tag (which only
        # marks the assistant's part for its masks: here the body renders as it is).
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols",
                                                        _generation_tag()])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
        try:
            self.template = env.from_string(source)
        except jinja2.TemplateError as e:
            raise UserError(f"the chat template does not compile: {e}") from None
        self.source = source
        # As transformers passes its special_tokens_map: by role, as the tokenizer resolves
        # them (special_tokens_map.json over tokenizer_config.json; GPT-2's <|endoftext|>).
        self.special = dict(tokenizer.special_tokens())
        if "eos_token" not in self.special:
            try:
                self.special["eos_token"] = tokenizer.id_to_token(tokenizer.eod_id)
            except UserError:
                pass

    def render(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        import jinja2

        try:
            # tools and documents None, not undefined, as transformers passes them: a
            # template's `tools is not none` test is then false.
            return self.template.render(messages=messages, tools=None, documents=None,
                                        add_generation_prompt=add_generation_prompt,
                                        **{k: v for k, v in self.special.items()
                                           if v is not None})
        except TemplateError:
            raise
        except (jinja2.TemplateError, TypeError, ValueError, KeyError) as e:
            raise TemplateError(f"the chat template failed on these messages: {e}") from None


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    """transformers' tojson filter, with its arguments."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _generation_tag():
    """A Jinja extension for `{% generation %}...{% endgeneration %}`, rendering the body."""
    from jinja2 import nodes
    from jinja2.ext import Extension

    class Generation(Extension):
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        @staticmethod
        def _body(caller):
            return caller()

    return Generation
