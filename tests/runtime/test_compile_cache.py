"""The persistent compilation cache in one call, counted through jax.monitoring."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import shardax as sx
from shardax.runtime import cache as cc


def test_default_dir_is_per_user(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert cc.default_dir() == os.path.join(tmp_path, "shardax", "jax-compile")
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert cc.default_dir().startswith(os.path.expanduser("~"))


def test_keeps_a_configured_cache_and_counts_hits(tmp_path):
    suite = jax.config.jax_compilation_cache_dir
    assert sx.compile_cache() == suite  # conftest's: no directory given, kept
    try:
        assert sx.compile_cache(tmp_path / "c") == str(tmp_path / "c")
        x = jnp.arange(8.0)

        def f(a):  # a program no other test compiles
            return jnp.cumsum(jnp.sin(a) * 3.25) + 0.125

        before = sx.runtime.compile_stats()
        np.testing.assert_allclose(jax.jit(f)(x), f(np.arange(8.0)), rtol=1e-5)
        first = sx.runtime.compile_stats() - before
        assert first.cache_misses >= 1 and first.cache_hits == 0, first
        assert first.seconds > 0 and first.compiles >= 1
        assert os.listdir(tmp_path / "c")  # written
        jax.clear_caches()  # the in-memory caches: the next jit goes to the disk cache
        before = sx.runtime.compile_stats()
        jax.jit(f)(x).block_until_ready()
        second = sx.runtime.compile_stats() - before
        assert second.cache_hits >= 1 and second.cache_misses == 0, second
        assert set(second.scalars()) >= {"compile/seconds", "compile/cache_hits"}
    finally:
        sx.compile_cache(suite)


def test_arguments():
    with pytest.raises(ValueError, match="min_compile_seconds must be >= 0"):
        sx.compile_cache(min_compile_seconds=-1)
