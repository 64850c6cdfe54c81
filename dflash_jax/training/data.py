"""Self-distillation data: prompts -> target-generated responses, in restartable shards.

Layout of `data.output_dir` (a local directory or a URL such as gs://bucket/dir, see fs.py):
  manifest.json          settings that determine the data (a rerun with different ones is refused)
  shard_000000.npy       int32 tokens of `generation.shard_size` sequences (in the order they finished),
                         concatenated; with several processes each writes shard_pKKK_NNNNNN files
  shard_000000.json      its index: prompt ids, prompt lengths, sequence lengths, finished flags,
                         and every prompt id the shard accounts for (generated or skipped)
  progress.json          summary (prompts done / total, sequences, tokens, complete)

A shard is committed by its .json (written whole, after its .npy), so a killed job
leaves either a whole shard or an orphan .npy that the next run overwrites. Restarting computes the
prompt ids not yet accounted for by committed shards and generates only those: no duplicates, no
loss. Sampling keys depend on (seed, prompt id, position), so resumed data equals uninterrupted data.
"""
from __future__ import annotations

import dataclasses
import os
import time

import numpy as np

from . import fs
from .config import TrainConfig
from .records import DataError, PromptEncoder, load_prompt_records
from .schema import fingerprint


# ----------------------------------------------------------------------------------------------
# Shards
# ----------------------------------------------------------------------------------------------
def data_settings(cfg: TrainConfig) -> dict:
    """Everything that determines the generated data (max_prompts, batch size, shard size and refill
    excluded: more prompts can be added later, and slots/chunking do not change results)."""
    d = cfg.data
    g = dataclasses.asdict(d.generation)
    for k in ("batch_size", "shard_size", "refill"):
        g.pop(k)
    return {
        "target": cfg.target.path, "tokenizer": cfg.tokenizer_path, "prompts": d.prompts, "split": d.split,
        "subset": d.subset, "field": d.field, "prompt_format": d.prompt_format, "system_prompt": d.system_prompt,
        "chat_template_kwargs": d.chat_template_kwargs, "max_length": d.max_length,
        "min_response_tokens": d.min_response_tokens, "generation": g,
    }


def committed_shards(out_dir: str) -> list[str]:
    """Base paths (without extension) of committed shards, in order."""
    return sorted(p[:-5] for p in fs.glob(fs.join(out_dir, "shard_*.json")))


def read_progress(out_dir: str) -> dict | None:
    p = fs.join(out_dir, "progress.json")
    return fs.read_json(p) if fs.exists(p) else None


def interrupted_progress(out_dir: str) -> tuple[int, int] | None:
    """(prompts done, total) of an unfinished generation in out_dir, counted from the committed shards (the
    source of truth: progress.json is rewritten just after each shard and may trail it by one); None when
    out_dir has no progress.json or says it is complete."""
    prog = read_progress(out_dir)
    if not prog or prog.get("complete"):
        return None
    total = int(prog["total"])
    return len(_covered_ids(out_dir)[0] & set(range(total))), total


def data_is_complete(cfg: TrainConfig) -> bool:
    """True when progress.json says every prompt (for the current max_prompts) is accounted for and the
    manifest matches the current settings."""
    prog = read_progress(cfg.data.output_dir)
    man = fs.join(cfg.data.output_dir, "manifest.json")
    if not prog or not prog.get("complete") or not fs.exists(man):
        return False
    if prog.get("max_prompts") != cfg.data.max_prompts:
        return False
    return fs.read_json(man).get("fingerprint") == fingerprint(data_settings(cfg))


def _check_manifest(cfg: TrainConfig, write: bool = True) -> None:
    out = cfg.data.output_dir
    settings = data_settings(cfg)
    path = fs.join(out, "manifest.json")
    if fs.exists(path):
        old = fs.read_json(path)
        if old.get("fingerprint") != fingerprint(settings):
            prev = old.get("settings", {})
            diff = sorted(k for k in set(prev) | set(settings) if prev.get(k) != settings.get(k))
            raise DataError(f"data.output_dir {out} holds data generated with different settings "
                            f"(differs in: {', '.join(diff)}); use another output_dir or delete it")
    else:
        if committed_shards(out):
            raise DataError(f"data.output_dir {out} has shards but no manifest.json; use another output_dir")
        if write:
            fs.write_json(path, {"version": 1, "fingerprint": fingerprint(settings), "settings": settings})


def _covered_ids(out_dir: str) -> tuple[set[int], int, int]:
    covered: set[int] = set()
    n_seq = n_tok = 0
    for base in committed_shards(out_dir):
        meta = fs.read_json(base + ".json")
        ids = set(meta["covered"])
        dup = covered & ids
        if dup:
            raise DataError(f"shard {base}.json repeats prompt ids {sorted(dup)[:5]} already in another shard")
        covered |= ids
        n_seq += len(meta["ids"])
        n_tok += int(sum(meta["lengths"]))
    return covered, n_seq, n_tok


def _barrier(name: str) -> None:
    import jax
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils
        multihost_utils.sync_global_devices(name)


def generation_engine_shape(cfg: TrainConfig) -> dict:
    """The fixed shapes of data generation (one compilation per run): prompt tokens, new tokens, cache."""
    from ..decode.state import CACHE_ALIGN, round_up
    d, g = cfg.data, cfg.data.generation
    prompt_len = d.max_length - d.min_response_tokens  # longer prompts are skipped
    max_new = min(g.max_new_tokens, d.max_length - 1)
    return {"prompt_len": prompt_len, "max_new_tokens": max_new, "cache_len": round_up(d.max_length + 1, CACHE_ALIGN)}


def generate_data(cfg: TrainConfig, target=None, tokenizer=None, progress: bool = True, log=print,
                  refill: bool = True) -> dict:
    """Generate (or finish generating) the training data of `cfg`. Returns progress.json's content.

    Continuous batching (dflash_jax.engine): `generation.batch_size` slots decode at once, a finished
    row's slot is refilled with the next prompt (prompts sorted by length, longest first); shapes are
    fixed per config, so a run compiles one prefill and one decode program. `refill=False` (for
    benchmarks) waits until every slot is free before prefilling the next prompts (a static batch).
    With several processes (jax.distributed), process k generates the prompts with index % n == k on
    its local devices and writes its own shards; output_dir must then be shared (e.g. gs://)."""
    import jax

    from ..engine import Engine, Request
    from ..weights import load_target
    from ..text import stop_token_ids as default_stops

    d, g = cfg.data, cfg.data.generation
    out = d.output_dir
    proc, nproc = jax.process_index(), jax.process_count()
    fs.makedirs(out)
    _check_manifest(cfg, write=proc == 0)
    _barrier("dflash_data_manifest")
    if proc:
        _check_manifest(cfg, write=False)
    records = load_prompt_records(d)
    total = len(records)
    covered, n_seq, n_tok = _covered_ids(out)
    todo = [i for i in range(total) if i not in covered and i % nproc == proc]
    base_prog = {"total": total, "max_prompts": d.max_prompts}

    def progress_of(cov, sequences, tokens, complete=None, **extra) -> dict:  # (`progress`: the bar flag)
        done = len(cov & set(range(total)))
        return dict(base_prog, done=done, sequences=sequences, tokens=tokens,
                    complete=done == total if complete is None else complete, **extra)

    def write_progress(prog: dict) -> None:
        fs.write_json(fs.join(out, "progress.json"), prog)

    def finish() -> dict:
        _barrier("dflash_data_done")
        prog = progress_of(*_covered_ids(out))
        if proc == 0:
            write_progress(prog)
        return prog

    if not todo:
        return finish()
    if proc == 0:  # an interruption from here on reports how far it got (cli._where)
        write_progress(progress_of(covered, n_seq, n_tok, complete=False))
    enc = PromptEncoder(cfg, tokenizer)
    if target is None:
        target = load_target(cfg.target.path, dtype=cfg.target.dtype, quant=cfg.target.quant,
                             kv_quant=cfg.target.kv_quant)
    stops = g.stop_token_ids
    if stops is None:
        stops = default_stops(enc.tok, target.config, cfg.target.path if os.path.isdir(cfg.target.path) else None)
    if not stops:
        log("warning: no stop token ids (tokenizer/config have no eos); every response runs to max_new_tokens")
    stops = tuple(int(x) for x in stops)
    mesh = None
    local = jax.local_devices()
    if len(local) > 1:
        from ..sharding import make_mesh
        model = cfg.mesh.model
        mesh = make_mesh(len(local) // model, model, devices=local)
    shape = generation_engine_shape(cfg)
    dp = 1 if mesh is None else mesh.shape["data"]
    slots = -(-g.batch_size // dp) * dp
    per_shard = slots // dp
    refill_rows = min(g.refill or max(1, per_shard // 4), per_shard) if refill else per_shard
    engine = Engine(target, None, slots=slots, refill=refill_rows, temperature=g.temperature, top_k=g.top_k,
                    top_p=g.top_p, seed=g.seed, max_stop_ids=max(1, len(stops)), mesh=mesh, **shape)
    # encode, skip the too long, sort by length (longest first: the long tail starts early)
    todo_reqs, skipped = [], []
    for i in todo:
        p = enc.encode(records[i])
        if not p:
            raise DataError(f"prompt {i} encodes to zero tokens")
        if max(p) >= target.config.vocab_size or min(p) < 0:
            raise DataError(f"prompt {i} has token ids outside the target vocabulary [0, {target.config.vocab_size})")
        if len(p) > d.max_length - d.min_response_tokens:
            skipped.append(i)
            continue
        todo_reqs.append(Request(p, i, min(shape["max_new_tokens"], d.max_length - len(p)), stops))
    todo_reqs.sort(key=lambda r: (-len(r.prompt), r.row_id))
    delay = float(os.environ.get("DFLASH_GEN_CHUNK_DELAY", "0") or 0)  # test hook: slow down between shards
    prefix = f"shard_p{proc:03d}_" if nproc > 1 else "shard_"
    next_index = len(fs.glob(fs.join(out, prefix + "[0-9]*.json")))
    shard_size = g.shard_size or g.batch_size
    bar = _bar(len(todo), "generate", progress)
    t_start = time.time()
    pending: list = []
    done_ids: list = []
    stop_set = set(stops)

    def write_shard(items, skip):
        nonlocal next_index
        items = sorted(items, key=lambda x: x[0])
        seqs = [s for _, s, _, _ in items]
        base = fs.join(out, f"{prefix}{next_index:06d}")
        flat = np.concatenate([np.asarray(s, np.int32) for s in seqs]) if seqs else np.zeros((0,), np.int32)
        fs.write_npy(base + ".npy", flat)  # the .json index written after it commits the shard
        fs.write_json(base + ".json", {
            "ids": [i for i, _, _, _ in items], "prompt_lens": [pl for _, _, pl, _ in items],
            "lengths": [len(s) for s in seqs], "finished": [f for _, _, _, f in items], "skipped": sorted(skip),
            "covered": sorted([i for i, _, _, _ in items] + list(skip))})
        next_index += 1
        done_ids.extend([i for i, _, _, _ in items] + list(skip))
        if nproc == 1:
            write_progress(progress_of(covered | set(done_ids), n_seq + len(seqs), n_tok + int(flat.size),
                                       complete=False, elapsed_s=round(time.time() - t_start, 3)))
        if bar is not None:
            bar.update(len(items) + len(skip))
        elif proc == 0:  # no progress bar: a line per shard instead of silence
            done = len((covered | set(done_ids)) & set(range(total))) if nproc == 1 else len(done_ids)
            log(f"generate: {done}/{total} prompts, {n_seq + len(seqs)} sequences, {n_tok + int(flat.size)} tokens "
                f"({time.time() - t_start:.0f}s)")
        if delay:
            time.sleep(delay)
        return len(seqs), int(flat.size)

    reqs_by_id = {r.row_id: r for r in todo_reqs}
    for c in engine.run(todo_reqs):
        p = reqs_by_id[c.row_id].prompt
        s = (p + c.tokens)[:d.max_length]
        fin = bool(c.tokens) and c.tokens[-1] in stop_set and len(p) + len(c.tokens) <= d.max_length
        pending.append((c.row_id, s, len(p), fin))
        if len(pending) >= shard_size:
            a, b = write_shard(pending, skipped)
            n_seq, n_tok, pending, skipped = n_seq + a, n_tok + b, [], []
    if pending or skipped:
        a, b = write_shard(pending, skipped)
        n_seq, n_tok = n_seq + a, n_tok + b
    if bar is not None:
        bar.close()
    st = engine.stats
    log(f"data generation: {sum(engine.compilations.values())} compilations ({engine.compilations}), "
        f"{st.tokens} tokens in {st.prefill_time + st.decode_time:.2f} s = {st.tokens_per_second:.1f} tokens/s "
        f"(compile {st.compile_time:.1f} s; {slots} slots, refill {refill_rows}, {st.prefill_calls} prefills, "
        f"{st.decode_calls} decode calls)")
    prog = finish()
    prog.update(elapsed_s=round(time.time() - t_start, 3), compilations=dict(engine.compilations),
                tokens_per_s=st.tokens_per_second)
    return prog


def _bar(total, desc, enabled):
    if not enabled:
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc=desc, unit="prompt", dynamic_ncols=True)


# ----------------------------------------------------------------------------------------------
# Reading generated data
# ----------------------------------------------------------------------------------------------
@dataclasses.dataclass
class SequenceData:
    """All generated sequences: tokens concatenated, with per-sequence offsets and prompt lengths."""
    tokens: np.ndarray  # int32 [total]
    offsets: np.ndarray  # int64 [N + 1]
    prompt_lens: np.ndarray  # int32 [N]
    ids: np.ndarray  # int64 [N] prompt index of each sequence

    def __len__(self) -> int:
        return len(self.prompt_lens)

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets).astype(np.int32)

    def seq(self, i: int) -> np.ndarray:
        return self.tokens[self.offsets[i]:self.offsets[i + 1]]

    def subset(self, idx) -> "SequenceData":
        idx = np.asarray(idx, np.int64)
        parts = [self.seq(i) for i in idx]
        lens = np.array([len(p) for p in parts], np.int64)
        offs = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
        toks = np.concatenate(parts).astype(np.int32) if parts else np.zeros((0,), np.int32)
        return SequenceData(toks, offs, self.prompt_lens[idx], self.ids[idx])

    @classmethod
    def from_lists(cls, seqs, prompt_lens, ids=None) -> "SequenceData":
        lens = np.array([len(s) for s in seqs], np.int64)
        offs = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
        toks = np.concatenate([np.asarray(s, np.int32) for s in seqs]) if seqs else np.zeros((0,), np.int32)
        ids = np.arange(len(seqs)) if ids is None else np.asarray(ids)
        return cls(toks, offs, np.asarray(prompt_lens, np.int32), ids.astype(np.int64))


def load_sequences(out_dir: str, vocab_size: int | None = None) -> SequenceData:
    """Read every committed shard of `out_dir` (sorted by prompt id)."""
    if not fs.isdir(out_dir):
        raise DataError(f"training data directory {out_dir} does not exist (run train.generate_data first)")
    bases = committed_shards(out_dir)
    if not bases:
        raise DataError(f"no data shards (shard_*.json) in {out_dir}")
    toks, lens, plens, ids = [], [], [], []
    for base in bases:
        meta = fs.read_json(base + ".json")
        if not fs.exists(base + ".npy"):
            raise DataError(f"shard {base}.json has no {os.path.basename(base)}.npy beside it")
        arr = fs.read_npy(base + ".npy")
        if arr.shape[0] != sum(meta["lengths"]):
            raise DataError(f"shard {base}: {arr.shape[0]} tokens but its index lists {sum(meta['lengths'])}")
        toks.append(np.asarray(arr, np.int32))
        lens += meta["lengths"]
        plens += meta["prompt_lens"]
        ids += meta["ids"]
    if not lens:
        raise DataError(f"the shards in {out_dir} hold no sequences (every prompt was skipped?)")
    flat = np.concatenate(toks)
    lens_a = np.asarray(lens, np.int64)
    offs = np.concatenate([[0], np.cumsum(lens_a)])
    data = SequenceData(flat, offs, np.asarray(plens, np.int32), np.asarray(ids, np.int64))
    if len(set(ids)) != len(ids):
        raise DataError(f"duplicate prompt ids across the shards of {out_dir}")
    if vocab_size is not None and flat.size and (flat.max() >= vocab_size or flat.min() < 0):
        raise DataError(f"data in {out_dir} has token ids outside the target vocabulary [0, {vocab_size}) - "
                        f"was it generated with another target?")
    order = np.argsort(data.ids, kind="stable")
    return data.subset(order) if not np.all(order == np.arange(len(order))) else data


def split_train_eval(data: SequenceData, num_eval: int) -> tuple[SequenceData, SequenceData | None]:
    """Sequences usable for training (a response of >= 2 tokens); the last `num_eval` of them held out."""
    resp = data.lengths - data.prompt_lens
    usable = np.nonzero(resp >= 2)[0]
    if len(usable) == 0:
        raise DataError("no sequence has a response of at least 2 tokens (an anchor plus one label)")
    n_eval = min(num_eval, len(usable) // 2) if num_eval else 0
    train_idx = usable[:len(usable) - n_eval]
    eval_idx = usable[len(usable) - n_eval:]
    return data.subset(train_idx), (data.subset(eval_idx) if n_eval else None)
