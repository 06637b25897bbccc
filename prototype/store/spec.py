"""`open_store(spec)`: a response store from a command-line string."""

from __future__ import annotations

import urllib.parse

from .base import ResponseStore
from .memory import MemoryStore
from .redis import RedisStore
from .sqlite import SqliteStore

__all__ = ["open_store"]


_ACCEPTED_SPECS = "'memory', 'sqlite:PATH', 'redis://HOST:PORT[/DB]'"


def _bad_spec(spec: str, why: str) -> ValueError:
    return ValueError(f"invalid store spec {spec!r}: {why}; accepted forms are {_ACCEPTED_SPECS}")


def open_store(spec: str) -> ResponseStore:
    """Build a store from a command-line spec.

    * `memory` -- `MemoryStore()` with default bounds;
    * `sqlite:PATH` -- `SqliteStore(PATH)`, PATH taken verbatim (relative paths
      are relative to the working directory); the file is opened now;
    * `redis://HOST:PORT[/DB]` -- `RedisStore(url)`; credentials
      (`redis://:PASSWORD@HOST:PORT`) are allowed, query options are not (the
      store sets its own timeouts and retries). No connection is made yet.

    Anything else raises `ValueError` naming the accepted forms."""
    if spec == "memory":
        return MemoryStore()
    if spec.startswith("sqlite:"):
        path = spec.removeprefix("sqlite:")
        if not path:
            raise _bad_spec(spec, "sqlite needs a file path")
        return SqliteStore(path)
    if spec.startswith("redis://"):
        parts = urllib.parse.urlsplit(spec)
        try:
            port = parts.port
        except ValueError as exc:
            raise _bad_spec(spec, f"bad port ({exc})") from exc
        if not parts.hostname:
            raise _bad_spec(spec, "redis needs a host")
        if port is None:
            raise _bad_spec(spec, "redis needs a port")
        db = parts.path.removeprefix("/")
        if db and not db.isdecimal():
            raise _bad_spec(spec, f"redis database must be a number, got {db!r}")
        if parts.query or parts.fragment:
            raise _bad_spec(spec, "query options and fragments are not supported")
        return RedisStore(spec)
    raise _bad_spec(spec, "unrecognised store kind")
