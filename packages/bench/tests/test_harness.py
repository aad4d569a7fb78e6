"""Input rotation sizing and the steady-state loop (with a fake device)."""

import pytest

from pallasite.bench import harness


def test_rotation_copies_exceed_the_cache():
    l2 = 60 << 20
    assert harness.rotation_copies(4 << 20, l2, 16 << 30) == 32  # capped at `most`
    n = harness.rotation_copies(40 << 20, l2, 16 << 30)
    assert n * (40 << 20) >= 3 * l2 and n == 5
    assert harness.rotation_copies(8 << 30, l2, 16 << 30) == 2  # at least two
    assert harness.rotation_copies(12 << 30, l2, 16 << 30) == 1  # what fits


def test_steady_state_rotates_and_reports_spread():
    seen, syncs = [], []

    def call(x):
        seen.append(x)
        return x

    t = harness.steady_state(call, [0, 1, 2], syncs.append, compile_s=0.5, warmup=2,
                             samples=5, sample_s=1e-9)
    assert t.compile_s == 0.5 and t.samples == 5 and t.calls_per_sample == 1
    assert seen[:2] == [0, 1]  # warm-up
    assert seen[2:] == [0, 1, 2, 0, 1]  # every input set in turn
    assert t.p10_s <= t.median_s <= t.p90_s and t.min_s <= t.p10_s
    assert len(syncs) == 2 + 5


def test_steady_state_batches_short_calls():
    t = harness.steady_state(lambda x: x, [0], lambda o: None, compile_s=0.0,
                             warmup=1, samples=3, sample_s=1.0, max_calls=7)
    assert t.calls_per_sample == 7


def test_compile_jax_times_ahead_of_time():
    import jax
    import jax.numpy as jnp

    compiled, seconds = harness.compile_jax(jax.jit(lambda d: d["a"] * 2), {"a": jnp.ones(3)})
    assert seconds > 0
    assert compiled({"a": jnp.ones(3)}).tolist() == [2.0, 2.0, 2.0]
    with pytest.raises(Exception):
        compiled({"a": jnp.ones(4)})  # compiled for one shape only


def test_temp_bytes_counts_what_a_backward_keeps():
    """A forward+backward keeps its forward's intermediates for the backward: XLA's
    temporary bytes grow with them; arguments and outputs are not counted."""
    import jax
    import jax.numpy as jnp

    def loss(x, layers):
        for _ in range(layers):
            x = jnp.tanh(x @ x)
        return jnp.sum(x)

    x = jnp.ones((128, 128), jnp.float32)
    temp = [harness.temp_bytes(harness.compile_jax(
        jax.jit(jax.grad(lambda a, n=n: loss(a, n))), x)[0]) for n in (1, 4)]
    assert 0 < temp[0] < temp[1]
    assert temp[1] >= 3 * 128 * 128 * 4  # at least the three extra layers' activations
    assert harness.temp_bytes(object()) is None  # no analysis: None, not an error


def test_issue_time_tells_host_bound_from_device_bound():
    """A call that holds the host (dispatch slower than the device) issues as slowly as it
    runs; one that returns at once and waits in the sync does not."""
    import time

    slow_issue = harness.steady_state(lambda x: time.sleep(2e-3), [0], lambda o: None,
                                      compile_s=0.0, warmup=1, samples=3, sample_s=4e-3)
    assert harness.host_bound(slow_issue.issue_s, slow_issue.median_s)
    slow_device = harness.steady_state(lambda x: x, [0], lambda o: time.sleep(4e-3),
                                       compile_s=0.0, warmup=1, samples=3, sample_s=1e-9)
    assert slow_device.issue_s < 0.5 * slow_device.median_s
    assert not harness.host_bound(slow_device.issue_s, slow_device.median_s)
    assert not harness.host_bound(None, 1.0) and not harness.host_bound(1.0, None)
