"""The server process: command line, model loading, and the event loop that serves until SIGTERM.

Design decisions
- The command line is built from `EmbeddedServerConfig`'s fields (flag, type, default, choices and help), so the
  config, the launcher (`EmbeddedServerConfig.cli_args()`) and this parser cannot disagree about an option. Only
  what belongs to one launch rather than to a config (host, port, the sampling seed) is declared here.
- Bind first, load second: the port answers (503 on /health) while the model loads, so a launcher sees "loading"
  rather than "connection refused" and can tell a slow start from a crash.
- The model loads on a daemon thread, not the default executor: a SIGTERM during a long load must not wait for it.
- `--return-original-logprob` is also turned on by SGLang's environment variable `SGLANG_RETURN_ORIGINAL_LOGPROB`,
  so a setup written for SGLang behaves the same here.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import signal
import socket
import sys
import threading
import time
import traceback
import types
import typing
from typing import Any, Optional

from areal_lite.api.cli_args import EmbeddedServerConfig

log = logging.getLogger("areal_lite.kit.server")  # one logger for the server

DESCRIPTION = "A small SGLang-compatible generation server: continuous batching with a KV cache, on CPU or one GPU."
# Fields the server cannot run without; the config leaves them empty for the launcher to fill in.
REQUIRED_FIELDS = {"model_path": "model folder, alias (smollm2-135m-instruct) or hub id"}


def _add_config_option(parser: argparse.ArgumentParser, f: dataclasses.Field, tp: Any) -> None:
    """`--the-field-name` for one `EmbeddedServerConfig` field, typed from its annotation."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        # Optional[X] -> X: None is written as no flag at all, so the (None) default applies
        (tp,) = [a for a in typing.get_args(tp) if a is not type(None)]
    kwargs: dict[str, Any] = {"help": f.metadata.get("help", "")}
    if "choices" in f.metadata:
        kwargs["choices"] = f.metadata["choices"]
    if tp is bool:
        kwargs["action"] = argparse.BooleanOptionalAction  # --flag / --no-flag, as cli_args() writes them
    elif tp in (int, float, str):
        kwargs["type"] = tp
    else:
        raise TypeError(f"EmbeddedServerConfig.{f.name}: type {tp} has no command-line form (use int, float, str)")
    if f.name in REQUIRED_FIELDS:
        kwargs.update(required=True, default=argparse.SUPPRESS, help=REQUIRED_FIELDS[f.name])
    elif f.default is dataclasses.MISSING:
        raise TypeError(f"EmbeddedServerConfig.{f.name}: a server option needs a plain default")
    else:
        kwargs["default"] = f.default
    parser.add_argument("--" + f.name.replace("_", "-"), **kwargs)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m areal_lite.kit.server",
        description=DESCRIPTION,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    hints = typing.get_type_hints(EmbeddedServerConfig)
    for f in dataclasses.fields(EmbeddedServerConfig):
        _add_config_option(p, f, hints[f.name])
    # Per launch, not per config: the launcher picks a free port and passes the experiment's seed.
    p.add_argument("--host", default="127.0.0.1", help="address to bind (the default is loopback only)")
    p.add_argument("--port", type=int, default=30000, help="port to bind")
    p.add_argument(
        "--random-seed",
        type=int,
        default=1,
        help="seed of the server's sampling (each row's random stream is derived from it)",
    )
    # The launcher's pid: exit when it dies (the no-orphan fallback where the kernel cannot signal us, see procs).
    p.add_argument("--exit-with-parent", type=int, default=None, help=argparse.SUPPRESS)
    # The launcher's listening socket, inherited: serve on it instead of binding --host/--port (see procs).
    p.add_argument("--listen-fd", type=int, default=None, help=argparse.SUPPRESS)
    return p


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    from areal_lite.utils.device import DEVICE_CHOICES, is_device_name

    p = build_parser()
    args = p.parse_args(argv)
    if args.max_running_requests < 1 or args.threads < 1 or args.max_prefill_tokens < 1:
        p.error("--max-running-requests, --threads and --max-prefill-tokens must be at least 1")
    if not is_device_name(args.device):  # before the listening socket and the model load, not from the loader thread
        p.error(f"argument --device: {args.device!r} is not one the server runs on: use {DEVICE_CHOICES}")
    if os.environ.get("SGLANG_RETURN_ORIGINAL_LOGPROB", "").lower() in ("1", "true", "yes"):
        args.return_original_logprob = True
    return args


async def _load_unless_stopped(args: argparse.Namespace, stop: asyncio.Event) -> Optional[tuple[Any, Any, str]]:
    """(model, tokenizer, path) loaded on a daemon thread, or None if `stop` is set first. Raises a load error.
    Returns once that thread has ended, and with it the OpenMP team its loading made: the scheduler's must be the
    only one (scheduler.py, "One thread computes")."""
    from areal_lite.kit.server.weights import load_model
    from areal_lite.utils.hf_utils import longest_token

    loop = asyncio.get_running_loop()
    load: asyncio.Future = loop.create_future()

    def load_in_thread() -> None:
        try:
            result = load_model(args.model_path, args.device, args.dtype, lean=args.fast_path)
            if result[1] is not None:  # long text prompts are bounded by it: found now, not beside the event loop
                longest_token(result[1])
        except BaseException as e:
            loop.call_soon_threadsafe(lambda err=e: load.done() or load.set_exception(err))
        else:
            loop.call_soon_threadsafe(lambda: load.done() or load.set_result(result))

    loader = threading.Thread(target=load_in_thread, name="areal-lite-load", daemon=True)
    loader.start()
    waiter = asyncio.ensure_future(stop.wait())
    await asyncio.wait([load, waiter], return_when=asyncio.FIRST_COMPLETED)
    if stop.is_set():
        return None
    waiter.cancel()
    loader.join()  # it has set `load`: only its exit is left
    return load.result()


def _stop_on_signals(stop: asyncio.Event) -> None:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):  # not on the main thread / not on this OS
            pass


async def _serve(args: argparse.Namespace) -> int:
    from aiohttp import web

    from areal_lite.kit.server.app import ServerState, build_app
    from areal_lite.kit.server.scheduler import Scheduler

    state = ServerState(args)
    # handler_cancellation: a client that hangs up cancels its handler, which aborts its requests (no wasted decode).
    access_log = log if args.log_level == "debug" else None
    runner = web.AppRunner(build_app(state), access_log=access_log, handler_cancellation=True)
    await runner.setup()
    if args.listen_fd is not None:
        site = web.SockSite(runner, socket.socket(fileno=args.listen_fd))
    else:
        site = web.TCPSite(runner, args.host, args.port)
    await site.start()  # listen first: /health answers 503 while loading
    log.info("listening on http://%s:%d; loading %s", args.host, args.port, args.model_path)
    stop = asyncio.Event()
    _stop_on_signals(stop)
    t0 = time.perf_counter()
    try:
        loaded = await _load_unless_stopped(args, stop)
    except Exception as e:
        from areal_lite.utils.model_store import ModelPathError

        # a path that names no model is the user's to fix, and the message says how; anything else gets its trace
        trace = "" if isinstance(e, (ModelPathError, FileNotFoundError)) else "\n" + traceback.format_exc()
        log.error("failed to load model %r: %s%s", args.model_path, e, trace)
        await runner.cleanup()
        return 1
    if loaded is None:
        await runner.cleanup()
        return 0
    model, tokenizer, path = loaded
    scheduler = Scheduler(
        model, tokenizer, model_path=path, max_running_requests=args.max_running_requests,
        max_prefill_tokens=args.max_prefill_tokens, random_seed=args.random_seed, threads=args.threads,
        context_length=args.context_length or int(getattr(model.config, "max_position_embeddings", 0) or 4096),
        return_original_logprob=args.return_original_logprob, decode_log_interval=args.decode_log_interval,
        fast_path=args.fast_path,
    )  # fmt: skip
    scheduler.start()
    state.tokenizer, state.model_path, state.scheduler = tokenizer, path, scheduler
    n_params = sum(p.numel() for p in model.parameters())
    dtype = str(model.dtype).replace("torch.", "")  # what `--dtype auto` chose
    print(
        f"areal-lite serve: ready on http://{args.host}:{args.port} model={path} params={n_params / 1e6:.1f}M "
        f"device={scheduler.device} dtype={dtype} threads={args.threads} runner={type(scheduler.runner).__name__} "
        f"max_running={args.max_running_requests} (loaded in {time.perf_counter() - t0:.1f}s)",
        flush=True,
    )
    await stop.wait()
    log.info("shutting down")
    scheduler.stop()
    await runner.cleanup()
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    if args.exit_with_parent:
        from areal_lite.kit.server.procs import exit_with_parent

        exit_with_parent(args.exit_with_parent, log=log)  # from the start: loading a model takes a while
    logging.basicConfig(
        level=getattr(logging, args.log_level.upper()),
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    from areal_lite.utils.device import keep_freed_memory, set_torch_threads

    keep_freed_memory()  # a weight update re-packs the lm_head (113 MB for SmolLM2): into the last copy's memory
    args.threads = set_torch_threads(args.threads)  # OMP_NUM_THREADS caps it; the scheduler thread uses this count
    return asyncio.run(_serve(args))
