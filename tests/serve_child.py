"""A server process for test_serve_shutdown.py: the real app, runner thread and `run_server` (uvicorn with
the drain-on-signal policy) over test_serve_tools' scripted engine, held busy (requests never finish on
their own), on 127.0.0.1. argv: PORT DRAIN_TIMEOUT_S."""

from __future__ import annotations

import logging
import sys
import types

from dsv3_jax.engine.api import EngineConfig
from dsv3_jax.serve.__main__ import run_server
from dsv3_jax.serve.app import ServerOptions, Service, create_app
from dsv3_jax.serve.metrics import Metrics
from dsv3_jax.serve.runner import EngineRunner
from dsv3_jax.text.tokenizer import Tokenizer
from tests.test_serve_tools import ScriptedEngine


def main() -> int:
    port, drain = int(sys.argv[1]), float(sys.argv[2])
    logging.basicConfig(level="INFO", format="%(levelname)s %(name)s: %(message)s")
    tok = Tokenizer.default()
    handle = types.SimpleNamespace(
        tokenizer=tok, generation_defaults={},
        config=types.SimpleNamespace(max_position_embeddings=4096, vocab_size=tok.vocab_size,
                                     bos_token_id=tok.bos_id),
        eos_ids=lambda: [tok.eos_id])
    ScriptedEngine.hold = True
    metrics = Metrics("scripted")
    runner = EngineRunner(handle, EngineConfig(num_pages=64, max_batch=4), max_pending=8, metrics=metrics,
                          engine_factory=ScriptedEngine)
    runner.start()
    app = create_app(Service(handle, runner, metrics, "scripted", options=ServerOptions(("scripted",))))
    return run_server(app, runner, host="127.0.0.1", port=port, drain_timeout=drain, log_level="info")


if __name__ == "__main__":
    sys.exit(main())
