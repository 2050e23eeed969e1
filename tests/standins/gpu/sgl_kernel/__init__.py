"""Test-only stand-in for the ``sgl_kernel`` package (see ../README.md).

Importing any ``sgl_kernel.<sub>`` module works; any attribute other than the
two direct kvcacheio ops is a function that raises when called, so a test that
reaches a real CUDA kernel fails loudly instead of computing something else.
"""

import importlib.abc
import importlib.machinery
import sys
import types

__version__ = "0.4.10+standin"
STANDIN = True


class _Stub:
    """Any missing kernel, constant or submodule attribute: attribute access and
    indexing give further stubs (module-level tables import fine); calling one
    raises."""

    def __init__(self, qualname):
        self._qualname = qualname

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Stub(f"{self._qualname}.{name}")

    def __getitem__(self, key):
        return _Stub(f"{self._qualname}[{key!r}]")

    def __call__(self, *args, **kwargs):
        raise NotImplementedError(
            f"{self._qualname} is not provided by the test-only sgl_kernel stand-in"
        )

    def __repr__(self):
        return f"<sgl_kernel stand-in {self._qualname}>"


def missing_op(qualname):
    return _Stub(qualname)


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    return missing_op(f"sgl_kernel.{name}")


class _StubModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return missing_op(f"{self.__name__}.{name}")


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path, target=None):
        if fullname.startswith("sgl_kernel.") and fullname != "sgl_kernel.kvcacheio":
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _StubModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        pass


sys.meta_path.append(_Finder())
