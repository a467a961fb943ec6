"""`BrokerClient`: the async client's methods for threads and synchronous code.

Rules:
- One private event loop per `BrokerClient`, in a daemon thread started on the first call
  (asyncio, through an anyio `BlockingPortal`). Every method hands its coroutine to that
  loop and waits for it, so a call works from any thread: plain threads, many at once
  (their calls run concurrently on the one loop), and a thread that is itself running an
  asyncio or trio loop (the call blocks that loop for its duration, as any blocking call
  does; async code should use `AsyncBrokerClient` instead). It never nests an event loop
  in the caller's thread, which is what `asyncio.run`/`trio.run` per call would do and
  what a running loop refuses.
- Arguments, answers and exceptions are exactly `AsyncBrokerClient`'s: the methods are
  generated from it (`_blocking`), so the two cannot drift apart.
- `close()` (or `with BrokerClient(...)`) stops the loop; an unclosed client's loop is
  stopped when the client is collected or at interpreter exit, and its thread is a daemon
  so it can never hold the process open.
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Awaitable, Callable, Mapping
from concurrent.futures import Future
from typing import Concatenate, ParamSpec, TypeVar

import anyio
from anyio.from_thread import BlockingPortal

from buzzwire.contract import Request

from .client import AsyncBrokerClient, EventVerification, RetryPolicy, _new_request_id

__all__ = ["BrokerClient"]

P = ParamSpec("P")
R = TypeVar("R")


class _Loop:
    """A private event loop in a daemon thread, reached through a blocking portal."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._portal: BlockingPortal | None = None
        self._thread: threading.Thread | None = None

    def portal(self) -> BlockingPortal:
        with self._lock:
            if self._portal is None:
                started: Future[BlockingPortal] = Future()
                self._thread = threading.Thread(
                    target=anyio.run, args=(self._serve, started), name="buzz-broker-client",
                    daemon=True,
                )
                self._thread.start()
                self._portal = started.result()
            return self._portal

    @staticmethod
    async def _serve(started: Future[BlockingPortal]) -> None:
        async with BlockingPortal() as portal:
            started.set_result(portal)
            await portal.sleep_until_stopped()

    def stop(self) -> None:
        with self._lock:
            portal, thread = self._portal, self._thread
            self._portal = self._thread = None
        if portal is not None and thread is not None:
            if thread is threading.current_thread():  # pragma: no cover - collected on its own loop
                return
            # cancel_remaining: a call still waiting in another thread gets CancelledError
            # rather than hanging on a loop that is gone.
            try:
                portal.call(portal.stop, True)
            except RuntimeError:  # pragma: no cover - the loop already ended (interpreter exit)
                pass
            thread.join()


def _blocking(
    method: Callable[Concatenate[AsyncBrokerClient, P], Awaitable[R]],
) -> Callable[Concatenate[BrokerClient, P], R]:
    """The blocking twin of an `AsyncBrokerClient` method: the same code on the private loop."""

    @functools.wraps(method)
    def run(self: BrokerClient, /, *args: P.args, **kwargs: P.kwargs) -> R:
        call: Callable[[], Awaitable[R]] = functools.partial(method, self._client, *args, **kwargs)
        return self._loop.portal().call(call)

    return run


class BrokerClient:
    """The same client for threads and synchronous code.

    Arguments and answers are exactly `AsyncBrokerClient`'s (address and credential
    default from the environment the same way). Usable from any thread, concurrently;
    see the module docstring for calls made from a thread running an event loop.

    Every operation method (`call`, `send`, `channel_read`, `read_all`, `message_post`,
    `message_reply`, `reaction_add`, `profile_set`, `storage_address`, `storage_get`,
    `storage_put`, `presence_set`, `typing_set`, `observer_emit`, `liveness_ping`,
    `agents_create`, `agents_update`, `agents_delete`) is the `AsyncBrokerClient` method
    of that name, run to completion on the private loop: the same arguments, answer,
    exceptions and docstring.
    """

    def __init__(
        self,
        address: str | None = None,
        credential: str | None = None,
        *,
        credential_file: str | None = None,
        retry: RetryPolicy = RetryPolicy(),
        events: EventVerification = EventVerification.VERIFY,
        agent_pubkey: str | None = None,
        new_request_id: Callable[[], str] = _new_request_id,
    ) -> None:
        try:
            self._client = AsyncBrokerClient(
                address, credential, credential_file=credential_file, retry=retry,
                events=events, agent_pubkey=agent_pubkey, new_request_id=new_request_id,
            )
        finally:
            # This frame is on the traceback of what that raises: see its own `__init__`.
            del credential
        self._loop = _Loop()
        self._finalizer = weakref.finalize(self, self._loop.stop)

    def __repr__(self) -> str:
        # An `__init__` that raised leaves no `_client`, and a crash reporter that renders
        # traceback locals calls this on the half-built `self` in that frame: raising here
        # would cost the agent that report.
        client: AsyncBrokerClient | None = getattr(self, "_client", None)
        where = repr(client._endpoint.describe()) if client is not None else "<not constructed>"
        return f"BrokerClient({where}, credential=<redacted>)"

    def close(self) -> None:
        """Stop the private loop (it starts again on the next call).

        A call still waiting in another thread gets `CancelledError`.

        Returns:
            None.
        """
        self._loop.stop()

    def __enter__(self) -> BrokerClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def freeze(self, action: str, args: Mapping[str, object], request_id: str | None = None) -> Request:
        """Validate and normalize a request without sending it (`AsyncBrokerClient.freeze`).

        Args:
            action: the wire name, e.g. `"message.post"`.
            args: the argument object with its wire names.
            request_id: the idempotency key; default a fresh one.

        Returns:
            The frozen `Request`.

        Raises:
            ContractError: unknown action (reserved names included) or bad arguments.
        """
        return self._client.freeze(action, args, request_id)

    call = _blocking(AsyncBrokerClient.call)
    send = _blocking(AsyncBrokerClient.send)
    channel_read = _blocking(AsyncBrokerClient.channel_read)
    read_all = _blocking(AsyncBrokerClient.read_all)
    message_post = _blocking(AsyncBrokerClient.message_post)
    message_reply = _blocking(AsyncBrokerClient.message_reply)
    reaction_add = _blocking(AsyncBrokerClient.reaction_add)
    profile_set = _blocking(AsyncBrokerClient.profile_set)
    storage_address = _blocking(AsyncBrokerClient.storage_address)
    storage_get = _blocking(AsyncBrokerClient.storage_get)
    storage_put = _blocking(AsyncBrokerClient.storage_put)
    agents_create = _blocking(AsyncBrokerClient.agents_create)
    agents_update = _blocking(AsyncBrokerClient.agents_update)
    agents_delete = _blocking(AsyncBrokerClient.agents_delete)
    presence_set = _blocking(AsyncBrokerClient.presence_set)
    typing_set = _blocking(AsyncBrokerClient.typing_set)
    observer_emit = _blocking(AsyncBrokerClient.observer_emit)
    liveness_ping = _blocking(AsyncBrokerClient.liveness_ping)
