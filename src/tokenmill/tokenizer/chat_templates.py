"""Chat templates for models whose files carry none.

Gemma 3: its GGUF files (e.g. the Gemma 3 270M that tokenmill installs) often lack
``tokenizer.chat_template``. This template follows Gemma's documented turn format: each turn is
``<start_of_turn>{role}\\n{content}<end_of_turn>\\n`` with the roles ``user`` and ``model`` (an OpenAI
``assistant`` is Gemma's ``model``), the conversation starts with BOS, a system message has no turn of its
own but opens the first user turn followed by a blank line, and a generation prompt is
``<start_of_turn>model\\n``.
"""

GEMMA3_CHAT_TEMPLATE = r"""{{- bos_token -}}
{%- if messages and messages[0]['role'] == 'system' -%}
    {%- set system_prefix = messages[0]['content'] ~ '\n\n' -%}
    {%- set turns = messages[1:] -%}
{%- else -%}
    {%- set system_prefix = '' -%}
    {%- set turns = messages -%}
{%- endif -%}
{%- for message in turns -%}
    {%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}
    {{- '<start_of_turn>' ~ role ~ '\n' ~ (system_prefix if loop.first else '') -}}
    {{- (message['content'] or '') | trim -}}
    {{- '<end_of_turn>\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<start_of_turn>model\n' -}}
{%- endif -%}
"""

# GGUF architecture -> the template used when the file has none.
FALLBACK_CHAT_TEMPLATES: dict[str, str] = {"gemma3": GEMMA3_CHAT_TEMPLATE}
# GGUF architecture -> the token that ends a chat turn, when the file names no eot id of its own.
END_OF_TURN_TOKENS: dict[str, str] = {"gemma3": "<end_of_turn>"}
