"""The q / k projection kernel (dflash_jax.proj_kernel, Pallas interpret mode on CPU) against the XLA composition it
replaces on TPU: projection, per-head RMS norm, rotate-half rotary embedding."""
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax import proj_kernel
from dflash_jax.layers import apply_rope, rms_norm, rope_cos_sin, rope_inv_freq


@pytest.mark.parametrize("N,heads,dtype", [(24, 4, jnp.float32), (40, 6, jnp.float32), (16, 2, jnp.bfloat16)])
def test_proj_norm_rope_equals_the_composition(N, heads, dtype):
    """Heads of 128 in column tiles of 4 heads (6 heads: tiles of 3), positions far apart, float32 and bfloat16."""
    rng = np.random.default_rng(N)
    H, D = 256, 128
    x = jnp.asarray(rng.normal(size=(N, H)), dtype)
    w = jnp.asarray(rng.normal(size=(heads * D, H)) / 16, dtype)
    nw = jnp.asarray(rng.uniform(0.5, 1.5, size=D), dtype)
    pos = jnp.asarray(rng.integers(0, 30000, size=(N,)), jnp.int32)
    cos, sin = rope_cos_sin(pos, rope_inv_freq(D, 1e6, None))
    y = jnp.einsum("ni,oi->no", x.astype(jnp.float32), w.astype(jnp.float32)).reshape(N, heads, D)
    want = apply_rope(rms_norm(y, nw, 1e-6)[None], cos[None], sin[None])[0].reshape(N, heads * D)
    got = proj_kernel.proj_norm_rope(x, w, nw, cos, sin, eps=1e-6, interpret=True)
    assert got.dtype == dtype and got.shape == (N, heads * D)
    tol = 1e-5 if dtype == jnp.float32 else 3e-2
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=tol, atol=tol)


def test_applies_only_where_it_tiles():
    assert proj_kernel.applies(256, 4096, 4096, 128) and proj_kernel.applies(16, 4096, 1024, 128)
    assert not proj_kernel.applies(256, 64, 256, 64)  # heads narrower than the 128 lanes
    assert not proj_kernel.applies(1815, 4096, 4096, 128)  # over 1,024 rows and no tile of 8k rows divides them
    with pytest.raises(ValueError, match="no tiling"):
        proj_kernel.proj_norm_rope(jnp.zeros((8, 64)), jnp.zeros((128, 64)), jnp.ones((64,)), jnp.zeros((8, 32)),
                                   jnp.zeros((8, 32)), eps=1e-6, interpret=True)
