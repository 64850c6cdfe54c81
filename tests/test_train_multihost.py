"""Two jax.distributed processes on localhost: each generates its own prompts into a shared file:// URL
(the gs:// code path through fsspec), then both train on all the shards."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from tests.xla_env import subprocess_xla_flags
from dflash_jax.training.config import config_from_dict
from dflash_jax.training.data import generate_data, load_sequences
from dflash_jax.training.pipeline import ensure_target
from dflash_jax.training.testing import tiny_config_dict, write_id_prompts

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

WORKER = textwrap.dedent("""
    import hashlib, json, sys
    from dflash_jax.distributed import initialize
    initialize(sys.argv[1], 2, int(sys.argv[2]))
    import jax, numpy as np
    from dflash_jax.training.config import config_from_dict
    from dflash_jax.training.data import generate_data
    from dflash_jax.training.pipeline import train
    cfg = config_from_dict(json.loads(sys.argv[3]))
    prog = generate_data(cfg, progress=False, log=lambda *_: None)
    out = train(cfg, resume=False, progress=False, log=lambda *_: None)
    h = hashlib.sha256(b"".join(np.asarray(x).tobytes() for x in jax.tree_util.tree_leaves(out["params"]))).hexdigest()
    print("RESULT " + json.dumps({"pid": jax.process_index(), "n": jax.device_count(), "prog": prog,
                                  "step": out["final_step"], "params": h}))
""")


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_processes_generate_and_train_on_shared_url(tmp_path):
    root = str(tmp_path)
    write_id_prompts(f"{root}/prompts.jsonl", 20, seed=3)
    sections = dict(data={"output_dir": f"file://{root}/data", "generation": {"batch_size": 4, "max_new_tokens": 12}},
                    train={"steps": 4, "batch_size": 2, "num_anchors": 8}, eval={"num_sequences": 0},
                    checkpoint={"dir": f"{root}/ckpt", "every_steps": 2})
    d = tiny_config_dict(root, **sections)
    ensure_target(config_from_dict(d), log=lambda *_: None)  # created once, before the workers start
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
    env["XLA_FLAGS"] = subprocess_xla_flags()
    addr = f"127.0.0.1:{_free_port()}"
    procs = [subprocess.Popen([sys.executable, str(script), addr, str(i), json.dumps(d)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT) for i in range(2)]
    try:
        outs = [p.communicate(timeout=900) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, (so, se) in zip(procs, outs):
        assert p.returncode == 0, se[-3000:]
    res = [json.loads([l for l in so.splitlines() if l.startswith("RESULT ")][-1][7:]) for so, _ in outs]
    assert [r["n"] for r in res] == [2, 2]
    names = sorted(os.listdir(f"{root}/data"))
    assert any(n.startswith("shard_p000_") for n in names) and any(n.startswith("shard_p001_") for n in names)
    assert res[0]["prog"]["complete"] and res[0]["prog"]["done"] == 20
    assert res[0]["step"] == res[1]["step"] == 4 and res[0]["params"] == res[1]["params"]
    # the two processes' data equal one process's (sampling keys depend on prompt ids only)
    got = load_sequences(f"file://{root}/data")
    one = config_from_dict(d, [f"data.output_dir={root}/single"])
    generate_data(one, progress=False, log=lambda *_: None)
    ref = load_sequences(f"{root}/single")
    assert got.ids.tolist() == ref.ids.tolist() == list(range(20))
    for i in range(20):
        assert np.array_equal(got.seq(i), ref.seq(i)), i
