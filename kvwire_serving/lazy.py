"""A servicer that exists before its model does.

gRPC's aio server takes no new services once started, yet health must answer NOT_SERVING while
the model loads; so the service is registered as a ``Lazy`` proxy first and ``set`` once ready.
Calls that arrive before then fail with UNAVAILABLE instead of hanging.
"""
from __future__ import annotations

import inspect

from kvwire.errors import Unavailable


def _unavailable(name: str) -> Unavailable:
    return Unavailable(f"{name} is still loading its model; retry when its health check says SERVING")


class Lazy:
    def __init__(self, servicer_cls: type, name: str):
        self._target = None
        for method, fn in inspect.getmembers(servicer_cls, inspect.isfunction):
            if method[:1].isupper():  # RPC methods are CamelCase
                setattr(self, method, self._forward(method, fn, name))

    def set(self, servicer) -> None:
        self._target = servicer

    def _forward(self, method: str, fn, name: str):
        if inspect.isasyncgenfunction(fn):
            async def stream(request, context):
                if self._target is None:
                    raise _unavailable(name)
                async for response in getattr(self._target, method)(request, context):
                    yield response
            return stream

        async def unary(request, context):
            if self._target is None:
                raise _unavailable(name)
            return await getattr(self._target, method)(request, context)
        return unary
