"""The embedded reference pair: a small Qwen3-architecture target pretrained from scratch on GSM8K
chats, and its DFlash drafter - both made by this project's own training code.

    python -m train.reference [--workdir runs/reference] [--stages ...] [section.key=value ...]

runs tokenizer -> pretrain -> export_target -> generate -> train_drafter -> export_drafter -> ship,
each stage skipped when its output exists (pretraining and drafter training resume from their orbax
checkpoints). `pretrain(cfg)` is the small-LM pretraining driver: the generic `Trainer` with
`LMObjective`, `make_optimizer` and the orbax `Checkpointer`; its config (configs/reference_target.yaml)
uses the same typed-config machinery as drafter training (dataclass tree, unknown keys rejected,
dotted overrides).

Modules: reference_config (the pretraining config), reference_data (GSM8K -> chat, tokenized examples,
batches), this one (tokenizer, pretraining driver, HF export, the whole build and `ship`).
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time

import numpy as np

from .reference_config import PretrainConfig, load_pretrain_config
from .reference_data import LMSchedule, clean_solution, gsm8k_chat, lm_eval_batches, read_jsonl, tokenize_rows
from .training.schema import ConfigError

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
ASSETS = os.path.join(HERE, "assets", "reference")


# ----------------------------------------------------------------------------------------------
# Tokenizer
# ----------------------------------------------------------------------------------------------
def build_tokenizer(cfg: PretrainConfig, log=print):
    """Byte-level BPE (tokenizers library) trained on the GSM8K chats, ChatML template, <|mask|>."""
    from .text import build_demo_tokenizer, load_tokenizer
    out = cfg.tokenizer.dir
    if os.path.exists(os.path.join(out, "tokenizer.json")):
        return load_tokenizer(out)
    rows = read_jsonl(cfg.data.train)
    texts = []
    for r in rows:
        u, a = gsm8k_chat(r)
        texts += [u["content"], a["content"]]
    tok = build_demo_tokenizer(out, texts, vocab_size=cfg.tokenizer.vocab_size,
                               split_digits=cfg.tokenizer.split_digits)
    log(f"tokenizer: {len(tok)} tokens -> {out}")
    return tok


def target_config_for(cfg: PretrainConfig, tok, dtype: str = "float32"):
    from .config import TargetConfig
    m = cfg.model
    vocab = -(-len(tok) // 64) * 64
    eos = (int(tok.convert_tokens_to_ids("<|im_end|>")), int(tok.convert_tokens_to_ids("<|endoftext|>")))
    return TargetConfig(family="qwen3", vocab_size=vocab, hidden_size=m.hidden_size,
                        intermediate_size=m.intermediate_size, num_layers=m.num_layers, num_heads=m.num_heads,
                        num_kv_heads=m.num_kv_heads, head_dim=m.head_dim, rope_theta=m.rope_theta,
                        tie_word_embeddings=m.tie_word_embeddings, qk_norm=True,
                        max_position_embeddings=m.max_position_embeddings, eos_token_ids=eos, dtype=dtype)


def count_params(params) -> int:
    import jax
    return int(sum(int(np.prod(a.shape)) for a in jax.tree_util.tree_leaves(params)))




def sample_generations(target, tok, rows, max_new_tokens: int) -> list[dict]:
    """Greedy target-only answers to held-out questions (a quality check of the pretrained model)."""
    from .decode.api import generate
    from .text import decode, encode_chat
    prompts = [encode_chat(tok, [gsm8k_chat(r)[0]]) for r in rows]
    stops = list(target.config.eos_token_ids)
    res = generate(target, None, prompts, max_new_tokens=max_new_tokens, temperature=0.0, stop_token_ids=stops)
    return [{"question": r["question"], "reference": clean_solution(r["answer"]),
             "generated": decode(tok, t, stops)} for r, t in zip(rows, res.tokens)]


def pretrain(cfg: PretrainConfig, log=print, progress: bool = True) -> dict:
    """Train the reference target from scratch (resuming from checkpoint.dir), then write it to
    output.dir in HF format (+ tokenizer files). Returns a summary dict."""
    import jax

    from .model import Target, init_target
    from .weights import save_target
    from .training.checkpoint import Checkpointer
    from .training.loss import LMObjective, cast_tree
    from .training.metrics_log import MetricsLogger, progress_bar
    from .training.optim import make_optimizer
    from .training.trainer import Trainer, add_sums, fetch_tree

    t0 = time.time()
    tok = build_tokenizer(cfg, log)
    t = cfg.train
    rows = read_jsonl(cfg.data.train)
    if cfg.data.max_rows:
        rows = rows[:cfg.data.max_rows]
    train_ex, dropped = tokenize_rows(tok, rows, cfg.data.max_length)
    eval_rows = read_jsonl(cfg.data.eval)[:cfg.data.eval_rows] if cfg.data.eval else []
    eval_ex, _ = tokenize_rows(tok, eval_rows, cfg.data.max_length)
    n_tok = int(sum(len(s) for s in train_ex.seqs))
    n_resp = int(sum(len(s) - p for s, p in zip(train_ex.seqs, train_ex.prompt_lens)))
    log(f"pretraining data: {len(train_ex)} chats ({dropped} longer than {cfg.data.max_length} dropped), "
        f"{n_tok} tokens ({n_resp} response tokens); eval {len(eval_ex)} chats")

    tcfg_master = target_config_for(cfg, tok, t.param_dtype)
    tcfg = dataclasses.replace(tcfg_master, dtype=t.compute_dtype)
    params0 = init_target(tcfg_master, seed=cfg.model.seed, std=cfg.model.init_std).params
    n_params = count_params(params0)
    sched = LMSchedule(train_ex, t.batch_size, t.grad_accum, t.length_buckets, t.seed)
    n_steps = t.steps if t.steps is not None else t.epochs * sched.steps_per_epoch
    tx, lr_fn = make_optimizer(cfg.optimizer, n_steps)
    trainer = Trainer(LMObjective(tcfg), params0, {}, tx, schedule=lr_fn, param_dtype=t.param_dtype)
    state = trainer.init_state(t.seed)
    ck = cfg.checkpoint
    ckpt = Checkpointer(ck.dir, ck.keep_last, ck.async_save)
    traj = {k: cfg.to_dict()[k] for k in ("tokenizer", "model", "data", "train", "optimizer")}
    start = 0
    latest = ckpt.latest_step()
    if latest is not None:
        tree, meta = ckpt.restore(latest, trainer.abstract_state(state))
        if meta.get("trajectory") != json.loads(json.dumps(traj)):
            raise ConfigError(f"checkpoint.dir {ck.dir} was trained with different settings; use a new "
                              f"checkpoint.dir (or delete it)")
        state = trainer.place_state(tree)
        start = int(jax.device_get(state.step))
        log(f"resumed pretraining from {ckpt.directory} step {start}")
    os.makedirs(ck.dir, exist_ok=True)
    logger = MetricsLogger(os.path.join(ck.dir, "metrics.jsonl"), resume_step=start if latest is not None else None,
                           log=log)
    ev_batches = lm_eval_batches(eval_ex, t.batch_size, t.length_buckets) if len(eval_ex) else []

    def run_eval(step, params):
        if not ev_batches:
            return {}
        sums = None
        for b in ev_batches:
            sums = add_sums(sums, trainer.eval_step(params, b))
        m = trainer.objective.summarize(fetch_tree(sums))
        logger.write(step, "eval", m)
        return m

    log(f"target: {n_params / 1e6:.2f}M params ({tcfg.num_layers} layers, hidden {tcfg.hidden_size}, vocab "
        f"{tcfg.vocab_size}); {sched.steps_per_epoch} steps/epoch, {n_steps} steps, batch {t.batch_size} x "
        f"accum {t.grad_accum}")
    bar = progress_bar(n_steps, start, progress)
    sums, stat_acc, n_acc, t_log = None, None, 0, time.time()
    t_train = time.time()
    last = {}
    for step in range(start, n_steps):
        state, aux, stats = trainer.train_step(state, sched.batch(step))
        sums, stat_acc, n_acc = add_sums(sums, aux), add_sums(stat_acc, stats), n_acc + 1
        done = step + 1
        if done % cfg.log.every_steps == 0 or done == n_steps:
            m = trainer.objective.summarize(fetch_tree(sums))
            st = fetch_tree(stat_acc)
            m.update(grad_norm=float(st["grad_norm"]) / n_acc, lr=float(st["lr"]) / n_acc,
                     steps_per_s=n_acc / max(time.time() - t_log, 1e-9), epoch=sched.epoch_of(step))
            logger.write(done, "train", m)
            last = m
            if bar is not None:
                bar.set_postfix(loss=f"{m['loss']:.3f}", acc=f"{m['acc']:.3f}", lr=f"{m['lr']:.2e}")
            else:
                log(f"step {done}/{n_steps} loss {m['loss']:.3f} acc {m['acc']:.3f} lr {m['lr']:.2e} "
                    f"{m['steps_per_s']:.2f} steps/s")
            sums, stat_acc, n_acc, t_log = None, None, 0, time.time()
        if cfg.log.eval_every_steps and done % cfg.log.eval_every_steps == 0 and done < n_steps:
            run_eval(done, state.params)
        if done % ck.every_steps == 0 or done == n_steps:
            ckpt.save(done, state.to_tree(), {"step": done, "trajectory": traj})
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    ckpt.wait()
    train_s = time.time() - t_train
    ev = run_eval(n_steps, state.params)
    ckpt.close()
    logger.close()

    # ---- HF export: weights (output.dtype) + tokenizer files ----
    out = cfg.output.dir
    dt = cfg.output.dtype
    tgt = Target(params=cast_tree(state.params, dt), config=dataclasses.replace(tcfg_master, dtype=dt))
    tmp = out.rstrip("/") + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    save_target(tgt, tmp, extra_config={"torch_dtype": dt, "pad_token_id": int(tok.pad_token_id)})
    tok.save_pretrained(tmp)
    _portable_tokenizer_config(tmp, cfg.tokenizer.dir)
    with open(os.path.join(tmp, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": list(tcfg.eos_token_ids), "pad_token_id": int(tok.pad_token_id),
                   "do_sample": False}, f, indent=2)
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    summary = {"params": n_params, "steps": n_steps, "start_step": start, "train_chats": len(train_ex),
               "train_tokens": n_tok, "train_response_tokens": n_resp, "epochs": n_steps / sched.steps_per_epoch,
               "train_last": last, "eval": ev, "train_wall_s": round(train_s, 1),
               "total_wall_s": round(time.time() - t0, 1), "output": out}
    if cfg.log.sample_prompts and eval_rows:
        from .weights import load_target
        shipped = load_target(out, dtype="float32")
        summary["samples"] = sample_generations(shipped, tok, eval_rows[:cfg.log.sample_prompts],
                                                cfg.log.sample_max_new_tokens)
        for s in summary["samples"]:
            log("Q: " + s["question"] + "\nA: " + s["generated"] + "\n")
    with open(os.path.join(ck.dir, "pretrain_summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    return summary


def _portable_tokenizer_config(out: str, src: str) -> None:
    """Keep the tokenizer_config.json written by build_demo_tokenizer (class name + inline template)."""
    p = os.path.join(src, "tokenizer_config.json")
    if os.path.exists(p):
        shutil.copy(p, os.path.join(out, "tokenizer_config.json"))


# ----------------------------------------------------------------------------------------------
# Drafter prompts + the whole build
# ----------------------------------------------------------------------------------------------
def write_prompt_file(src: str, dst: str, max_rows: int | None = None) -> str:
    """GSM8K rows -> JSONL of {"prompt": format_gsm8k(row)} for the drafter's data generation (the
    same user text the target was trained on and benchmarks use)."""
    from .prompts import format_gsm8k
    rows = read_jsonl(src)[:max_rows] if max_rows else read_jsonl(src)
    os.makedirs(os.path.dirname(os.path.abspath(dst)), exist_ok=True)
    tmp = dst + ".tmp"
    with open(tmp, "w") as f:
        for i, r in enumerate(rows):
            f.write(json.dumps({"id": i, "prompt": format_gsm8k(r)[0]}) + "\n")
    os.replace(tmp, dst)
    return dst


BUILD_STAGES = ("pretrain", "prompts", "drafter", "ship")


def _fmt_s(s: float) -> str:
    return f"{s / 60:.1f} min" if s >= 60 else f"{s:.0f} s"


def build_reference(target_config: str, drafter_config: str, stages=BUILD_STAGES, overrides=(),
                    drafter_overrides=(), assets: str = ASSETS, force_ship: bool = False, log=print) -> dict:
    """tokenizer -> pretraining -> target export -> drafter data -> drafter training -> export -> ship.

    Stages whose outputs exist are skipped; pretraining and drafter training resume from checkpoints.
    Wall times are accumulated in <workdir>/build_times.json."""
    from .training import load_config
    from .training.pipeline import run as run_drafter
    pcfg = load_pretrain_config(target_config, overrides)
    dcfg = load_config(drafter_config, drafter_overrides)
    if os.path.abspath(dcfg.target.path) != os.path.abspath(pcfg.output.dir):
        raise ConfigError(f"{drafter_config}: target.path {dcfg.target.path} must be the pretrained target "
                          f"({target_config} output.dir = {pcfg.output.dir})")
    work = os.path.dirname(os.path.abspath(pcfg.output.dir))
    os.makedirs(work, exist_ok=True)
    times_path = os.path.join(work, "build_times.json")
    times = json.load(open(times_path)) if os.path.exists(times_path) else {}

    def record(name, secs):
        times[name] = round(times.get(name, 0.0) + secs, 1)
        with open(times_path, "w") as f:
            json.dump(times, f, indent=2)

    out: dict = {}
    if "pretrain" in stages:
        if os.path.exists(os.path.join(pcfg.output.dir, "model.safetensors")):
            log(f"[pretrain] {pcfg.output.dir} exists - skipped")
        else:
            t0 = time.time()
            out["pretrain"] = pretrain(pcfg, log=log)
            record("pretrain", time.time() - t0)
    if "prompts" in stages:
        if os.path.exists(dcfg.data.prompts):
            log(f"[prompts] {dcfg.data.prompts} exists - skipped")
        else:
            write_prompt_file(pcfg.data.train, dcfg.data.prompts)
    if "drafter" in stages:
        from .training.data import data_is_complete
        if not data_is_complete(dcfg):
            t0 = time.time()
            run_drafter(dcfg, ("generate",), log=log)
            record("generate", time.time() - t0)
        if os.path.exists(os.path.join(dcfg.export_dir, "model.safetensors")):
            log(f"[drafter] {dcfg.export_dir} exists - skipped")
        else:
            t0 = time.time()
            out["drafter"] = run_drafter(dcfg, ("train",), log=log)
            record("train_drafter", time.time() - t0)
            t0 = time.time()
            run_drafter(dcfg, ("export",), log=log)
            record("export_drafter", time.time() - t0)
    if "ship" in stages:
        ship(pcfg.output.dir, dcfg.export_dir, assets, extra={"build_times_s": times}, log=log)
    out["times"] = times
    return out


def ship(target_dir: str, drafter_dir: str, assets: str = ASSETS, extra: dict | None = None, log=print) -> None:
    """Copy the target (weights, config, tokenizer) and drafter into the package assets."""
    for name, src in (("target", target_dir), ("drafter", drafter_dir)):
        if not os.path.exists(os.path.join(src, "config.json")):
            raise FileNotFoundError(f"cannot ship the {name}: {src} has no config.json")
        dst = os.path.join(assets, name)
        shutil.rmtree(dst, ignore_errors=True)
        os.makedirs(dst)
        for f in sorted(os.listdir(src)):
            if f.endswith((".json", ".safetensors", ".jinja", ".txt")):
                shutil.copy(os.path.join(src, f), os.path.join(dst, f))
        log(f"[ship] {src} -> {dst}")
    if extra:
        with open(os.path.join(assets, "build_info.json"), "w") as f:
            json.dump(extra, f, indent=2)
