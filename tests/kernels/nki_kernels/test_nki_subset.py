"""The emulation refuses Python the NKI compiler does not accept (it parses kernels; the simulator would run them as
plain Python): one kernel per refused construct, each refused with a message naming it, and every jdeep kernel body
(and what it calls) inside the subset. Emulation only: with the real `nki` package the compiler is the check
(test_nki_compile.py)."""

from __future__ import annotations

import dataclasses
import enum

import nki
import nki.isa as nisa
import nki.language as nl
import numpy as np
import pytest

from jdeep.kernels import nki as nki_kernels

pytestmark = pytest.mark.skipif(not getattr(nki, "EMULATED", False), reason="checks the emulation's subset check")

_TABLE = [1, 2]                     # a mutable global
_BIG = 0xF0F0F0F0                   # above NKI's 32-bit integers
_LIMIT = 128


class _Plain:                       # not an NKIObject
    def __init__(self, n):
        self.n = n


class _Tiles(nl.NKIObject):
    def __init__(self, n):
        self.n = n

    def count(self):
        return self.n // _LIMIT


class _Mode(enum.Enum):
    fast = 1


@dataclasses.dataclass
class _Data(nl.NKIObject):
    n: int = 0


def _copy(a):
    out = nl.ndarray(a.shape, a.dtype, buffer=nl.shared_hbm)
    t = nl.ndarray(a.shape, a.dtype)
    nisa.dma_copy(dst=t, src=a)
    nisa.dma_copy(dst=out, src=t)
    return out


def k_list_comp(a):
    sizes = [i * 2 for i in range(3)]
    return _copy(a)


def k_generator_expression(a):
    n = max(i for i in range(3))
    return _copy(a)


def _tiles_generator(n):
    for i in range(n):
        yield i


def k_calls_a_generator(a):
    for i in _tiles_generator(2):
        pass
    return _copy(a)


def k_lambda(a):
    f = lambda x: x + 1          # noqa: E731
    return _copy(a)


def k_nested_def(a):
    def helper(x):
        return x
    return _copy(a)


def k_plain_class(a):
    p = _Plain(2)
    return _copy(a)


def k_is_none(a, b=None):
    if b is None:
        return _copy(a)
    return _copy(b)


def k_is_not(a, b=None):
    if b is not None:
        return _copy(b)
    return _copy(a)


def k_slice_object(a):
    s = slice(0, 2)
    return _copy(a)


def k_zip(a):
    for x, y in zip(range(2), range(2)):
        pass
    return _copy(a)


def k_enumerate(a):
    for i, x in enumerate(range(2)):
        pass
    return _copy(a)


def k_sum_builtin(a):
    n = sum([1, 2])
    return _copy(a)


def k_mutable_global(a):
    n = _TABLE[0]
    return _copy(a)


def k_big_int_literal(a):
    mask = 0xF0F0F0F0
    return _copy(a)


def k_big_int_global(a):
    mask = _BIG
    return _copy(a)


def k_try(a):
    try:
        n = 1
    except ValueError:
        n = 2
    return _copy(a)


def k_with(a):
    with open("x"):
        pass
    return _copy(a)


def k_set_literal(a):
    s = {1, 2}
    return _copy(a)


def k_int_dict_key(a):
    d = {1: 2}
    return _copy(a)


def k_numpy(a):
    n = np.prod(a.shape)
    return _copy(a)


def _closure_maker(n):
    def kernel(a):
        m = n
        return _copy(a)
    return kernel


REFUSED = {
    k_list_comp: "list comprehension", k_generator_expression: "generator expression",
    k_calls_a_generator: r"generator \(yield\)", k_lambda: "lambda", k_nested_def: "nested function",
    k_plain_class: "must derive from NKIObject", k_is_none: "'is' is not NKI", k_is_not: "'is not' is not NKI",
    k_slice_object: r"builtin slice\(\)", k_zip: r"builtin zip\(\)", k_enumerate: r"builtin enumerate\(\)",
    k_sum_builtin: r"builtin sum\(\)", k_mutable_global: "a list object", k_big_int_literal: "32-bit integers",
    k_big_int_global: "32-bit integers", k_try: "try/except", k_with: "with statement", k_set_literal: "set literal",
    k_int_dict_key: "string keys", k_numpy: "host Python",
    _closure_maker([1]): "closure variable 'n': a list object",
}


@pytest.mark.parametrize("kernel", list(REFUSED), ids=[f.__name__ for f in REFUSED])
def test_each_construct_outside_the_subset_is_refused(kernel):
    x = np.ones((2, 4), np.float32)
    with pytest.raises(nki.SubsetError, match=REFUSED[kernel]):
        nki.simulate(kernel)(x)
    with pytest.raises(nki.SubsetError, match=REFUSED[kernel]):     # the same check guards nki.jit kernels
        nki.jit(kernel)(x)


def k_accepted(a, n: int = 2, flag=None):
    """Loops over ranges and lists, tuples, dicts with string keys, NKIObject classes (a dataclass too) and enums,
    f-strings, assert, min / max / len / range, conditional expressions, constants from globals."""
    sizes = []
    for i in range(n):
        sizes.append(min(i, _LIMIT))
    pair = (len(sizes), max(sizes))
    info = {"n": pair[0]}
    tiles = _Tiles(256)
    data = _Data(n=3)
    mode = _Mode.fast
    assert tiles.count() == 2 and data.n == 3 and mode == _Mode.fast, f"bad {info['n']}"
    step = 1 if flag == None else 2      # noqa: E711 (== None: the subset has no `is`)
    return _copy(a)


def test_the_subset_accepts_plain_kernels():
    x = np.ones((2, 4), np.float32)
    np.testing.assert_array_equal(nki.simulate(k_accepted)(x), x)


def _bodies():
    """Every kernel body jdeep registers (module, name), the second MoE kernel and attention's shared-keys-only
    entry point."""
    names = {(mod, body) for mod, _, body in nki_kernels.KERNELS.values()} | {
        ("moe", "expert_down_kernel"), ("attention", "sparse_attention_shared_kernel")}
    return sorted(names)


@pytest.mark.parametrize("module,body", _bodies(), ids=[b for _, b in _bodies()])
def test_every_jdeep_kernel_is_inside_the_subset(module, body):
    import importlib

    fn = getattr(importlib.import_module(f"jdeep.kernels.nki.{module}"), body)
    nki.subset.check_kernel(fn)
