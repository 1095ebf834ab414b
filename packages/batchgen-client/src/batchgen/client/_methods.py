"""How the clients' public methods are made: a builder both faces share, and a runner per face.

A builder (`_requests.create_batch`, `_wait.wait_for_batch`, `_submit.submit_batch`, …) is a
method's one definition: its parameters, their defaults, its docstring, and turning the arguments
into what to send (a `RequestSpec`, or the plan of several requests: `Wait`, `Following`,
`Submission`, `Download`). It does no network I/O. A runner is a face's private method that sends
it (`_call`, `_wait`, `_submit`, …).

    create_batch = method(req.create_batch, _call)            # in BatchGenHttpClient
    create_batch = async_method(req.create_batch, _call)      # in AsyncBatchGenClient

`method` makes a plain method and `async_method` a coroutine method, each with the builder's
name, docstring and parameters (for type checkers through the ParamSpec, for `inspect`, `help`
and editors through `__signature__`), and the runner's return annotation.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, Concatenate, ParamSpec, TypeVar

__all__ = ["async_method", "method"]

P = ParamSpec("P")
Plan = TypeVar("Plan")
Face = TypeVar("Face")
Result = TypeVar("Result")


def method(
    build: Callable[P, Plan], run: Callable[[Face, Plan], Result]
) -> Callable[Concatenate[Face, P], Result]:
    """`run(self, build(...))` as a method taking `build`'s parameters."""

    def call(self: Face, /, *args: P.args, **kwargs: P.kwargs) -> Result:
        return run(self, build(*args, **kwargs))

    _present(call, build, run)
    return call


def async_method(
    build: Callable[P, Plan], run: Callable[[Face, Plan], Awaitable[Result]]
) -> Callable[Concatenate[Face, P], Coroutine[Any, Any, Result]]:
    """`await run(self, build(...))` as a coroutine method taking `build`'s parameters. The
    builder runs when the coroutine does, as the body of an `async def` would."""

    async def call(self: Face, /, *args: P.args, **kwargs: P.kwargs) -> Result:
        return await run(self, build(*args, **kwargs))

    _present(call, build, run)
    return call


def _present(call: Callable[..., Any], build: Callable[..., Any], run: Callable[..., Any]) -> None:
    """Give `call` the name, docstring and signature of a method of `run`'s class."""
    signature = inspect.signature(build)
    this = inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)
    returns = inspect.signature(run).return_annotation
    call.__name__ = build.__name__
    call.__qualname__ = f"{run.__qualname__.rpartition('.')[0]}.{build.__name__}"
    call.__module__ = run.__module__
    call.__doc__ = build.__doc__
    call.__signature__ = signature.replace(  # type: ignore[attr-defined]
        parameters=[this, *signature.parameters.values()], return_annotation=returns
    )
