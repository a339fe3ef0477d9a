"""Chat templates that render SFT conversations as text: built-in ones, a file, or the tokenizer's.

`tools/preprocess_data.py --sft` renders each conversation (`{"messages": [{"role", "content"},
...]}`) with one Jinja chat template, as Hugging Face's `apply_chat_template` does:

- `--sft-tokenizer-prompt-format default` (Megatron-LM's flag; our default): the tokenizer's own
  template, through `transformers`' `apply_chat_template` (an `HFTokenizer` folder that has
  one; other tokenizers have none and need one of the formats below);
- a built-in format by name: `chatml` (`<|im_start|>role\\ncontent<|im_end|>\\n`, the format
  of Qwen, OpenHermes and many others), `identity` (the contents back to back, Megatron-LM's),
  and Megatron-LM's `nemotron-h-aligned` and `nemotron-nano-v2`;
- `--chat-template FILE`: a Jinja template file, written as Hugging Face's `chat_template`.

Templates see `messages`, `add_generation_prompt`, `bos_token` and `eos_token`, with the
environment `transformers` gives them (trim_blocks, lstrip_blocks, loop controls,
`raise_exception`, a `tojson` that keeps non-ASCII text); `{% generation %}` blocks render
their content. Megatron-LM's `nemotron-nano-v2` renders the assistant header inside the
assistant message; ours renders it as the generation prompt too, so that, as Megatron-LM masks
its first three tokens, the header is not trained on.
"""

from __future__ import annotations

import json
from collections.abc import Callable

from megatron.data.corpus_reader import InputError

# fmt: off
CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# Megatron-LM's (megatron/core/tokenizers/text/libraries/sft_tokenizer.py).
IDENTITY = "{% for message in messages %}{{ message['content'] }}{% endfor %}"
NEMOTRON_H_ALIGNED = (
    "{% for message in messages %}{% if message['role'] == 'system' %}"
    "{{ '<SPECIAL_10>System\n' + message['content'].strip() + '\n' }}"
    "{% elif message['role'] == 'user' %}"
    "{{ '<SPECIAL_11>User\n' + message['content'].strip() + '\n' + '<SPECIAL_11>Assistant\n' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'].strip() + '\n' }}"
    "{% endif %}{% endfor %}"
)
NEMOTRON_NANO_V2 = (
    "{% for message in messages %}{% set content = message['content'] %}"
    "{% if message['role'] == 'system' %}{{ '<SPECIAL_10>System\n' + content.replace('/think', "
    "'').replace('/no_think', '').strip() + '\n' }}"
    "{% elif message['role'] == 'user' %}{{ '<SPECIAL_11>User\n' + content.replace('/think', "
    "'').replace('/no_think', '').strip() + '\n' }}"
    "{% elif message['role'] == 'assistant' %}"
    "{{ '<SPECIAL_11>Assistant\n' + content.strip() + '\n<SPECIAL_12>\n' }}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<SPECIAL_11>Assistant\n' }}{% endif %}"
)
# fmt: on

BUILTIN_TEMPLATES = {
    "chatml": CHATML,
    "identity": IDENTITY,
    "nemotron-h-aligned": NEMOTRON_H_ALIGNED,
    "nemotron-nano-v2": NEMOTRON_NANO_V2,
}
TOKENIZER_TEMPLATE = "default"
PROMPT_FORMATS = (TOKENIZER_TEMPLATE, *BUILTIN_TEMPLATES)

Renderer = Callable[[list[dict], bool], str]
"""render(messages, add_generation_prompt) -> text."""


def read_template_file(path: str) -> str:
    """The text of a `--chat-template` file; InputError naming it when it cannot be read."""
    try:
        with open(path, encoding="utf-8") as file:
            return file.read()
    except (OSError, UnicodeDecodeError) as error:
        raise InputError(f"--chat-template {path}: cannot be read ({error})") from None


def jinja_renderer(
    template: str, bos_token: str = "", eos_token: str = "", label: str = ""
) -> Renderer:
    """A renderer of `template` in the sandboxed environment `transformers` renders with."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationBlocks(jinja2.ext.Extension):
        """`{% generation %}...{% endgeneration %}` renders its body (transformers marks it)."""

        tags = {"generation"}

        def parse(self, parser: jinja2.parser.Parser) -> list:
            next(parser.stream)
            return parser.parse_statements(("name:endgeneration",), drop_needle=True)

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value: object, ensure_ascii: bool = False, indent: int | None = None) -> str:
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent)

    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[GenerationBlocks, jinja2.ext.loopcontrols],
    )
    environment.filters["tojson"] = tojson
    environment.globals["raise_exception"] = raise_exception
    try:
        compiled = environment.from_string(template)
    except jinja2.exceptions.TemplateSyntaxError as error:
        raise InputError(f"{label}: not a Jinja template (line {error.lineno}: {error})") from None

    def render(messages: list[dict], add_generation_prompt: bool) -> str:
        return compiled.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=bos_token,
            eos_token=eos_token,
        )

    return render


def template_problem(prompt_format: str, chat_template_file: str | None) -> str | None:
    """What is wrong with the template flags (None when nothing is)."""
    if prompt_format not in PROMPT_FORMATS:
        return (
            f"--sft-tokenizer-prompt-format {prompt_format}: choose one of "
            f"{', '.join(PROMPT_FORMATS)}"
        )
    if chat_template_file and prompt_format != TOKENIZER_TEMPLATE:
        return (
            f"--chat-template {chat_template_file} and --sft-tokenizer-prompt-format "
            f"{prompt_format} both name a template; give one"
        )
    return None
