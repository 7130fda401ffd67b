"""`glassformer serve`: a checkpoint behind an OpenAI-compatible HTTP API, with continuous batching.

The server listens first (GET /health answers 503 "loading"), then starts the engine (by default
in a process of its own, which loads the model: serve/worker.py; --engine thread or --explorer: on
a thread of this one) and prints one line, `serving MODEL_ID at http://HOST:PORT/v1` (with --explorer and a key,
a second: the page's keyed URL). Ctrl-C (or SIGTERM) stops
it: running answers get a few seconds to finish. A watchdog (serve/supervisor.py) restarts an engine
that dies, once; if it dies again the server exits with status 1 and one line on stderr.
docs/serve.md.
"""

from __future__ import annotations

from .access import KEY_ENV, add_access_arguments, allowed_hosts, api_key  # noqa: F401 (KEY_ENV, api_key: this verb's too)
from .options import add_base_argument, add_device_argument, add_quantize_argument
from .steer import add_steer_argument

HELP = "serve a checkpoint over an OpenAI-compatible HTTP API (continuous batching)"


def add_arguments(p) -> None:
    from ..serve.supervisor import STALL_TIMEOUT
    from ..serve.worker import STREAM_INTERVAL

    p.add_argument("--checkpoint", required=True, metavar="CKPT",
                   help="checkpoint, training run or Hugging Face folder, or a Hub name org/name[@revision]")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on; anything but loopback needs an API key (or --insecure-no-key)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (0: any free port; the ready line names it)")
    p.add_argument("--model-name", default=None, help="the model id clients name (default: the checkpoint folder's name)")
    p.add_argument("--max-batch", type=int, default=8, help="requests decoded together in one batched forward")
    p.add_argument("--max-queue", type=int, default=64, help="requests waiting for a row; one more gets 429")
    p.add_argument("--prefill-chunk", type=int, default=256,
                   help="prompt tokens fed per step, so running streams keep a bounded gap between tokens")
    p.add_argument("--limit-concurrency", type=int, default=None, help="requests answered at once; one more gets 503")
    add_access_arguments(p)
    p.add_argument("--cors-origin", action="append", default=[], metavar="ORIGIN",
                   help="let web pages from ORIGIN call the API (repeatable; default: none)")
    p.add_argument("--explorer", action="store_true",
                   help="serve the explorer page (glassformer view) in the same app (runs the thread engine)")
    p.add_argument("--engine", choices=["process", "thread"], default=None,
                   help="where the model runs: 'process' (default) a process of its own, so HTTP work never waits "
                        "on the forward's interpreter lock; 'thread' a thread of the server's process (what "
                        "--explorer runs, its traces taking turns with the engine on the one model)")
    p.add_argument("--stream-interval-ms", type=float, default=STREAM_INTERVAL * 1e3, metavar="MS",
                   help="the engine's process sends the tokens it made at most every MS milliseconds (default "
                        "%(default)g; a request's first token and its last at once; 0: every step): "
                        "docs/serve.md#the-engines-process")
    p.add_argument("--stall-timeout", type=float, default=STALL_TIMEOUT, metavar="S",
                   help="GET /health answers 503 'stalled' (and new completions 503) when requests are waiting and "
                        "no engine step finished for S seconds (default %(default)g): docs/serve.md#supervision")
    p.add_argument("--compile", action="store_true", help="compile the decode step with torch.compile")
    p.add_argument("--threads", type=int, default=0,
                   help="the engine's torch threads on the CPU (0: as OMP_NUM_THREADS says if set, else one less than "
                        "torch's count, at least 1, so the HTTP side keeps a core: docs/serve.md#threads)")
    add_device_argument(p)
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                   help="weights' dtype (default: as stored)")
    add_quantize_argument(p, "decode")
    add_base_argument(p)
    add_steer_argument(p)


def model_id(args) -> str:
    """--model-name, else the checkpoint folder's name (a Hub name as given)."""
    from pathlib import Path

    if args.model_name:
        return args.model_name
    path = Path(args.checkpoint)
    return path.resolve().name if path.exists() else str(args.checkpoint)


def _check(args) -> None:
    from ..errors import UserError
    from ..devices import resolve_device
    from ..serve.worker import MAX_STREAM_INTERVAL
    from .options import quantize_method

    for flag in ("max_batch", "max_queue", "prefill_chunk"):
        if getattr(args, flag) < 1:
            raise UserError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if args.limit_concurrency is not None and args.limit_concurrency < 1:
        raise UserError(f"--limit-concurrency must be >= 1, got {args.limit_concurrency}")
    if not 0 <= args.port <= 65535:
        raise UserError(f"--port must be in 0..65535, got {args.port}")
    if not 0 <= args.stream_interval_ms <= MAX_STREAM_INTERVAL * 1e3:
        raise UserError(f"--stream-interval-ms must be between 0 and {MAX_STREAM_INTERVAL * 1e3:g}, "
                        f"got {args.stream_interval_ms:g}")
    if args.threads < 0:
        raise UserError(f"--threads must be >= 1 (or 0 for the default), got {args.threads}")
    if not args.stall_timeout > 0:  # (NaN too)
        raise UserError(f"--stall-timeout must be > 0 seconds, got {args.stall_timeout:g}")
    quantize_method(args)  # a bad --quantize fails before anything listens
    allowed_hosts(args)  # and a bad --allowed-host
    resolve_device(args.device)  # and a GPU that is not here
    if args.explorer and args.engine == "process":
        raise UserError("--explorer runs the engine on a thread (the explorer's traces and the engine take turns "
                        "on the one model in one process): leave out --engine process, or --explorer")


def engine_threads(requested: int, count: int, from_env: bool) -> int:
    """The engine's torch threads: `requested` (--threads) if given; else `count` (torch's now) when the
    environment set it (OMP_NUM_THREADS); else one less, at least 1. On the CPU the HTTP side (the
    server's threads, and often the client's) needs a core too: a forward whose threads fill every
    core waits at each of its operations for the thread the HTTP work preempted (measured:
    bench/serve.py --threads, docs/serve.md#threads).

    >>> [engine_threads(3, 16, False), engine_threads(0, 16, True), engine_threads(0, 16, False),
    ...  engine_threads(0, 1, False)]
    [3, 16, 15, 1]
    """
    if requested:
        return requested
    return count if from_env else max(1, count - 1)


def build(args, backend, key):
    """The app (serve.http's base with the OpenAI routes) and its server, bound now."""
    from ..serve.http import Limits, Server, make_app
    from ..serve.openai import add_routes, openai_error

    limits = Limits(limit_concurrency=args.limit_concurrency)
    app = make_app(host=args.host, port=args.port, api_key=key, cors_origins=args.cors_origin, limits=limits,
                   error_body=openai_error, allowed_hosts=allowed_hosts(args))
    add_routes(app, backend)
    return app, Server(app, args.host, args.port, limits)


def _sizes(args) -> dict:
    return dict(max_batch=args.max_batch, max_queue=args.max_queue, prefill_chunk=args.prefill_chunk,
                compile=args.compile)


def _process_engine(args, backend, loop) -> object:
    """The engine in a process of its own (serve/worker.py), loading the checkpoint there through the same
    `_load_model`, with this process's torch threads; the backend is ready once it has loaded. Its
    messages are read on the HTTP server's `loop` (no reader thread between the two)."""
    import argparse
    import functools
    from types import SimpleNamespace

    from ..serve.worker import ProcessEngine
    from .generate import _load_model

    options = argparse.Namespace(**{k: v for k, v in vars(args).items() if not callable(v)})  # (picklable)
    engine = ProcessEngine(functools.partial(_load_model, options), **_sizes(args),
                           stream_interval=args.stream_interval_ms / 1e3).start(loop=loop)
    try:
        engine.wait_ready()
    except BaseException:
        engine.stop()
        raise
    backend.ready(engine, SimpleNamespace(config=engine.config), engine.tokenizer)
    return engine


def _thread_engine(args, app, model, tok, name: str):
    """The engine on a thread; with --explorer its steps and the explorer's traces take turns on the one
    model (a trace sets the model's mode and attention kernel for its forward, which a decode step
    must not run under)."""
    from ..generation.batching import Engine
    from ..serve.backend import TurnTakingEngine

    sizes = _sizes(args)
    if not args.explorer:
        return Engine(model, **sizes).start()
    from ..viewer.server import explorer_router
    from ..viewer.source import explorer
    from .view import DEFAULT_TEXT

    ex = explorer(model, tok, DEFAULT_TEXT, model_name=name)
    app.include_router(explorer_router(ex))
    return TurnTakingEngine(model, ex.lock, **sizes).start()


def run(args) -> int:
    import os
    import signal
    import sys
    import threading

    import torch

    from ..serve.backend import Backend
    from ..serve.http import keyed_url
    from ..serve.supervisor import Supervisor
    from .generate import _load_model

    key = api_key(args)
    _check(args)
    args.attention = None
    if args.device == "cpu":  # the engine's threads (the thread engine's, and the process engine's child's)
        from_env = bool(os.environ.get("OMP_NUM_THREADS"))
        torch.set_num_threads(engine_threads(args.threads, torch.get_num_threads(), from_env))
    backend = Backend(model_id(args))
    backend.steered = bool(args.steer)  # a request's "steer" scales these vectors; without any it is refused
    app, server = build(args, backend, key)
    server.start_in_thread()  # /health says "loading" meanwhile
    engine = supervisor = None
    died, dead = [], threading.Event()  # the supervisor's one line, if the engine died past its restart
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):  # both stop it as Ctrl-C does (also when started in the background)
            signal.signal(sig, signal.default_int_handler)
    try:
        if (args.engine or ("thread" if args.explorer else "process")) == "process":
            engine = _process_engine(args, backend, server.loop)
        else:
            model, tok = _load_model(args)
            engine = _thread_engine(args, app, model, tok, backend.model_id)
            backend.ready(engine, model, tok)
        supervisor = Supervisor(backend, stall_timeout=args.stall_timeout,
                                on_fatal=lambda message: (died.append(message), dead.set())).start()
        print(f"serving {backend.model_id} at {server.url}/v1", flush=True)
        if args.explorer and key is not None:  # the page's address, as a browser opens it once (docs/viewer.md)
            print(f"explorer at {keyed_url(server.url + '/', key)}", flush=True)
        dead.wait()  # until Ctrl-C, or the engine dies past its restart (then exit non-zero)
    except KeyboardInterrupt:
        pass
    finally:
        backend.status = "stopping"
        if supervisor is not None:
            supervisor.stop()
        server.stop()
        if engine is not None:
            backend.engine.stop()  # (a restarted engine, if the first died)
    if died:
        print(f"error: {died[0]}", file=sys.stderr)
        return 1
    return 0
