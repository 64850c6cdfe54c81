"""The reference target's pretraining data: GSM8K rows as chats, tokenized examples and their batches.

Chat format (one GSM8K training row -> one conversation):
  user      = dflash_jax.prompts.format_gsm8k(row)  (question + "Please reason step by step, ...")
  assistant = the worked solution with the <<...>> calculator annotations removed and the final
              "#### N" turned into "The answer is \\boxed{N}."
The loss covers the assistant tokens (and its closing <|im_end|>) only. Batches are deterministic in
(seed, epoch), so a resumed run rebuilds the same stream.
"""
from __future__ import annotations

import dataclasses
import os
import re

import numpy as np

_CALC = re.compile(r"<<[^<>]*>>")
_FINAL = re.compile(r"\n?####\s*(.+?)\s*$", re.S)


# ----------------------------------------------------------------------------------------------
# GSM8K -> chat
# ----------------------------------------------------------------------------------------------
def clean_solution(answer: str) -> str:
    """GSM8K worked solution -> assistant text: calculator annotations dropped, '#### N' -> boxed."""
    text = _CALC.sub("", answer)
    m = _FINAL.search(text)
    if m is None:
        raise ValueError(f"GSM8K answer has no final '#### N' line: {answer[-80:]!r}")
    final = m.group(1).strip().replace(",", "")
    body = text[:m.start()].rstrip()
    return (body + "\n" if body else "") + f"The answer is \\boxed{{{final}}}."


def gsm8k_chat(row: dict) -> list[dict]:
    from .prompts import format_gsm8k
    return [{"role": "user", "content": format_gsm8k(row)[0]},
            {"role": "assistant", "content": clean_solution(str(row["answer"]))}]


def read_jsonl(path: str) -> list[dict]:
    from .prompts import read_records
    if not os.path.exists(path):
        raise FileNotFoundError(f"data file {path} does not exist")
    return read_records(path)


def encode_example(tok, row: dict) -> tuple[list[int], int]:
    """(token ids, prompt length): the prompt exactly as inference encodes it (chat template with the
    generation prompt), then the assistant text and <|im_end|>."""
    from .text import encode_chat, encode_text
    user, asst = gsm8k_chat(row)
    prompt = encode_chat(tok, [user])
    resp = encode_text(tok, asst["content"]) + [int(tok.convert_tokens_to_ids("<|im_end|>"))]
    return prompt + resp, len(prompt)


# ----------------------------------------------------------------------------------------------
# Batches (deterministic in (seed, epoch): resuming rebuilds the same stream)
# ----------------------------------------------------------------------------------------------
@dataclasses.dataclass
class LMExamples:
    seqs: list  # list of int32 arrays
    prompt_lens: np.ndarray

    def __len__(self):
        return len(self.seqs)


def tokenize_rows(tok, rows, max_length: int) -> tuple[LMExamples, int]:
    seqs, plens, dropped = [], [], 0
    for r in rows:
        ids, pl = encode_example(tok, r)
        if len(ids) > max_length:
            dropped += 1
            continue
        seqs.append(np.asarray(ids, np.int32))
        plens.append(pl)
    return LMExamples(seqs, np.asarray(plens, np.int32)), dropped


def lm_batch(ex: LMExamples, idx, T: int) -> dict:
    R = len(idx)
    tokens = np.zeros((R, T), np.int32)
    mask = np.zeros((R, T), np.int32)
    for r, i in enumerate(idx):
        if i < 0:
            continue
        s = ex.seqs[i]
        tokens[r, :len(s)] = s
        mask[r, int(ex.prompt_lens[i]) - 1:len(s) - 1] = 1  # position t predicts token t+1 (response)
    return {"tokens": tokens, "loss_mask": mask}


class LMSchedule:
    """Per epoch: shuffle, sort windows of 8 micro-batches by length (less padding), cut into
    micro-batches padded to a length bucket, shuffle the steps."""

    def __init__(self, ex: LMExamples, batch_size: int, accum: int, buckets, seed: int):
        self.ex, self.bs, self.accum, self.seed = ex, batch_size, accum, seed
        self.buckets = sorted(buckets)
        self.per_step = batch_size * accum
        self.steps_per_epoch = max(1, len(ex) // self.per_step)
        self._cache: dict = {}

    def bucket(self, n: int) -> int:
        for b in self.buckets:
            if b >= n:
                return b
        raise ValueError(f"sequence of {n} tokens exceeds the largest bucket {self.buckets[-1]}")

    def _epoch(self, e: int):
        if e not in self._cache:
            rng = np.random.default_rng([self.seed, e])
            perm = rng.permutation(len(self.ex))[:self.steps_per_epoch * self.per_step]
            lens = np.array([len(self.ex.seqs[i]) for i in perm])
            win = self.per_step * 8
            for w in range(0, len(perm), win):
                o = np.argsort(lens[w:w + win], kind="stable")
                perm[w:w + win] = perm[w:w + win][o]
            steps = perm.reshape(self.steps_per_epoch, self.per_step)
            steps = steps[rng.permutation(self.steps_per_epoch)]
            self._cache = {e: steps}
        return self._cache[e]

    def batch(self, step: int) -> dict:
        e, j = divmod(step, self.steps_per_epoch)
        idx = self._epoch(e)[j]
        T = self.bucket(max(len(self.ex.seqs[i]) for i in idx))
        parts = [lm_batch(self.ex, idx[a * self.bs:(a + 1) * self.bs], T) for a in range(self.accum)]
        return {k: np.stack([p[k] for p in parts]) for k in parts[0]}

    def epoch_of(self, step: int) -> int:
        return step // self.steps_per_epoch


def lm_eval_batches(ex: LMExamples, bs: int, buckets) -> list[dict]:
    """Held-out examples in length order, cut into batches of `bs` rows (the last padded with empty rows)."""
    order = np.argsort([len(s) for s in ex.seqs], kind="stable")
    out = []
    sched = LMSchedule(ex, bs, 1, buckets, 0)
    for k in range(0, len(order), bs):
        idx = list(order[k:k + bs])
        idx += [-1] * (bs - len(idx))
        T = sched.bucket(max(len(ex.seqs[i]) for i in idx if i >= 0))
        out.append(lm_batch(ex, idx, T))
    return out

