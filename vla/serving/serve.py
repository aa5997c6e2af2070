"""``vla serve CKPT``: load a checkpoint as a ``Policy``, pick the serving mode by measurement, serve until stopped.

    vla serve CKPT [--host 127.0.0.1] [--port 8000] [--api-key-file F] [--embodiment NAME ...] [--max-batch 8]
                   [--batch-window-ms 2] [--dtype bfloat16|float32] [--compile/--no-compile]
                   [--attention sdpa|explicit] [--max-frame-mb 64] [--stats-dataset EMBODIMENT=DATASET ...]

Start-up refuses (exit 2, one line naming the fix) a checkpoint without stats for a requested embodiment, an
unreadable or short API key file and bad flags, before binding the port. An embodiment trained on several datasets,
each normalized with its own stats, needs ``--stats-dataset EMBODIMENT=DATASET`` (whose conventions the robot
follows); without ``--embodiment`` such an embodiment is left out with a warning naming the flag, and the others
are served. ``--dtype``/``--compile``/``--attention``
left out: every combination is timed at warm-up and the fastest within 1 % of the fp32 chunk is kept
(``vla.serving.modes``). Then one line on stdout::

    vla serve: ready at ws://127.0.0.1:8000 (REST http://127.0.0.1:8000/act) | embodiments sim_panda | protocol 1 | mode float32 eager sdpa
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import signal
import sys
import threading
from typing import Any

log = logging.getLogger("vla.serving")


def add_serve_parser(sub: Any) -> None:
    """Register ``vla serve`` on the top-level sub-parsers."""
    s = sub.add_parser(
        "serve",
        help="serve a checkpoint to robots: openpi-compatible WebSocket + REST, micro-batched",
        description="Serve CKPT (a checkpoint folder, vla train run or step folder, or merged export) on one port: "
        "WebSocket (openpi's protocol, any path), POST /act (JSON), GET /healthz, /metadata, /metrics.",
    )
    s.add_argument(
        "checkpoint", help="checkpoint folder, run folder (its newest complete step) or step folder"
    )
    s.add_argument("--host", default="127.0.0.1", help="interface to bind (0.0.0.0: every interface)")
    s.add_argument("--port", type=int, default=8000, help="TCP port (0: any free port, printed when ready)")
    s.add_argument("--api-key-file", default=None, help="require 'Authorization: Api-Key <key in this file>'")
    s.add_argument(
        "--embodiment",
        action="append",
        default=None,
        help="serve this one (repeatable; default: all with stats)",
    )
    s.add_argument(
        "--stats-dataset",
        action="append",
        type=_stats_dataset,
        default=None,
        metavar="EMBODIMENT=DATASET",
        help="for an embodiment trained on several datasets each normalized with its own stats: the dataset whose "
        "stats (and conventions) the robot follows (repeatable, one per embodiment)",
    )
    s.add_argument("--max-batch", type=int, default=8, help="most requests run in one forward pass")
    s.add_argument(
        "--batch-window-ms",
        type=_window_ms,
        default=None,
        metavar="MS|auto",
        help="longest wait for more requests after the first (default auto: a tenth of the measured forward pass, "
        "at most 50 ms)",
    )
    s.add_argument(
        "--dtype",
        choices=["bfloat16", "float32"],
        default=None,
        help="weights dtype (default: fastest measured)",
    )
    s.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="compiled serving graphs (default: whichever measured faster)",
    )
    s.add_argument(
        "--attention",
        choices=["sdpa", "explicit"],
        default=None,
        help="attention kernel: PyTorch's fused SDPA or the explicit three-op form (default: whichever measured "
        "faster; a soft-capped model's language layers, Gemma2's, run the explicit form either way)",
    )
    s.add_argument("--max-frame-mb", type=float, default=64.0, help="largest request accepted (MiB)")
    s.add_argument(
        "--max-connections",
        type=int,
        default=64,
        help="concurrent WebSocket connections plus REST requests in progress (past it: HTTP 503)",
    )
    s.add_argument("--max-prompt-chars", type=int, default=2000, help="longest prompt accepted")
    s.add_argument("--max-image-side", type=int, default=4096, help="largest image side accepted (pixels)")
    s.add_argument("--device", default="cpu", help="torch device of the model (cpu, cuda, cuda:1, ...)")
    s.add_argument("--num-steps", type=int, default=None, help="flow steps (default: the checkpoint's)")
    s.set_defaults(fn=cmd_serve)


def _window_ms(text: str) -> float | None:
    """``--batch-window-ms``: milliseconds (>= 0), or ``auto`` (None: adaptive)."""
    if text.strip().lower() == "auto":
        return None
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected milliseconds or 'auto', got {text!r}") from None
    if not 0 <= value <= 1000:  # also refuses nan and inf (a queue wait must be finite)
        raise argparse.ArgumentTypeError(f"must be in [0, 1000] ms (or 'auto'), got {text}")
    return value


def _stats_dataset(text: str) -> tuple[str, str]:
    """``--stats-dataset EMBODIMENT=DATASET`` -> (embodiment, dataset)."""
    emb, sep, dataset = text.partition("=")
    if not sep or not emb.strip() or not dataset.strip():
        raise argparse.ArgumentTypeError(f"expected EMBODIMENT=DATASET, got {text!r}")
    return emb.strip(), dataset.strip()


def _stats_datasets(pairs: list[tuple[str, str]] | None) -> dict[str, str] | None:
    """The repeated ``--stats-dataset`` flags as ``Policy``'s ``stats_datasets`` (one dataset per embodiment)."""
    out: dict[str, str] = {}
    for emb, dataset in pairs or []:
        if out.get(emb, dataset) != dataset:
            raise ValueError(
                f"--stats-dataset: two datasets for {emb!r} ({out[emb]!r}, {dataset!r}); give one"
            )
        out[emb] = dataset
    return out or None


def _check_flags(args: argparse.Namespace) -> None:
    for flag, value, low in (
        ("--max-batch", args.max_batch, 1),
        ("--max-connections", args.max_connections, 1),
        ("--max-prompt-chars", args.max_prompt_chars, 1),
        ("--max-image-side", args.max_image_side, 1),
    ):
        if value < low:
            raise ValueError(f"{flag} must be >= {low}, got {value}")
    if not 0 < args.max_frame_mb <= 1024:
        raise ValueError(f"--max-frame-mb must be in (0, 1024] (never unlimited), got {args.max_frame_mb}")
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in 0..65535, got {args.port}")
    from vla.models.meta import usable_device

    try:
        usable_device(args.device)
    except ValueError as e:
        raise ValueError(f"--device: {e}") from None


def cmd_serve(args: argparse.Namespace) -> int:
    from vla.policy import Policy
    from vla.serving.batching import ModelThread
    from vla.serving.modes import candidates, select_mode, time_forward
    from vla.serving.protocol import PROTOCOL_VERSION
    from vla.serving.requests import Limits
    from vla.serving.security import load_api_key
    from vla.serving.server import ServeOptions, ServingApp, bind_socket, run_server

    _check_flags(args)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    api_key = load_api_key(args.api_key_file) if args.api_key_file else None
    # a port in use fails now, not after loading and warm-up; the port is listened on again only when ready, so
    # that clients started early are refused meanwhile (openpi's client retries then) instead of left waiting
    bind_socket(args.host, args.port).close()
    sock = None
    previous = _stop_on_sigterm()  # until uvicorn installs its own handlers: a stop before ready exits 0 too
    serving_started = False
    try:
        # Loading, the mode trials and every batch run on one thread (vla.serving.batching: a second thread doing
        # torch work would slow every forward pass down)
        model_thread = ModelThread()
        log.info("loading %s", args.checkpoint)
        policy = model_thread.call(
            Policy.from_checkpoint,
            args.checkpoint,
            embodiments=args.embodiment,
            device=args.device,
            num_steps=args.num_steps,
            stats_datasets=_stats_datasets(args.stats_dataset),
        )
        # the bf16 probe inside candidates() is torch work too: on the model thread
        modes = model_thread.call(candidates, args.dtype, args.compile, args.device, attention=args.attention)
        log.info("timing the serving modes %s", [str(m) for m in modes])
        mode, trials = model_thread.call(select_mode, policy, modes, [1, args.max_batch])
        log.info("serving mode: %s (of %s)", mode, [str(t.mode) for t in trials] or [str(mode)])
        options = ServeOptions(
            host=args.host,
            port=args.port,
            api_key=api_key,
            max_batch=args.max_batch,
            batch_window_ms=args.batch_window_ms,
            max_connections=args.max_connections,
            limits=Limits(
                max_frame_bytes=int(args.max_frame_mb * 2**20),
                max_prompt_chars=args.max_prompt_chars,
                max_image_side=args.max_image_side,
            ),
        )
        serving = ServingApp(
            policy,
            options,
            serving_mode={**mode.to_dict(), "trials": [t.to_dict() for t in trials]},
            model_thread=model_thread,
            # the kept mode's measured batch-1 pass sizes the adaptive batch window until real batches have run
            forward_s=next((t.seconds_per_chunk.get(1) for t in trials if t.mode == mode), None)
            or model_thread.call(time_forward, policy),
        )

        def ready(url: str) -> None:
            http = url.replace("ws://", "http://", 1)
            print(
                f"vla serve: ready at {url} (REST {http}/act) | embodiments {', '.join(policy.embodiments)} | "
                f"protocol {PROTOCOL_VERSION} | mode {mode}",
                flush=True,
            )

        freeze_heap()
        sock = bind_socket(args.host, args.port, taken_meanwhile=True)
        _restore_sigterm(previous)
        serving_started = True
        rc = run_server(serving, on_ready=ready, sock=sock)
    except (_Stopped, KeyboardInterrupt) as stop:
        if serving_started:  # after ready: uvicorn's own handling and its exit status, not this path
            raise
        # The model thread may be inside a load or a compile, which no Python code can interrupt; an interpreter
        # shutdown around it aborts in C++ ("terminate called without an active exception", exit 134). Nothing
        # is written yet, so leaving at once loses nothing.
        sigterm = isinstance(stop, _Stopped)
        print(
            f"vla serve: {'SIGTERM' if sigterm else 'interrupted'} before ready, nothing was served",
            file=sys.stderr,
            flush=True,
        )
        sys.stdout.flush()
        os._exit(0 if sigterm else 130)
    finally:
        _restore_sigterm(previous)
        if sock is not None:
            sock.close()  # uvicorn closed it already unless start-up failed
    print("vla serve: stopped", file=sys.stderr, flush=True)
    return rc


class _Stopped(BaseException):
    """SIGTERM while loading or warming up (a BaseException, like KeyboardInterrupt: no handler takes it for an
    error)."""


def _stop_on_sigterm() -> Any:
    """Make SIGTERM raise ``_Stopped`` in the main thread while the checkpoint loads and the modes are timed, so a
    supervisor's stop (systemd, Kubernetes, SLURM) before ready ends the process with 0 and the stop line, as a
    stop after ready does. Returns the previous handler (None where signals cannot be set: not the main
    thread)."""
    if threading.current_thread() is not threading.main_thread():
        return None

    def stop(signum: int, frame: Any) -> None:
        raise _Stopped

    return signal.signal(signal.SIGTERM, stop)


def _restore_sigterm(previous: Any) -> None:
    if previous is not None:
        signal.signal(signal.SIGTERM, previous)


def freeze_heap() -> None:
    """Collect once, then take every object alive after start-up (the model, its compiled graphs, the libraries:
    ~760k objects at the ``bench_smolvla`` config, compiled) out of the garbage collector's scans (``gc.freeze``).
    A full collection over them took 0.5 s there, a stall of the event loop and the model thread that every robot
    would see at some request; what requests allocate is collected as before."""
    gc.collect()
    gc.freeze()
