"""The executable store (jdeep/model/executables.py) and CachedProgram (jdeep/model/cache.py): executables written
and read back by what they are, run without tracing, refused (and run through jax.jit instead) for other arguments;
an executable JAX read from its own persistent cache is not written."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jdeep.model.cache import CachedProgram, ProgramCache, call_key, stable_name
from jdeep.model.executables import ExecutableStore


def _scale(x, y):
    return jnp.tanh(x) * y + 1.0


def _args(n: int = 8):
    dev = jax.devices()[0]
    return jax.device_put(jnp.arange(n, dtype=jnp.float32), dev), jax.device_put(jnp.float32(3.0), dev)


def _abstract(args):
    return tuple(jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding) for a in args)


def test_written_then_read_back_and_run(tmp_path):
    store, jitted, args = ExecutableStore(tmp_path), jax.jit(_scale), _args()
    want = np.asarray(jitted(*args))
    assert store.load("scale", _abstract(args)) is None
    store.compile("scale", _abstract(args), lambda: jitted.lower(*_abstract(args)))
    assert len(list(tmp_path.iterdir())) == 1
    exe = store.load("scale", _abstract(args))
    np.testing.assert_array_equal(np.asarray(exe(*args)), want)
    assert store.load("scale", _abstract(_args(4))) is None        # other shapes: another file
    assert store.load("other", _abstract(args)) is None            # another program: another file


def test_a_torn_file_is_a_miss(tmp_path):
    store, args = ExecutableStore(tmp_path), _args()
    store.compile("scale", _abstract(args), lambda: jax.jit(_scale).lower(*_abstract(args)))
    path = next(tmp_path.iterdir())
    path.write_bytes(path.read_bytes()[:100])
    assert store.load("scale", _abstract(args)) is None


def test_an_executable_from_jaxs_own_cache_is_not_written(tmp_path):
    """JAX records a cache hit in the compiling thread; such an executable does not serialize whole."""
    store, args = ExecutableStore(tmp_path), _args()

    def lower_from_cache():
        jax.monitoring.record_event("/jax/compilation_cache/cache_hits")
        return jax.jit(_scale).lower(*_abstract(args))

    store.compile("scale", _abstract(args), lower_from_cache)
    assert not tmp_path.exists() or not list(tmp_path.iterdir())


def test_cached_program_runs_installed_executables_and_jit_for_the_rest():
    program = CachedProgram(jax.jit(_scale), "tests.scale")
    args = _args()
    exe = jax.jit(_scale).lower(*_abstract(args)).compile()
    program.install(call_key(args, {}), exe)
    np.testing.assert_array_equal(np.asarray(program(*args)), np.asarray(jax.jit(_scale)(*args)))
    other = _args(4)
    np.testing.assert_array_equal(np.asarray(program(*other)), np.asarray(jax.jit(_scale)(*other)))
    assert jax.eval_shape(program, *args).shape == (8,)             # traced calls: jax.jit's path
    assert program._cache_size() >= 1


def test_program_cache_names_programs_stably():
    cache = ProgramCache()
    program = cache.jit(_scale)
    assert isinstance(program, CachedProgram) and program.ident == f"('jit',{__name__}._scale,())"
    assert stable_name(("jit", lambda x: x, ())) is None              # a lambda names nothing across processes

    class Opaque:
        pass

    assert stable_name(("k", Opaque())) is None                      # printed with its address


def test_call_keys_tell_trees_apart_by_every_leaf():
    a = {"x": np.zeros((4, 2)), "y": np.zeros(3)}
    b = {"x": np.zeros((4, 2)), "y": np.zeros(5)}
    assert call_key((a,), {}) != call_key((b,), {})
    assert call_key((a,), {"n_tokens": 128}) != call_key((a,), {"n_tokens": 256})
