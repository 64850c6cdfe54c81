"""Tokenizers and chat formatting for the command-line tools (no torch needed).

- `load_tokenizer(dir)`: a `transformers` fast tokenizer from a local model directory.
- `render_chat` / `encode_chat`: a chat (list of {"role", "content"}) -> prompt text / token ids, through
  the tokenizer's chat template, or as raw text when templates are disabled or missing.
- `stop_token_ids`: the tokenizer's eos plus the target's eos ids (config.json / generation_config.json).
- `build_demo_tokenizer`: a small byte-level BPE with a ChatML-style template, for demos and tests.
"""
from __future__ import annotations

import json
import os
import warnings
from typing import Iterable, Sequence

# Special tokens of the demo tokenizer (ChatML-like, as Qwen uses).
DEMO_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>")
DEMO_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_FALLBACK_CORPUS = [
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May.",
    "How many clips did Natalia sell altogether in April and May?",
    "Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of babysitting.",
    "Please reason step by step, and put your final answer within \\boxed{}.",
    "Write a Python function that returns the sum of the squares of a list of integers.",
    "def add(a, b):\n    return a + b\n",
    "assert add(2, 3) == 5",
    "Compose an engaging travel blog post about a recent trip to Hawaii.",
    "The quick brown fox jumps over the lazy dog. 0123456789 + - * / = ( ) [ ] { } < > # $ % & ! ? : ; , .",
]


# transformers prints an advisory at import when torch is absent (tokenizers need no torch): keep it quiet
# unless the user chose a verbosity.
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


class ChatTemplateError(ValueError):
    """The tokenizer has no chat template and raw text was not allowed."""


def load_tokenizer(path: str):
    """A `transformers` tokenizer from a local directory (tokenizer.json / tokenizer_config.json)."""
    if not os.path.isdir(path):
        raise FileNotFoundError(f"tokenizer directory {path} does not exist")
    has_files = any(os.path.exists(os.path.join(path, f)) for f in
                    ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json"))
    if not has_files:
        raise FileNotFoundError(
            f"no tokenizer files (tokenizer.json / tokenizer_config.json) in {path}; "
            f"pass --tokenizer DIR pointing at the target model's tokenizer")
    from transformers import AutoTokenizer
    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception as e:  # noqa: BLE001 - re-raise with the path named
        raise ValueError(f"could not load the tokenizer in {path}: {type(e).__name__}: {e}") from e


def has_chat_template(tok) -> bool:
    return bool(getattr(tok, "chat_template", None))


def _normalise_messages(messages) -> list[dict]:
    if isinstance(messages, str):
        return [{"role": "user", "content": messages}]
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise ValueError(f"chat message {i} must be an object with 'role' and 'content', got {m!r}")
        if not isinstance(m["content"], str):
            raise ValueError(f"chat message {i}: 'content' must be a string")
        out.append({"role": str(m["role"]), "content": m["content"]})
    if not out:
        raise ValueError("empty chat (no messages)")
    return out


def raw_text(messages) -> str:
    """Raw-text rendering of a chat: the message contents joined by blank lines."""
    return "\n\n".join(m["content"] for m in _normalise_messages(messages))


def render_chat(tok, messages, use_chat_template: bool = True, strict: bool = False,
                enable_thinking: bool | None = None) -> str:
    """Prompt text for a chat ending with a user turn (generation prompt appended).

    Without a chat template on the tokenizer: raise `ChatTemplateError` when `strict`, else warn and
    fall back to the raw text."""
    msgs = _normalise_messages(messages)
    if not use_chat_template:
        return raw_text(msgs)
    if not has_chat_template(tok):
        msg = ("the tokenizer has no chat_template; use --no-chat-template to send the raw prompt text")
        if strict:
            raise ChatTemplateError(msg)
        warnings.warn(msg + " (falling back to raw text)", stacklevel=2)
        return raw_text(msgs)
    kw = {} if enable_thinking is None else {"enable_thinking": bool(enable_thinking)}
    return tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True, **kw)


def encode_text(tok, text: str, add_special_tokens: bool = False) -> list[int]:
    ids = tok(text, add_special_tokens=add_special_tokens)["input_ids"]
    return [int(i) for i in ids]


def encode_chat(tok, messages, use_chat_template: bool = True, strict: bool = False,
                enable_thinking: bool | None = None) -> list[int]:
    """Token ids of the prompt. A chat template already carries its special tokens; raw text gets the
    tokenizer's own BOS handling."""
    text = render_chat(tok, messages, use_chat_template, strict, enable_thinking)
    templated = use_chat_template and has_chat_template(tok)
    ids = encode_text(tok, text, add_special_tokens=not templated)
    if not ids:
        raise ValueError("the prompt encodes to zero tokens")
    return ids


def _as_id_list(v) -> list[int]:
    if v is None:
        return []
    if isinstance(v, int):
        return [v]
    return [int(x) for x in v]


def stop_token_ids(tok=None, target_config=None, model_dir: str | None = None) -> list[int]:
    """Union of the tokenizer's eos id, the target config's eos ids and generation_config.json's."""
    ids: list[int] = []
    if tok is not None:
        ids += _as_id_list(getattr(tok, "eos_token_id", None))
    if target_config is not None:
        ids += list(target_config.eos_token_ids)
    if model_dir:
        gp = os.path.join(model_dir, "generation_config.json")
        if os.path.exists(gp):
            try:
                with open(gp) as f:
                    ids += _as_id_list(json.load(f).get("eos_token_id"))
            except (OSError, ValueError):
                pass
    seen, out = set(), []
    for i in ids:
        if i not in seen and i >= 0:
            seen.add(i)
            out.append(i)
    return out


def decode(tok, ids: Sequence[int], stop_ids: Iterable[int] = ()) -> str:
    """Text of generated ids, cut before the first stop token."""
    stop = set(stop_ids)
    cut = list(ids)
    for k, t in enumerate(cut):
        if t in stop:
            cut = cut[:k]
            break
    return tok.decode(cut, skip_special_tokens=True)


# ----------------------------------------------------------------------------------------------
# Demo / test tokenizer
# ----------------------------------------------------------------------------------------------
def demo_corpus(data_dir: str | None = None, n: int = 400) -> list[str]:
    """Up to `n` GSM8K training questions (when the data set is available) plus a few fixed lines."""
    texts = list(_FALLBACK_CORPUS)
    if data_dir:
        p = os.path.join(data_dir, "gsm8k", "train.jsonl")
        if os.path.exists(p):
            with open(p) as f:
                for k, line in enumerate(f):
                    if k >= n:
                        break
                    row = json.loads(line)
                    texts.append(row.get("question", ""))
                    texts.append(row.get("answer", ""))
    return texts


def build_demo_tokenizer(out_dir: str, texts: Sequence[str] | None = None, vocab_size: int = 1024,
                         split_digits: bool = False):
    """Train a small byte-level BPE (any text encodes, no unknowns), save it with a ChatML-style
    chat template and eos `<|im_end|>` so `AutoTokenizer.from_pretrained(out_dir)` loads it.

    Special token ids come first: <|endoftext|>=0, <|im_start|>=1, <|im_end|>=2, <|mask|>=3
    (the mask token serves as the drafter's mask_token_id). `split_digits`: every digit is its own
    pre-token (numbers are never merged), which helps small models with arithmetic.
    Returns the loaded tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    texts = list(texts) if texts else list(_FALLBACK_CORPUS)
    tk = Tokenizer(models.BPE())
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.pre_tokenizer = (pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
                        if split_digits else byte_level)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(DEMO_SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tk.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   additional_special_tokens=["<|im_start|>", "<|mask|>"], model_max_length=8192)
    fast.chat_template = DEMO_CHAT_TEMPLATE
    os.makedirs(out_dir, exist_ok=True)
    fast.save_pretrained(out_dir)
    # Portable config: the class name and inline template that both transformers 4.x and 5.x read.
    cfg_path = os.path.join(out_dir, "tokenizer_config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg.update(tokenizer_class="PreTrainedTokenizerFast", chat_template=DEMO_CHAT_TEMPLATE,
               eos_token="<|im_end|>", pad_token="<|endoftext|>", bos_token=None)
    with open(cfg_path, "w") as f:
        json.dump(cfg, f, indent=2)
    return load_tokenizer(out_dir)
