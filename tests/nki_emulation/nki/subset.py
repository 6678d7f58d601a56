"""The Python the NKI compiler accepts in a kernel, checked on the kernel's syntax tree before the emulation runs it.

The NKI compiler parses a kernel's source and specialises it; it does not run Python (nki-compiler.rst), while a
simulator runs kernels as plain Python and so accepts code that then "fails to compile for hardware"
(nki_simulator.rst). This module refuses what lies outside the documented meta-programming language (NKI language
guide, NKI 0.6): values are None, bools, 32-bit integers, 32-bit floats, strings and tensors; containers are tuples,
lists, dicts with string keys and classes derived from NKIObject (or Enum); control flow is if / for over ranges,
lists and tuples / while; functions are inlined. nki-library's kernels (its style: `kernel_assert`, no
comprehensions, NKIObject classes) are the evidence for what is in use. The check is conservative: where the
documentation is silent, a construct stays out (generators, comprehensions, lambdas, closures, try/with, set
literals, `is` / `is not`, `slice()` objects, zip / enumerate / map / sum and other builtins beyond the list below).

Checked: the kernel function and, transitively, every function and class its code names (module globals, and
attributes of imported modules outside the nki package); their free variables and the globals they read must be
compile-time constants (int32, fp32, str, bool, None, tuples of those), modules, functions or NKI classes.
"""

from __future__ import annotations

import ast
import enum
import inspect
import textwrap
import types

__all__ = ["check_kernel", "SubsetError", "ALLOWED_BUILTINS"]

INT32 = (-2 ** 31, 2 ** 31)
FLT_MAX = 3.4028234663852886e38

# builtins the kernels may call (nki-library's kernels use these; the language guide: "most of the Python standard
# list functions" on lists, tuples and dicts)
ALLOWED_BUILTINS = frozenset({"range", "len", "min", "max", "int", "float", "bool", "str", "tuple", "list", "dict",
                              "isinstance", "print", "divmod", "abs", "hasattr", "getattr"})

_REFUSED_NODES = {
    ast.ListComp: "a list comprehension", ast.SetComp: "a set comprehension", ast.DictComp: "a dict comprehension",
    ast.GeneratorExp: "a generator expression", ast.Lambda: "a lambda", ast.Yield: "a generator (yield)",
    ast.YieldFrom: "a generator (yield from)", ast.Await: "await", ast.AsyncFunctionDef: "an async function",
    ast.AsyncFor: "async for", ast.AsyncWith: "async with", ast.Try: "try/except", ast.With: "a with statement",
    ast.Global: "a global statement", ast.Nonlocal: "a nonlocal statement", ast.Set: "a set literal",
    ast.Delete: "del", ast.NamedExpr: "an assignment expression (:=)",
}
if hasattr(ast, "TryStar"):
    _REFUSED_NODES[ast.TryStar] = "try/except*"


class SubsetError(Exception):
    """A construct the NKI compiler would refuse; the message names it, the function and the line."""


def _is_nki_module(mod: types.ModuleType) -> bool:
    return mod.__name__ == "nki" or mod.__name__.startswith("nki.")


def _constant_ok(value) -> str | None:
    """None if `value` is a compile-time constant NKI can hold, else why not."""
    if value is None or isinstance(value, (bool, str)):
        return None
    if isinstance(value, int):
        return None if INT32[0] <= value < INT32[1] else f"the integer {value} does not fit NKI's 32-bit integers"
    if isinstance(value, float):
        return None if abs(value) <= FLT_MAX or value != value or abs(value) == float("inf") else \
            f"the float {value!r} is not a 32-bit float"
    if isinstance(value, tuple):
        for v in value:
            why = _constant_ok(v)
            if why:
                return why
        return None
    if isinstance(value, enum.Enum):
        return None
    return f"a {type(value).__name__} object (a mutable or non-NKI value: the kernel cache would not see it change)"


class _Checker:
    def __init__(self):
        self.seen: set[int] = set()

    def function(self, fn, via: str) -> None:
        code = getattr(fn, "__code__", None)
        if code is None or id(code) in self.seen:
            return
        self.seen.add(id(code))
        name = getattr(fn, "__qualname__", fn.__name__)
        try:
            source = textwrap.dedent(inspect.getsource(fn))
        except (OSError, TypeError) as e:
            raise SubsetError(f"{name}: its source is needed to compile it ({e})") from None
        tree = ast.parse(source)
        fdef = tree.body[0]
        if not isinstance(fdef, ast.FunctionDef):
            raise SubsetError(f"{name}: not a plain function definition")
        where = f"{name} ({inspect.getsourcefile(fn)}:{code.co_firstlineno})"
        for d in fdef.args.defaults + [d for d in fdef.args.kw_defaults if d is not None]:
            self._literal_default(d, where)
        closure = dict(zip(code.co_freevars, [c.cell_contents for c in (fn.__closure__ or ())]))
        for var, value in closure.items():
            self._value(value, f"{where}: the closure variable {var!r}", fn)
        self._body(fdef, fn, where)

    def klass(self, cls, where: str) -> None:
        if id(cls) in self.seen:
            return
        self.seen.add(id(cls))
        if issubclass(cls, enum.Enum):
            return
        bases = [b.__name__ for b in cls.__bases__]
        if bases != ["NKIObject"]:
            raise SubsetError(f"{where}: class {cls.__qualname__} must derive from NKIObject and nothing else "
                              f"(it derives from {', '.join(bases)})")
        for attr in vars(cls).values():
            if isinstance(attr, (staticmethod, classmethod)):
                attr = attr.__func__
            if isinstance(attr, property):
                attr = attr.fget
            # (not what @dataclass generates, __init__ / __repr__ / __eq__: NKI makes its own initialisers)
            if inspect.isfunction(attr) and attr.__code__.co_filename == inspect.getsourcefile(cls):
                self.function(attr, where)

    def _literal_default(self, node, where: str) -> None:
        try:
            value = ast.literal_eval(node)
        except ValueError:
            raise SubsetError(f"{where}: a default argument must be a constant, got {ast.unparse(node)}") from None
        why = _constant_ok(value)
        if why:
            raise SubsetError(f"{where}: default argument {ast.unparse(node)}: {why}")

    def _value(self, value, what: str, fn) -> None:
        """A global or closure value the kernel code reads."""
        if isinstance(value, types.ModuleType):
            return
        if inspect.isfunction(value):
            self.function(value, what)
            return
        if inspect.isclass(value):
            mod = inspect.getmodule(value)
            if mod is not None and _is_nki_module(mod):
                return
            self.klass(value, what)
            return
        if callable(value) and getattr(value, "__module__", "") and (
                value.__module__ == "nki" or value.__module__.startswith("nki.")):
            return                                           # an nki API object (dtype, buffer, op, jit kernel)
        if type(value).__module__.startswith(("nki", "numpy", "ml_dtypes")) and not isinstance(value, (list, dict)):
            return                                           # nl dtypes / buffers / ops and numpy dtypes they are
        why = _constant_ok(value)
        if why:
            raise SubsetError(f"{what}: {why}")

    def _body(self, fdef: ast.FunctionDef, fn, where: str) -> None:
        globs = fn.__globals__
        local = {a.arg for a in fdef.args.args + fdef.args.kwonlyargs}
        if fdef.args.vararg:
            local.add(fdef.args.vararg.arg)
        if fdef.args.kwarg:
            local.add(fdef.args.kwarg.arg)
        for node in ast.walk(fdef):
            if isinstance(node, (ast.Name,)) and isinstance(node.ctx, (ast.Store, ast.Del)):
                local.add(node.id)
            elif isinstance(node, ast.arg):
                local.add(node.arg)
        for node in ast.walk(fdef):
            line = f"{where}, line {fn.__code__.co_firstlineno + getattr(node, 'lineno', 1) - 1}"
            if type(node) in _REFUSED_NODES:
                raise SubsetError(f"{line}: {_REFUSED_NODES[type(node)]} is not NKI (the compiler parses kernels; "
                                  "write a plain loop)")
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node is not fdef:
                raise SubsetError(f"{line}: a nested {'function' if isinstance(node, ast.FunctionDef) else 'class'}"
                                  f" {node.name!r} (a closure) is not NKI: define it at module level")
            if isinstance(node, ast.Compare):
                for op in node.ops:
                    if isinstance(op, (ast.Is, ast.IsNot)):
                        raise SubsetError(f"{line}: '{'is' if isinstance(op, ast.Is) else 'is not'}' is not NKI "
                                          "(listed as unsupported by the NKI migration guide): compare with == or "
                                          "pass a flag")
            if isinstance(node, ast.Constant):
                why = _constant_ok(node.value) if not isinstance(node.value, bytes) else "a bytes literal"
                if why:
                    raise SubsetError(f"{line}: {why}")
            if isinstance(node, ast.Dict):
                for k in node.keys:
                    if k is None or not (isinstance(k, ast.Constant) and isinstance(k.value, str)):
                        raise SubsetError(f"{line}: NKI dicts take string keys only")
            if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) and node.id not in local:
                self._name(node.id, globs, fn, line)
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
                self._attribute(node, globs, local, fn, line)

    def _name(self, name: str, globs: dict, fn, line: str) -> None:
        closure = dict(zip(fn.__code__.co_freevars, [c.cell_contents for c in (fn.__closure__ or ())]))
        if name in closure:
            return                                           # checked with the function
        if name in globs:
            self._value(globs[name], f"{line}: the global {name!r}", fn)
            return
        builtins = globs.get("__builtins__")
        builtins = builtins if isinstance(builtins, dict) else vars(builtins)
        if name in builtins:
            if name in ALLOWED_BUILTINS or name in ("True", "False", "None"):
                return
            if isinstance(builtins[name], type) and issubclass(builtins[name], BaseException):
                return                                       # raise ValueError(...): a compile-time error
            raise SubsetError(f"{line}: the builtin {name}() is not part of NKI's meta-programming language "
                              f"(allowed: {', '.join(sorted(ALLOWED_BUILTINS))})")
        raise SubsetError(f"{line}: {name!r} is not defined")

    def _attribute(self, node: ast.Attribute, globs: dict, local: set, fn, line: str) -> None:
        """mod.fn where mod is an imported module outside nki: the function is kernel code too."""
        if not isinstance(node.value, ast.Name) or node.value.id in local:
            return
        mod = globs.get(node.value.id)
        if not isinstance(mod, types.ModuleType):
            return
        if _is_nki_module(mod):
            return
        if not hasattr(mod, node.attr):
            raise SubsetError(f"{line}: {node.value.id}.{node.attr} does not exist")
        value = getattr(mod, node.attr)
        if isinstance(value, types.ModuleType):
            return
        if mod.__name__.split(".")[0] in ("numpy", "math", "jax", "ml_dtypes", "os", "sys") and callable(value):
            raise SubsetError(f"{line}: {mod.__name__}.{node.attr} is host Python; a kernel cannot call "
                              f"{mod.__name__}")
        self._value(value, f"{line}: {node.value.id}.{node.attr}", fn)


_CHECKED: dict[int, object] = {}      # id -> the code object itself (held, so an id is never reused)


def check_kernel(fn) -> None:
    """Raise SubsetError if `fn` (or anything it calls) leaves the NKI meta-programming language; each function is
    checked once per process."""
    code = getattr(fn, "__code__", None)
    if code is not None and id(code) in _CHECKED:
        return
    _Checker().function(fn, getattr(fn, "__qualname__", repr(fn)))
    if code is not None:
        _CHECKED[id(code)] = code
