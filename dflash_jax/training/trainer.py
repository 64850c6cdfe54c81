"""A generic data-parallel optax trainer: objective + trainable params + frozen params.

    trainer = Trainer(objective, params, frozen, optimizer, mesh=mesh, schedule=lr_fn)
    state = trainer.init_state(seed)
    state, aux, stats = trainer.train_step(state, host_batch)   # host_batch arrays [accum, micro, ...]

- Only `params` are trained; `frozen` (e.g. the target with its embedding and lm_head) is an
  ordinary jit argument, so it is neither differentiated nor part of the optimizer state.
- Master weights live in `param_dtype` (float32); objectives cast to their compute dtype inside the
  loss, so gradients arrive in float32.
- Gradient accumulation: the micro-batches of one step are scanned inside one jitted call; their
  gradients are averaged before clipping and the AdamW update.
- Data parallel: batch arrays are sharded on their micro-batch axis over the mesh's 'data' axis,
  params are replicated; with `zero1` (default) the optimizer state and the gradients are sharded
  over 'data' (each array on its largest axis divisible by the data size): XLA reduce-scatters the
  gradients, each device updates its slice of the AdamW state, and the new params are all-gathered
  (ZeRO stage 1-2 through shardings). With one device this is plain jit.
- The objective's aux values are *sums*; the trainer adds them over micro-batches (and the caller
  over steps) and `objective.summarize` turns them into ratios.
"""
from __future__ import annotations

from typing import Any, Callable

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P



@flax.struct.dataclass
class TrainState:
    step: jax.Array  # int32 [] optimizer steps taken
    params: Any
    opt_state: Any
    rng: jax.Array  # uint32 [2] raw PRNG key data

    def to_tree(self) -> dict:
        return {"step": self.step, "params": self.params, "opt_state": self.opt_state, "rng": self.rng}

    @classmethod
    def from_tree(cls, t: dict) -> "TrainState":
        return cls(step=t["step"], params=t["params"], opt_state=t["opt_state"], rng=t["rng"])


def _add(a, b):
    return jax.tree_util.tree_map(jnp.add, a, b)


class Trainer:
    def __init__(self, objective, params, frozen, optimizer: optax.GradientTransformation, *, mesh=None,
                 schedule: Callable | None = None, param_dtype: str = "float32", frozen_shardings=None,
                 data_axis: str = "data", zero1: bool = True):
        if mesh is None:
            from ..sharding import make_mesh
            mesh = make_mesh(1, 1, devices=jax.devices()[:1])
        self.objective = objective
        self.optimizer = optimizer
        self.schedule = schedule
        self.mesh = mesh
        self.data_axis = data_axis
        self.repl = NamedSharding(mesh, P())
        self.param_dtype = param_dtype
        self.params0 = params  # copied (and cast) into each new state: states are donated to the step
        if frozen_shardings is None:
            frozen_shardings = jax.tree_util.tree_map(lambda _: self.repl, frozen)
        if any(isinstance(a, jax.ShapeDtypeStruct) for a in jax.tree_util.tree_leaves(frozen)):  # dflash_jax.planner
            self.frozen = jax.tree_util.tree_map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                                                 frozen, frozen_shardings)
        else:
            self.frozen = jax.device_put(frozen, frozen_shardings)
        self._frozen_shardings = frozen_shardings
        self._train = None
        self._eval = None
        self.zero1 = zero1
        dp = self.data_parallel

        def split(shape) -> NamedSharding:
            if not zero1 or dp == 1:
                return self.repl
            dims = [d for d in range(len(shape)) if shape[d] % dp == 0 and shape[d] >= dp]
            if not dims:
                return self.repl
            d = max(dims, key=lambda i: shape[i])
            return NamedSharding(mesh, P(*([None] * d + [data_axis])))

        self._split = split
        self.grad_shardings = jax.tree_util.tree_map(lambda a: split(np.shape(a)), params)
        opt_shape = jax.eval_shape(optimizer.init, jax.tree_util.tree_map(
            lambda a: jax.ShapeDtypeStruct(np.shape(a), jnp.dtype(param_dtype) if jnp.issubdtype(a.dtype, jnp.floating)
                                           else a.dtype), params))
        self.opt_shardings = jax.tree_util.tree_map(lambda a: split(a.shape), opt_shape)

    def state_shardings(self) -> TrainState:
        return TrainState(step=self.repl, params=jax.tree_util.tree_map(lambda _: self.repl, self.params0),
                          opt_state=self.opt_shardings, rng=self.repl)

    # ---- state ----
    @property
    def data_parallel(self) -> int:
        return int(self.mesh.shape[self.data_axis])

    def init_state(self, seed: int = 0) -> TrainState:
        dt = self.param_dtype

        def init(p):
            p = jax.tree_util.tree_map(lambda a: jnp.array(a, dtype=dt if jnp.issubdtype(a.dtype, jnp.floating)
                                                           else a.dtype, copy=True), p)
            return p, self.optimizer.init(p)

        params, opt_state = jax.jit(init, out_shardings=(jax.tree_util.tree_map(lambda _: self.repl, self.params0),
                                                         self.opt_shardings))(self.params0)
        rng = jax.random.key_data(jax.random.PRNGKey(seed)).astype(jnp.uint32)
        return TrainState(step=jax.device_put(jnp.zeros((), jnp.int32), self.repl), params=params,
                          opt_state=opt_state, rng=jax.device_put(rng, self.repl))

    def abstract_state(self, state: TrainState) -> dict:
        return jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding),
                                      state.to_tree())

    def place_state(self, tree: dict) -> TrainState:
        return TrainState.from_tree(jax.device_put(tree, self.state_shardings().to_tree()))

    # ---- steps ----
    def _step_fn(self, state: TrainState, frozen, batch):
        obj = self.objective
        key = jax.random.wrap_key_data(state.rng)
        key, sub = jax.random.split(key)
        accum = jax.tree_util.tree_leaves(batch)[0].shape[0]
        grad_fn = jax.value_and_grad(obj.loss, has_aux=True)

        def constrain(g):
            if not self.zero1 or self.data_parallel == 1:
                return g
            return jax.tree_util.tree_map(jax.lax.with_sharding_constraint, g, self.grad_shardings)

        def micro(carry, xs):
            gsum, aux_sum, i = carry
            (loss, aux), g = grad_fn(state.params, frozen, xs, jax.random.fold_in(sub, i))
            return (constrain(_add(gsum, g)), _add(aux_sum, aux), i + 1), loss

        first = jax.tree_util.tree_map(lambda a: a[0], batch)
        aux_shape = jax.eval_shape(lambda: obj.loss(state.params, frozen, first, sub)[1])
        zeros_aux = jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), aux_shape)
        zeros_g = constrain(jax.tree_util.tree_map(jnp.zeros_like, state.params))
        (gsum, aux, _), losses = jax.lax.scan(micro, (zeros_g, zeros_aux, jnp.zeros((), jnp.int32)), batch)
        grads = jax.tree_util.tree_map(lambda g: g / accum, gsum)
        gnorm = optax.tree.norm(grads)
        updates, opt_state = self.optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        stats = {"loss": jnp.mean(losses), "grad_norm": gnorm,
                 "lr": self.schedule(state.step) if self.schedule is not None else jnp.zeros(())}
        new = TrainState(step=state.step + 1, params=params, opt_state=opt_state,
                         rng=jax.random.key_data(key).astype(jnp.uint32))
        return new, aux, stats

    def _eval_fn(self, params, frozen, batch):
        _, aux = self.objective.loss(params, frozen, batch, jax.random.PRNGKey(0))
        return aux

    def batch_sharding(self, ndim: int, accum_axis: bool) -> NamedSharding:
        spec = (None, self.data_axis) if accum_axis else (self.data_axis,)
        return NamedSharding(self.mesh, P(*spec, *([None] * (ndim - len(spec)))))

    def put_batch(self, host: dict, accum_axis: bool = True) -> dict:
        from ..weights import put_global
        dp = self.data_parallel
        out = {}
        for k, v in host.items():
            v = np.asarray(v)
            n = v.shape[1 if accum_axis else 0]
            if n % dp:
                raise ValueError(f"batch of {n} rows is not divisible by the mesh data axis ({dp})")
            out[k] = put_global(v, self.mesh, self.batch_sharding(v.ndim, accum_axis).spec)
        return out

    def train_step(self, state: TrainState, host_batch: dict):
        """One optimizer step on host arrays [accum, micro, ...]; returns (state, aux sums, stats)."""
        batch = self.put_batch(host_batch, accum_axis=True)
        return self.step_program(state)(state, self.frozen, batch)

    def step_program(self, state):
        """The jitted optimizer step (state donated) that train_step runs; dflash_jax.planner compiles it
        on abstract arguments."""
        if self._train is None:
            self._train = self.jit_train_step()
        return self._train

    def jit_train_step(self):
        """The jitted step (state donated; ZeRO shardings on the way out); `.lower()` it for AOT analysis."""
        return jax.jit(self._step_fn, donate_argnums=(0,), out_shardings=(self.state_shardings(), self.repl, self.repl))

    def eval_step(self, params, host_batch: dict):
        """Aux sums of the objective on host arrays [micro, ...] (no update)."""
        batch = self.put_batch(host_batch, accum_axis=False)
        if self._eval is None:
            self._eval = jax.jit(self._eval_fn, out_shardings=self.repl)
        return self._eval(params, self.frozen, batch)


def add_sums(acc: dict | None, new: dict) -> dict:
    """Add device aux sums without synchronising (None starts a new accumulator)."""
    return new if acc is None else jax.tree_util.tree_map(jnp.add, acc, new)


def fetch_tree(tree) -> dict:
    return jax.tree_util.tree_map(lambda a: np.asarray(jax.device_get(a)), tree)
