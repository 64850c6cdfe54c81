"""The SwiGLU MLP kernel (dflash_jax.mlp_kernel, Pallas interpret mode on CPU) against layers.swiglu."""
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax import mlp_kernel
from dflash_jax.layers import rms_norm, swiglu


@pytest.mark.parametrize("N,I,dtype", [(16, 512, jnp.float32), (40, 384, jnp.float32), (24, 768, jnp.bfloat16)])
def test_swiglu_mlp_equals_layers_swiglu(N, I, dtype):
    """Intermediate tiles of 256 (384: tiles of 128), float32 and bfloat16 (the same roundings as swiglu); with the
    input RMS norm and the residual add in the kernel."""
    rng = np.random.default_rng(N)
    H = 128
    x = jnp.asarray(rng.normal(size=(N, H)), dtype)
    lp = {n: jnp.asarray(rng.normal(size=s) / 8, dtype) for n, s in (("gate", (H, I)), ("up", (H, I)),
                                                                      ("down", (I, H)))}
    want = swiglu(x, lp)
    got = mlp_kernel.swiglu_mlp(x, lp["gate"], lp["up"], lp["down"], interpret=True)
    assert got.dtype == dtype and got.shape == (N, H)
    tol = 1e-5 if dtype == jnp.float32 else 5e-2
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=tol, atol=tol)
    # with the input norm, and the residual stream added (the decoder layer's use)
    nw = jnp.asarray(rng.uniform(0.5, 1.5, size=H), dtype)
    want = x + swiglu(rms_norm(x, nw, 1e-6), lp)
    got = mlp_kernel.swiglu_mlp(x, lp["gate"], lp["up"], lp["down"], nw, eps=1e-6, residual=True, interpret=True)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=tol, atol=tol)


def test_applies_only_to_one_row_tile():
    assert mlp_kernel.applies(256, 4096, 12288)  # 16 rows x 16 tokens of Qwen3-8B
    assert mlp_kernel.applies(1024, 4096, 12288)  # 64 rows: I-tiles of 128
    assert not mlp_kernel.applies(2048, 4096, 12288)  # 128 rows: two row tiles would read the weights twice
    assert not mlp_kernel.applies(256, 4096, 100)  # no 128-feature tile
    with pytest.raises(ValueError, match="no single-row-tile tiling"):
        mlp_kernel.swiglu_mlp(jnp.zeros((8, 64)), jnp.zeros((64, 100)), jnp.zeros((64, 100)), jnp.zeros((100, 64)))


@pytest.mark.parametrize("N,A,dtype", [(16, 256, jnp.float32), (24, 384, jnp.bfloat16), (32, 128, jnp.float32)])
def test_attention_tail_equals_xla(N, A, dtype):
    """attn / wo given: y = x + attn @ wo, then y + swiglu(rms_norm(y)), as the decoder layer computes them in XLA;
    stacked weights read at a traced layer index; o-projection inputs wider than, equal to and narrower than H."""
    import jax

    from dflash_jax.layers import mat
    rng = np.random.default_rng(A)
    H, I, L = 256, 384, 3
    x = jnp.asarray(rng.normal(size=(N, H)), dtype)
    attn = jnp.asarray(rng.normal(size=(N, A)), dtype)
    st = {n: jnp.asarray(rng.normal(size=(L,) + s) / np.sqrt(s[0]), dtype)  # outputs of unit scale
          for n, s in (("gate", (H, I)), ("up", (H, I)), ("down", (I, H)), ("o", (A, H)))}
    nw = jnp.asarray(rng.uniform(0.5, 1.5, size=H), dtype)
    lp = {n: w[1] for n, w in st.items()}
    y = x + mat(attn, lp, "o")
    want = y + swiglu(rms_norm(y, nw, 1e-6), lp)
    run = jax.jit(lambda i: mlp_kernel.swiglu_mlp(x, st["gate"], st["up"], st["down"], nw, eps=1e-6, residual=True,
                                                  layer=i, attn=attn, wo=st["o"], interpret=True))
    got = run(jnp.int32(1))
    tol = 1e-5 if dtype == jnp.float32 else 5e-2
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=tol, atol=tol)
    assert mlp_kernel.applies(1024, 4096, 12288, A=4096)  # 64 rows x 16 tokens of Qwen3-8B, o projection inside
    with pytest.raises(ValueError, match="attention tail needs"):
        mlp_kernel.swiglu_mlp(x, lp["gate"], lp["up"], lp["down"], attn=attn, wo=lp["o"])


@pytest.mark.parametrize("N", [960, 1040])
def test_kernel_compiles_for_a_v5p_core_at_token_counts_off_128(N):
    """A tree of 64 nodes at 16 rows per chip verifies 1,040 tokens: the in-kernel norm and the epilogue must take
    their rows in chunks that divide N (whole-block float32 temporaries overflowed a v5p core's 64 MiB of VMEM).
    Compiled by the TPU compiler (libtpu, no TPU) at Qwen3-8B's width, with and without the attention tail."""
    pytest.importorskip("libtpu")
    import jax
    from jax.sharding import SingleDeviceSharding

    from dflash_jax.planner.hlo import as_on_tpu
    from dflash_jax.planner.topology import resolve_tpu, topology_devices
    sh = SingleDeviceSharding(topology_devices(resolve_tpu("v5p-8"))[0])
    H, I = 4096, 12288

    def s(*shape):
        return jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=sh)

    @as_on_tpu
    def compile_(tail):
        def f(x, g, u, d, nw, a, wo):
            return mlp_kernel.swiglu_mlp(x, g, u, d, nw, eps=1e-6, residual=True, layer=1,
                                         **({"attn": a, "wo": wo} if tail else {}))
        jax.jit(f).lower(s(N, H), s(2, H, I), s(2, H, I), s(2, I, H), s(H), s(N, H), s(2, H, H)).compile()

    for tail in (False, True):
        assert mlp_kernel.applies(N, H, I, A=H if tail else 0)
        compile_(tail)
