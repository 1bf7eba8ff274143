"""``phasegate worker`` options and the engine they select."""

from __future__ import annotations

import argparse
import json
import os
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from app.contract.worker_token import TOKEN_ENV, TokenError
from app.http.server import HttpLimits
from app.worker.auth import LOOPBACK_HOSTS, token_from
from app.worker.engine import Engine


@dataclass(frozen=True)
class WorkerConfig:
    host: str = "127.0.0.1"
    port: int = 0  # 0: any free port; its number goes to ready_file
    worker_id: str = ""
    engine: str = "sim"  # "sim" or "vllm"
    models: tuple[str, ...] = ("sim",)  # the names start requests may use
    revisions: tuple[tuple[str, str], ...] = ()  # each model's revision, declared when it joins (--model NAME=REV)
    join: str | None = None  # a gateway to join the fleet through (docs/worker-protocol.md)
    advertise: str | None = None  # the URL the gateway reaches it at (default: its listen address)
    max_running: int = 8
    max_queued: int = 64
    heartbeat_ms: int = 250
    grace_s: float = 5.0
    health_ttl_s: float = 1.0
    health_timeout_s: float = 10.0
    enable_faults: bool = False
    faults: tuple[dict[str, Any], ...] = ()
    ready_file: Path | None = None
    log_level: str = "warning"
    log_format: str = "text"  # "json": one object a line, with request_id, attempt and instance (the worker)
    token: str | None = field(default=None, repr=False)  # None: the protocol is open (loopback only)
    max_body_bytes: int = 8 << 20  # a larger request body is refused with 413
    http: HttpLimits = field(default_factory=HttpLimits)  # header and body timeouts, keep-alive, 431
    # sim engine
    sim_prefill_ms_per_token: float = 0.1
    sim_decode_ms_per_token: float = 2.0
    sim_abort_ms: float = 0.0
    sim_tokens_per_delta: int = 1  # engine tokens in each output (vLLM's stream interval)
    # vllm engine
    model_path: str | None = None
    max_model_len: int | None = None  # None: 512 for vllm, the sim's 32768
    dtype: str = "bfloat16"
    vllm_args: dict[str, Any] = field(default_factory=dict)
    # vLLM's output parsers, by vllm serve's names (app/worker/vllm_parsing.py)
    reasoning_parser: str | None = None
    tool_call_parser: str | None = None
    enable_auto_tool_choice: bool = False
    chat_template: str | None = None  # vllm serve's --chat-template: a file, or the template itself

    @property
    def name(self) -> str:
        return self.worker_id or f"{socket.gethostname()}:{os.getpid()}"


def add_worker_parser(sub: Any) -> None:
    """Add the ``worker`` subcommand to the CLI's subparsers."""
    p = sub.add_parser("worker", help="run a replica worker: one engine behind the lease protocol")
    d = WorkerConfig()
    p.add_argument("--host", default=d.host)
    p.add_argument("--port", type=int, default=d.port, help="0 picks a free port (see --ready-file)")
    p.add_argument("--worker-id", default=d.worker_id, help="name in metrics and headers (default host:pid)")
    p.add_argument("--engine", choices=["sim", "vllm"], default=d.engine)
    p.add_argument(
        "--model", action="append", dest="models", metavar="NAME[=REVISION]", help="served model (repeatable)"
    )
    p.add_argument("--join", metavar="URL", help="join the fleet through this gateway (needs the worker token)")
    p.add_argument("--advertise", metavar="URL", help="the URL gateways reach this worker at (with --join)")
    p.add_argument("--max-running", type=int, default=d.max_running, help="engine slots")
    p.add_argument("--max-queued", type=int, default=d.max_queued, help="waiting attempts before 429")
    p.add_argument("--heartbeat-ms", type=int, default=d.heartbeat_ms, help="default heartbeat interval")
    p.add_argument("--grace-s", type=float, default=d.grace_s, help="SIGTERM: time running attempts get")
    p.add_argument("--health-ttl-s", type=float, default=d.health_ttl_s, help="how long a health probe is reused")
    p.add_argument("--health-timeout-s", type=float, default=d.health_timeout_s)
    p.add_argument("--enable-faults", action="store_true", help="accept scripted faults (tests only)")
    p.add_argument("--fault", action="append", default=[], metavar="JSON", help="a fault at startup (repeatable)")
    p.add_argument("--ready-file", type=Path, help="write {host, port, pid} here once listening")
    p.add_argument("--log-level", default=d.log_level)
    p.add_argument(
        "--log-format",
        choices=["text", "json"],
        default=d.log_format,
        help="json: one object a line (docs/operations.md)",
    )
    p.add_argument(
        "--token-file",
        type=Path,
        help=f"the shared secret the gateway sends (default: ${TOKEN_ENV}); required off loopback",
    )
    p.add_argument(
        "--insecure-no-auth",
        action="store_true",
        help="serve the protocol without a token on a non-loopback address (a private network only)",
    )
    p.add_argument("--max-body-bytes", type=int, default=d.max_body_bytes, help="larger request bodies get 413")
    h = d.http
    p.add_argument(
        "--http-header-timeout-s", type=float, default=h.header_timeout_s, help="to read a request's headers"
    )
    p.add_argument("--http-body-timeout-s", type=float, default=h.body_timeout_s, help="to read a request's body")
    p.add_argument("--http-keep-alive-s", type=float, default=h.keep_alive_s, help="an idle connection is kept open")
    p.add_argument("--http-max-header-bytes", type=int, default=h.max_header_bytes, help="larger headers get 431")
    p.add_argument("--sim-prefill-ms-per-token", type=float, default=d.sim_prefill_ms_per_token)
    p.add_argument("--sim-decode-ms-per-token", type=float, default=d.sim_decode_ms_per_token)
    p.add_argument("--sim-abort-ms", type=float, default=d.sim_abort_ms, help="time the sim takes to abort")
    p.add_argument(
        "--sim-tokens-per-delta", type=int, default=d.sim_tokens_per_delta, help="engine tokens in each output"
    )
    p.add_argument("--model-path", help="vllm: the model directory")
    p.add_argument("--max-model-len", type=int, default=d.max_model_len, help="default: 512 (vllm), 32768 (sim)")
    p.add_argument("--dtype", default=d.dtype)
    p.add_argument("--vllm-args", default="{}", metavar="JSON", help="vllm: more AsyncEngineArgs fields")
    # a pooling model as vllm serve runs one (docs/design.md §17: app/worker/vllm_pooling.py)
    p.add_argument("--runner", choices=["auto", "generate", "pooling"], help="vllm: vllm serve's --runner")
    p.add_argument("--convert", choices=["auto", "none", "embed", "classify"], help="vllm: vllm serve's --convert")
    p.add_argument("--reasoning-parser", help="vllm: split reasoning out as vllm serve's parser of this name")
    p.add_argument("--tool-call-parser", help="vllm: parse tool calls as vllm serve's parser of this name")
    p.add_argument(
        "--enable-auto-tool-choice", action="store_true", help='vllm: "auto" tool choice (needs --tool-call-parser)'
    )
    p.add_argument("--chat-template", help="vllm: the chat template, a file or the template itself (vllm serve's)")


def config_from_args(args: argparse.Namespace) -> WorkerConfig:
    faults = tuple(json.loads(raw) for raw in args.fault)
    if faults and not args.enable_faults:
        raise SystemExit("phasegate worker: --fault needs --enable-faults")
    if args.engine == "vllm" and not args.model_path:
        raise SystemExit("phasegate worker: --engine vllm needs --model-path")
    try:
        token = token_from(args.token_file)
    except TokenError as exc:
        raise SystemExit(f"phasegate worker: {exc}") from None
    if token is None and args.host not in LOOPBACK_HOSTS and not args.insecure_no_auth:
        raise SystemExit(
            f"phasegate worker: listening on {args.host} needs a token (--token-file or ${TOKEN_ENV}), "
            "or --insecure-no-auth on a private network"
        )
    if args.enable_auto_tool_choice and not args.tool_call_parser:
        raise SystemExit("phasegate worker: --enable-auto-tool-choice needs --tool-call-parser")
    if args.engine != "vllm" and (
        args.reasoning_parser or args.tool_call_parser or args.chat_template or args.runner or args.convert
    ):
        raise SystemExit(
            "phasegate worker: --reasoning-parser, --tool-call-parser, --chat-template, --runner and --convert"
            " are vLLM's (--engine vllm)"
        )
    if args.max_body_bytes < 1024:
        raise SystemExit("phasegate worker: --max-body-bytes must be at least 1024")
    http = HttpLimits(
        header_timeout_s=args.http_header_timeout_s,
        body_timeout_s=args.http_body_timeout_s,
        keep_alive_s=args.http_keep_alive_s,
        max_header_bytes=args.http_max_header_bytes,
    )
    for problem in http.problems():
        raise SystemExit(f"phasegate worker: --http-{problem.replace('_', '-')}")
    declared = args.models or ([Path(args.model_path).name] if args.engine == "vllm" else ["sim"])
    if not all(entry.partition("=")[0] for entry in declared):
        raise SystemExit("phasegate worker: --model takes NAME or NAME=REVISION")
    models = tuple(entry.partition("=")[0] for entry in declared)
    revisions = tuple((name, rev) for name, _, rev in (e.partition("=") for e in declared) if rev)
    if args.advertise and not args.join:
        raise SystemExit("phasegate worker: --advertise goes with --join")
    for name, url in (("--join", args.join), ("--advertise", args.advertise)):
        if url is not None and not url.startswith(("http://", "https://")):
            raise SystemExit(f"phasegate worker: {name} takes an http(s):// URL")
    return WorkerConfig(
        host=args.host,
        port=args.port,
        worker_id=args.worker_id,
        engine=args.engine,
        models=models,
        revisions=revisions,
        join=args.join,
        advertise=args.advertise,
        max_running=args.max_running,
        max_queued=args.max_queued,
        heartbeat_ms=args.heartbeat_ms,
        grace_s=args.grace_s,
        health_ttl_s=args.health_ttl_s,
        health_timeout_s=args.health_timeout_s,
        enable_faults=args.enable_faults,
        faults=faults,
        ready_file=args.ready_file,
        log_level=args.log_level,
        log_format=args.log_format,
        token=token,
        max_body_bytes=args.max_body_bytes,
        http=http,
        sim_prefill_ms_per_token=args.sim_prefill_ms_per_token,
        sim_decode_ms_per_token=args.sim_decode_ms_per_token,
        sim_abort_ms=args.sim_abort_ms,
        sim_tokens_per_delta=max(args.sim_tokens_per_delta, 1),
        model_path=args.model_path,
        max_model_len=args.max_model_len,
        dtype=args.dtype,
        vllm_args=json.loads(args.vllm_args) | _model_args(args),
        reasoning_parser=args.reasoning_parser,
        tool_call_parser=args.tool_call_parser,
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        chat_template=args.chat_template,
    )


def _model_args(args: argparse.Namespace) -> dict[str, Any]:
    """``--runner`` and ``--convert``, as the engine arguments ``vllm serve`` makes of them."""
    return {name: getattr(args, name) for name in ("runner", "convert") if getattr(args, name) is not None}


def make_engine(config: WorkerConfig) -> Engine:
    """The configured engine; vLLM is imported only here, only when asked for."""
    if config.engine == "vllm":
        from app.worker.vllm_engine import VllmEngine
        from app.worker.vllm_parsing import ParserNames

        assert config.model_path is not None
        return VllmEngine(
            config.model_path,
            models=config.models,
            max_model_len=config.max_model_len or 512,
            dtype=config.dtype,
            max_num_seqs=config.max_running,
            extra_args=config.vllm_args,
            parsers=ParserNames(config.reasoning_parser, config.tool_call_parser, config.enable_auto_tool_choice),
            chat_template=config.chat_template,
        )
    from app.worker.sim import SimEngine, SimTiming

    timing = SimTiming(
        prefill_s_per_token=config.sim_prefill_ms_per_token / 1000,
        decode_s_per_token=config.sim_decode_ms_per_token / 1000,
        abort_s=config.sim_abort_ms / 1000,
        tokens_per_delta=config.sim_tokens_per_delta,
    )
    if config.max_model_len is None:
        return SimEngine(models=config.models, timing=timing)
    return SimEngine(models=config.models, timing=timing, max_model_len=config.max_model_len)
