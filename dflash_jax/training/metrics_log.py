"""Metrics: a JSONL file (one object per log event), TensorBoard when a writer library is installed,
and a tqdm progress bar with steps/s and ETA."""
from __future__ import annotations

import json
import math
import os
import time


def _clean(v):
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


class MetricsLogger:
    def __init__(self, path: str | None, tensorboard_dir: str | None = None, enabled: bool = True,
                 resume_step: int | None = None, log=print):
        self.path = path if enabled else None
        self.tb = None
        if self.path:
            os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
            if resume_step is not None and os.path.exists(self.path):
                self._truncate_after(resume_step)
            elif resume_step is None and os.path.exists(self.path):
                os.replace(self.path, self.path + ".old")
        if enabled and tensorboard_dir:
            self.tb = _tb_writer(tensorboard_dir, log)

    def _truncate_after(self, step: int) -> None:
        """Drop events logged after `step` by a run that was killed before checkpointing them."""
        keep = []
        with open(self.path) as f:
            for line in f:
                try:
                    if json.loads(line).get("step", 0) <= step:
                        keep.append(line)
                except json.JSONDecodeError:
                    pass  # a line cut by the kill
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            f.writelines(keep)
        os.replace(tmp, self.path)

    def write(self, step: int, split: str, metrics: dict) -> None:
        if self.path:
            rec = {"step": int(step), "split": split, "time": round(time.time(), 3)}
            rec.update({k: _clean(v) for k, v in metrics.items()})
            with open(self.path, "a") as f:
                f.write(json.dumps(rec) + "\n")
        if self.tb is not None:
            for k, v in metrics.items():
                if isinstance(v, (int, float)) and math.isfinite(v):
                    self.tb(f"{split}/{k}", float(v), int(step))

    def close(self) -> None:
        if self.tb is not None and hasattr(self.tb, "close"):
            self.tb.close()


def _tb_writer(logdir: str, log):
    try:
        from tensorboardX import SummaryWriter
        w = SummaryWriter(logdir)

        class _W:
            def __call__(self, tag, v, step):
                w.add_scalar(tag, v, step)

            def close(self):
                w.close()
        return _W()
    except ImportError:
        pass
    try:
        import tensorflow as tf  # noqa: F401
        writer = tf.summary.create_file_writer(logdir)

        class _TF:
            def __call__(self, tag, v, step):
                with writer.as_default():
                    tf.summary.scalar(tag, v, step=step)

            def close(self):
                writer.flush()
        return _TF()
    except ImportError:
        log("log.tensorboard_dir is set but neither tensorboardX nor tensorflow is installed; "
            "TensorBoard logging is off (metrics still go to the JSONL file)")
        return None


def load_metrics(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def progress_bar(total: int, initial: int, enabled: bool, desc: str = "train"):
    if not enabled:
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return None
    return tqdm(total=total, initial=initial, desc=desc, unit="step", dynamic_ncols=True)
