"""A consumer's test: pallasite's public API through @pallasite//packages/kernels."""

import unittest

import jax
import jax.numpy as jnp
import numpy as np

from pallasite.kernels import chunk_ssd, grouped_projection
from pallasite.reference.grouped_projection import grouped_projection as reference


class UsesPallasite(unittest.TestCase):
    def test_grouped_projection_and_its_gradient(self):
        x = jax.random.normal(jax.random.key(0), (32, 16))
        w = jax.random.normal(jax.random.key(1), (4, 16, 8))
        sizes = jnp.array([10, 0, 12, 6], jnp.int32)
        y = grouped_projection(x, w, sizes, jnp.float32)
        np.testing.assert_allclose(y, reference(x, w, sizes, jnp.float32), rtol=1e-5,
                                   atol=1e-5)
        dw = jax.grad(lambda w: grouped_projection(x, w, sizes, jnp.float32).sum())(w)
        self.assertEqual(dw.shape, w.shape)

    def test_chunk_ssd(self):
        x = jnp.ones((1, 64, 2, 16)) * 0.1
        a = -jnp.ones((1, 64, 2)) * 0.05
        b = jnp.ones((1, 64, 1, 16))
        y, final = chunk_ssd(x, a, b, b, chunk_size=32)
        self.assertEqual(y.shape, x.shape)
        self.assertEqual(final.shape, (1, 2, 16, 16))
        self.assertTrue(bool(jnp.all(jnp.isfinite(y))))


if __name__ == "__main__":
    unittest.main()
