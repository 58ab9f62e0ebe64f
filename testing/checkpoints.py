"""Test fixtures, never on a user's path: tiny HF-format checkpoints built locally (a byte-level BPE
tokenizer with a ChatML template, random Llama / Mistral / Qwen2 weights made by transformers' own
classes). Nothing here touches the network. Tests use these checkpoints with HF transformers as the
logits oracle; benchmarks use them for shape-only runs.
"""

from __future__ import annotations

import copy
import errno
import json
import logging
import os
import shutil
import tempfile
import threading
from pathlib import Path
from typing import Any

from radixlm.core.runtime.cache import cache_dir

logger = logging.getLogger("radixlm")

BOS_TOKEN = "<|begin_of_text|>"
EOS_TOKEN = "<|end_of_text|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
PAD_TOKEN = "<|pad|>"
SPECIAL_TOKENS = [BOS_TOKEN, EOS_TOKEN, IM_START, IM_END, PAD_TOKEN]

# Total vocabulary: 256 byte tokens + BPE merges + the special tokens, which are added last so their
# ids sit at the end of the vocabulary, as in Llama 3.
VOCAB_SIZE = 1000

TINY_MODEL_NAME = "default-tiny-llama-v1"

# ChatML with a leading bos. `tools` (OpenAI function specs) go into the system turn; assistant
# tool calls and tool results are rendered as <tool_call> / <tool_response> blocks. Message content
# may be a string or a list of OpenAI-style parts, of which the text parts are rendered.
CHAT_TEMPLATE = (
    "{%- macro render_content(content) -%}"
    "{%- if content is string -%}{{ content }}"
    "{%- elif content is not none -%}"
    "{%- for part in content if part['type'] == 'text' -%}{{ part['text'] }}{%- endfor -%}"
    "{%- endif -%}"
    "{%- endmacro -%}"
    "{{- bos_token -}}"
    "{%- if tools -%}"
    "{{- '<|im_start|>system\\n' -}}"
    "{%- if messages and messages[0]['role'] == 'system' -%}"
    "{{- render_content(messages[0]['content']) + '\\n\\n' -}}"
    "{%- endif -%}"
    "{{- '# Tools\\n\\nYou may call one or more functions. Their signatures are within <tools></tools>:\\n<tools>' -}}"
    "{%- for tool in tools -%}{{- '\\n' + (tool | tojson) -}}{%- endfor -%}"
    "{{- '\\n</tools>\\n\\nTo call a function, reply with a JSON object inside <tool_call></tool_call>:\\n"
    "<tool_call>\\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\\n</tool_call><|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' and tools and loop.first -%}"
    "{#- already rendered together with the tools -#}"
    "{%- elif message['role'] == 'tool' -%}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + render_content(message['content']) + '\\n</tool_response><|im_end|>\\n' -}}"
    "{%- else -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + render_content(message['content']) -}}"
    "{%- for call in message.get('tool_calls') or [] -%}"
    "{%- set fn = call['function'] if call['function'] is defined else call -%}"
    "{%- set args = fn['arguments'] if fn['arguments'] is string else (fn['arguments'] | tojson) -%}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' + fn['name'] + '\", \"arguments\": ' + args + '}\\n</tool_call>' -}}"
    "{%- endfor -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

# Training text for the tokenizer: plain prose, dialogue, numbers, JSON and code, so that merges
# cover the shapes constrained-decoding and chat tests produce. Changing it changes every token id:
# bump TINY_MODEL_NAME when you do.
TRAINING_TEXT = """\
The quick brown fox jumps over the lazy dog. A small language model reads a prompt, one token at a
time, and writes the next token. When many requests share the same beginning, the runtime keeps the
computed keys and values in a radix tree, so the shared prefix is computed only once.

Once upon a time there was a little town by the sea. Every morning the baker opened his shop at six
o'clock, and the children walked past on their way to school. They asked him what he was baking, and
he always answered with a smile: "Bread for the town, and a cake for whoever is kind today."

Question: What is the capital of France?
Answer: The capital of France is Paris.
Question: How many days are in a week?
Answer: There are seven days in a week: Monday, Tuesday, Wednesday, Thursday, Friday, Saturday and Sunday.
Question: Which planet is the largest in the solar system?
Answer: Jupiter is the largest planet. Saturn is the second largest, and Earth is the fifth.

User: Can you help me plan a trip to the mountains?
Assistant: Of course. How many days do you have, and do you prefer hiking or resting by a lake?
User: Three days, and I like hiking.
Assistant: Then start with an easy walk on the first day, climb the highest peak on the second, and
keep the third day for a slow walk back through the forest. Pack water, a warm jacket and a map.

Step 1: Read the problem carefully. Step 2: Write down what you know. Step 3: Solve for the unknown.
If x + 3 = 10, then x = 7. If 2 * y = 18, then y = 9. The sum of 12 and 30 is 42, and 100 - 58 = 42.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 20 25 32 50 64 100 128 256 512 1000 1024 2048 4096.
Dates and times: 2024-01-15, 12:30 PM, 3.14159, -7.5, 1e-5, 98.6%, $19.99, #42, (a, b), [1, 2, 3].

{"name": "Alice", "age": 30, "city": "London", "is_student": false, "scores": [90, 85, 77]}
{"name": "Bob", "age": 25, "city": "New York", "is_student": true, "scores": [], "email": null}
{"id": 1, "title": "Buy milk", "done": false, "tags": ["home", "shopping"], "priority": "high"}
{"type": "object", "properties": {"name": {"type": "string"}, "count": {"type": "integer"}},
 "required": ["name", "count"], "additionalProperties": false}
<tool_call>
{"name": "get_weather", "arguments": {"location": "Paris", "unit": "celsius"}}
</tool_call>

def fibonacci(n: int) -> int:
    if n < 2:
        return n
    return fibonacci(n - 1) + fibonacci(n - 2)

for i in range(10):
    print(i, fibonacci(i))

class Counter:
    def __init__(self) -> None:
        self.value = 0

    def increment(self, step: int = 1) -> int:
        self.value += step
        return self.value

import json
data = json.loads('{"key": "value", "items": [1, 2, 3]}')
print(data["key"], len(data["items"]))

function add(a, b) { return a + b; }
const result = [1, 2, 3].map((x) => x * 2).filter((x) => x > 2);
SELECT name, age FROM users WHERE age > 21 ORDER BY name;

The history of science is a story of people asking simple questions. Why does the apple fall? Why is
the sky blue? Why do the seasons change? Each answer opened new questions, and each new tool, from the
telescope to the computer, let people see further than before. Today scientists study the smallest
particles and the largest galaxies, and they still begin with a question and an experiment.

A good recipe for tomato soup: chop two onions and three cloves of garlic, cook them in olive oil until
soft, add one kilogram of ripe tomatoes, a pinch of salt and a little pepper, and let everything
simmer for twenty minutes. Blend it until smooth, taste it, and serve it warm with fresh bread.

Dear Sir or Madam, thank you for your letter of the tenth of March. I am writing to confirm that your
order has been shipped and should arrive within five working days. Please let us know if there is
anything else we can do for you. Kind regards, the customer service team.

Rules for the game: each player draws seven cards. On your turn, play a card that matches the colour
or the number of the card on the table, or draw a new card. The first player with no cards left wins.
Remember to say the name of the game when you have only one card left!

Weather report: sunny in the morning, with clouds in the afternoon and light rain in the evening.
Temperatures between 12 and 19 degrees. Wind from the west at 15 kilometres per hour. Tomorrow will be
colder, with a chance of snow in the hills and strong winds near the coast.

Yes. No. Maybe. True, false, null, none. Hello, world! Good morning. Good night. Thank you very much.
Please, sorry, excuse me, you're welcome. I think that it's a good idea, but we'll see what they say.
Caf\u00e9, na\u00efve, r\u00e9sum\u00e9, \u00fcber, ni\u00f1o, \u00c5ngstr\u00f6m, \u00bfQu\u00e9 tal?, \u4f60\u597d, \u3053\u3093\u306b\u3061\u306f, \u041f\u0440\u0438\u0432\u0435\u0442, \u0645\u0631\u062d\u0628\u0627, \U0001f600 \U0001f680.
"""


# Qwen2's split of text into pre-tokens (cl100k-style: digits one at a time, punctuation apart).
QWEN2_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)


def build_tokenizer(out_dir: str, *, qwen2_style: bool = False) -> None:
    """Train the byte-level BPE tokenizer on TRAINING_TEXT and save it into out_dir (created if needed)
    as tokenizer.json, tokenizer_config.json and special_tokens_map.json, loadable with
    `transformers.AutoTokenizer.from_pretrained(out_dir)`. Deterministic: same text, same bytes.
    Plain encoding adds no special tokens; the chat template starts with the bos token.

    qwen2_style: NFC-normalize and pre-tokenize as Qwen2 does. transformers 5 rebuilds the tokenizer
    of every checkpoint whose model_type is qwen2 that way, so Qwen2 checkpoints need it for their
    tokenizer.json and AutoTokenizer to agree."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    if qwen2_style:
        tokenizer.normalizer = normalizers.NFC()
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    else:
        # add_prefix_space=False: encode(text) must decode back to exactly text.
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE - len(SPECIAL_TOKENS),
        min_frequency=1,
        # All 256 byte symbols, so any UTF-8 text has an encoding.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(TRAINING_TEXT.splitlines(keepends=True), trainer=trainer)
    tokenizer.add_special_tokens(SPECIAL_TOKENS)

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out / "tokenizer.json"))
    special_map = {
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "additional_special_tokens": [IM_START, IM_END],
    }
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **special_map,
        # No unknown token (every byte has one); explicit, or Qwen2Tokenizer adds <|endoftext|>.
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 2048,
        "chat_template": CHAT_TEMPLATE,
    }
    _write_json(out / "tokenizer_config.json", tokenizer_config)
    _write_json(out / "special_tokens_map.json", special_map)


# rope_theta of each family's current release: Llama 3, Mistral v0.2+, Qwen2/2.5.
_ROPE_THETA = {"llama": 500000.0, "mistral": 1000000.0, "qwen2": 1000000.0}


def build_checkpoint(
    out_dir: str,
    arch: str = "llama",
    *,
    tie_word_embeddings: bool = False,
    seed: int = 0,
    shard: bool = False,
    **config_overrides: Any,
) -> str:
    """Write a tiny random-weight HF checkpoint of `arch` ("llama", "mistral" or "qwen2") with the
    tokenizer into out_dir and return out_dir.

    hidden 64, intermediate 128, 2 layers, 4 heads, 2 KV heads, vocab = tokenizer length, 2048
    positions, float32; `config_overrides` replace any config field (e.g. `num_attention_heads=8`,
    `rope_scaling={"rope_type": "llama3", ...}`). `shard=True` splits the weights over several
    safetensors files with an index. The directory appears atomically (built next to it, then
    renamed); out_dir must not exist or be empty, else FileExistsError.
    """
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} exists and is not empty")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    try:
        _write_checkpoint(tmp, arch, tie_word_embeddings, seed, shard, config_overrides)
        tmp.chmod(0o755)  # mkdtemp makes it private; a checkpoint is shared like any other directory
        try:
            os.rename(tmp, out)  # atomic; replaces out only if it is an empty directory
        except OSError as e:
            if e.errno in (errno.ENOTEMPTY, errno.EEXIST):
                raise FileExistsError(f"{out} was created by someone else meanwhile") from e
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(out)


# Model init draws from torch's global generator; builds in several threads would interleave draws.
build_lock = threading.Lock()


def _write_checkpoint(
    out: Path, arch: str, tie: bool, seed: int, shard: bool, overrides: dict[str, Any]
) -> None:
    import torch
    from transformers import (
        GenerationConfig,
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        PreTrainedTokenizerFast,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    families = {
        "llama": (LlamaConfig, LlamaForCausalLM),
        "mistral": (MistralConfig, MistralForCausalLM),
        "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    }
    if arch not in families:
        raise ValueError(f"unknown arch {arch!r}; expected one of {sorted(families)}")
    config_cls, model_cls = families[arch]

    build_tokenizer(str(out), qwen2_style=arch == "qwen2")
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(out))
    bos_id, eos_id, pad_id = tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id
    im_end_id = tokenizer.convert_tokens_to_ids(IM_END)

    fields: dict[str, Any] = dict(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        rope_theta=_ROPE_THETA[arch],
        rope_scaling=None,
        rms_norm_eps=1e-6,
        # 10x the usual 0.02: random logits then spread over a few units (greedy picks are not
        # near-ties) and tied models do not just echo their last input token.
        initializer_range=0.2,
        tie_word_embeddings=tie,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
    )
    if arch == "mistral":
        fields["sliding_window"] = None  # as in Mistral v0.2+: full attention
    fields.update(overrides)
    fields.setdefault("head_dim", fields["hidden_size"] // fields["num_attention_heads"])
    # Every transformers version takes the legacy rope keys (v5 turns them into `rope_parameters`,
    # editing the dicts it is given: hence the copy, which keeps fields and the caller's dicts intact).
    config = config_cls(**copy.deepcopy(fields))

    with build_lock, torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_cls(config).to(torch.float32).eval()
    # About 800 KB of float32 weights: 200 KB shards make four files.
    model.save_pretrained(str(out), **({"max_shard_size": "200KB"} if shard else {}))

    # transformers 5 saves only `rope_parameters`; add the legacy keys that most checkpoints on the
    # Hub carry, so a loader (or an older transformers) reading either form sees the same rope.
    config_path = out / "config.json"
    saved = json.loads(config_path.read_text())
    saved["rope_theta"] = fields["rope_theta"]
    saved["rope_scaling"] = fields["rope_scaling"]
    _write_json(config_path, saved)

    GenerationConfig(
        bos_token_id=bos_id,
        # Chat turns end with <|im_end|>, plain text with <|end_of_text|>: both stop generation.
        eos_token_id=[eos_id, im_end_id],
        pad_token_id=pad_id,
    ).save_pretrained(str(out))


def tiny_model_path() -> str:
    """The tiny random Llama (seed 0, untied) built once into `$RADIXLM_CACHE` (else
    `~/.cache/radixlm`) / default-tiny-llama-v1 and reused afterwards: one checkpoint that test modules
    and their shared servers reuse. Processes racing to build it are safe: the directory appears by
    one atomic rename."""
    path = cache_dir() / TINY_MODEL_NAME
    if not path.exists():
        try:
            build_checkpoint(str(path), "llama", seed=0)
        except FileExistsError:
            pass  # another process won the race; its checkpoint is complete (it appeared by rename)
    return str(path)


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
