"""Where ``FastServeLLMServer`` used to live: it is ``app.server.llm_server`` now.

A Ray Serve LLM config whose ``server_cls`` still says ``app.llm_server:FastServeLLMServer``
loads the class from here for one release, with a ``DeprecationWarning`` and a logged message
(a Serve replica's warnings reach only its log); then this module goes, as the engine
deployment's former name ``Scheduler`` does (``app.main``).
"""

from __future__ import annotations

import logging
import warnings

from app.server.llm_server import FastServeEngine, FastServeLLMServer

__all__ = ["FastServeEngine", "FastServeLLMServer"]

MOVED = ("app.llm_server is deprecated: FastServeLLMServer moved to app.server.llm_server. Set "
         "server_cls: app.server.llm_server:FastServeLLMServer; the old path is accepted for one "
         "release and then refused.")

warnings.warn(MOVED, DeprecationWarning, stacklevel=2)
logging.getLogger(__name__).warning(MOVED)
