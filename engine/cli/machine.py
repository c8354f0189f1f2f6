"""``families``, ``info``, ``serve`` and ``doctor``: the machine and what is installed."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from engine.cli.common import flag_words
from engine.errors import EngineError
from engine.requests import MachineRequest


def machine_request(args: argparse.Namespace) -> MachineRequest:
    """The machine the flags describe: a preset or this one, with overrides."""
    return MachineRequest(args.hardware, args.free_gb, torchao=not args.no_torchao)


def cmd_families(args: argparse.Namespace) -> int:
    from engine import Engine

    engine = Engine()
    if args.hook:
        return _hook_report(engine, args.hook, as_json=args.json)
    families = engine.catalog.families()
    plugins = engine.catalog.plugins(builtin=args.all)
    if args.json:
        print(json.dumps({"families": families, **plugins}, indent=2))
        return 0
    for plugin in plugins["plugins"]:
        names = ", ".join(plugin["families"]) or "-"  # type: ignore[arg-type]
        api = f"  plugin API {plugin['api']}" if plugin["api"] is not None else ""
        print(f"{plugin['name']:<22} {plugin['package']} {plugin['version']}  families: {names}{api}")
        print(f"{'':<22} hooks: {', '.join(plugin['hooks'])}")  # type: ignore[arg-type]
        for line in plugin["deprecations"]:  # type: ignore[attr-defined]
            print(f"{'':<22} deprecated: {line}")
    for family in families:
        print(f"{family['name']:<22} checkpoints (--model NAME): {', '.join(family['checkpoints'])}")  # type: ignore[arg-type]
    for error in plugins["errors"]:
        print(f"{error['plugin']:<22} {error['package']}  FAILED TO LOAD: {error['error']}")
    return 0


def _hook_report(engine: Any, hook: str, *, as_json: bool) -> int:
    """``families --hook NAME``: who implements it, in the order they are asked."""
    rows = engine.catalog.hook_implementations(hook)
    if as_json:
        print(json.dumps({"hook": hook, "implementations": rows}, indent=2))
        return 0
    kind = "firstresult: the first answer wins" if rows and rows[0]["firstresult"] else "every answer is collected"
    print(f"{hook} ({kind}); asked in this order:")
    for row in rows:
        print(f"  {row['plugin']:<24} {row['package']} {row['version']}  ({row['order']})")
    if not rows:
        print("  (no plugin implements it)")
    return 0


def cmd_info(args: argparse.Namespace) -> int:
    from engine import Engine

    info: dict[str, Any] = Engine(hardware=machine_request(args)).catalog.info(args.family, model=args.model)
    if args.json:
        print(json.dumps({k: v for k, v in info.items() if k != "available_memory"}, indent=2))
        return 0
    hardware = info["hardware"]
    free = "?" if hardware["free_memory_gb"] is None else f"{hardware['free_memory_gb']:.1f}"
    print(
        f"machine: {hardware['name']} ({hardware['device_name']}, {hardware['vendor']}, "
        f"{hardware['capability_label']}, {free}/{hardware['total_memory_gb']:.1f} GB free, "
        f"native bf16 {'yes' if hardware['native_bf16'] else 'no'}, "
        f"torchao {'yes' if hardware['torchao_functional'] else 'no'})"
    )
    model = info.get("model")
    if model is not None:
        print(f"model: {model['reference']} -> {model['kind']} {model['location']} "
              f"({model['family']}, {model['checkpoint'] or 'unknown checkpoint'}); {model['weights']['note']}")
    for entry in info["families"].values():
        img, train = entry["images"], entry["training"]
        sizes = img["sizes_gb"]
        print(f"\n{img['label']} [{img['family']}]")
        print(f"  bf16 GB: transformer {sizes['transformer']}, text encoders "
              f"{sizes['text_encoders']}, VAE {sizes['vae']}")
        resident = ", ".join(
            f"{s} {gb}" + (" (denied)" if s in img["denied"] else "") for s, gb in img["resident_gb"].items()
        )
        print(f"  resident GB: {resident}")
        for scheme, reason in img["denied"].items():
            print(f"  denied {scheme}: {reason}")
        modes = ", ".join(train["precision_modes"]) or "-"
        print(f"  training: {'yes' if train['trainable'] else 'no'}; modes: {modes}; "
              f"recommended: {train['recommended_precision'] or '-'}; "
              f"compile: {'yes' if train['supports_compile'] else 'no'}")
        for mode, gb in (train.get("estimated_peak_gb") or {}).items():
            print(f"    {mode}: about {gb} GB at peak")
        print(f"  note: {flag_words(train['vram_note'])}")
        for name, clip in (entry.get("video") or {}).items():
            print(f"  video {name}: {clip['frames']} frames of {clip['width']}x{clip['height']} at {clip['fps']} fps "
                  f"({clip['seconds']} s): {clip['does']}" + (f"; {clip['hint']}" if clip["hint"] else ""))
    for error in info["errors"]:
        print(f"\nplugin {error['plugin']} ({error['package']}) failed to load: {error['error']}")
    return 0


def serve_settings(args: argparse.Namespace) -> Any:
    """The server's settings from ``serve``'s flags (checked before anything heavy is imported
    and before any port opens: an empty token, an unset "$TOKEN", is refused here)."""
    import os

    from engine.requests import default_datasets_dir, default_runs_dir
    from engine.server.settings import ServerSettings

    # One runs folder: `train` and `runs` use it too, unless --outputs says otherwise.
    outputs = Path(args.outputs) if args.outputs is not None else default_runs_dir()
    return ServerSettings(
        model_roots=tuple(Path(p) for p in args.models),
        # The per-user datasets folder unless --datasets names others (the page's dataset manager writes there).
        dataset_roots=tuple(Path(p) for p in args.datasets) or (default_datasets_dir(),),
        # The runs folder is a LoRA root too: a run trained here is listed and usable at once.
        lora_roots=(*(Path(p) for p in args.loras), outputs),
        input_roots=tuple(Path(p) for p in args.inputs),
        output_roots=(outputs,),
        token=args.token if args.token is not None else os.environ.get("DIFFUSION_ENGINE_TOKEN"),
        allow_hub=args.allow_hub,
        insecure_no_token=args.insecure_no_token,
        max_body_bytes=int(args.max_body_mb * 1024 * 1024),
        max_upload_bytes=int(args.max_upload_mb * 1024 * 1024),
        queue_size=args.queue_size,
        gallery_max_gb=args.gallery_max_gb,
        gallery_max_age_s=args.gallery_max_age,
        keep_alive_s=args.keep_alive,
        bind_host=args.host,
        extra_hosts=tuple(args.allow_host),
    )


def cmd_serve(args: argparse.Namespace) -> int:
    from engine.server.settings import is_loopback

    settings = serve_settings(args)
    if args.threads is not None:
        if args.threads < 1:
            raise EngineError(f"--threads {args.threads}: give 1 or more threads", code="invalid_request")
        os.environ["OMP_NUM_THREADS"] = str(args.threads)  # every plan this process makes takes it as the user's say
    outputs = settings.output_roots[0]
    settings.check_bind(args.host)
    check_port_free(args.host, args.port)
    try:
        import uvicorn

        from engine.server.app import create_app
    except ImportError as exc:
        raise EngineError(
            f"the server needs its extra: from the clone, pip install -e '.[server]' ({exc})",
            code="missing_extra",
        ) from None
    from engine import Engine

    outputs.mkdir(parents=True, exist_ok=True)
    if args.replicas != 1 or args.ray_address or args.ray_autoscaling:
        return _serve_replicas(args, settings)
    engine = Engine(runs_dir=outputs, allow_download=settings.allow_hub)
    if args.load:
        engine.images.load(args.load)
    if settings.token is None and not is_loopback(args.host):
        print(f"warning: serving {args.host} beyond loopback without a token (--insecure-no-token)", file=sys.stderr)
    # Open event streams (SSE) never end by themselves: shutdown waits at most this long for them.
    # Ctrl-C: the app's shutdown cancels its jobs, then this exits 130 (``uvicorn.run`` would
    # swallow it and exit 0, and so would a server whose parent left SIGINT ignored).
    config = uvicorn.Config(create_app(engine, settings), host=args.host, port=args.port,
                            log_level="info", timeout_graceful_shutdown=5)
    server = _interruptible_server(config)
    with engine:
        server.run()
    if server.interrupted:
        raise KeyboardInterrupt
    return 0


def _interruptible_server(config: Any) -> Any:
    """uvicorn's server over ``config``, noting in ``interrupted`` whether a Ctrl-C stopped it."""
    import signal

    import uvicorn

    class Server(uvicorn.Server):
        interrupted = False

        def handle_exit(self, sig: int, frame: Any) -> None:
            self.interrupted = self.interrupted or sig == signal.SIGINT
            super().handle_exit(sig, frame)

    return Server(config)


def check_port_free(host: str, port: int) -> None:
    """Refuse a port another process listens on, before a model loads (uvicorn would exit 3
    after the load, with its own words and no code)."""
    import errno
    import socket

    if port == 0:
        return
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: TIME_WAIT is no conflict
        try:
            probe.bind((host, port))
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE:
                return  # not this machine's address, say: the server's own bind reports that
            raise EngineError(f"port {port} on {host} is in use; stop what listens there or pass another --port",
                              code="port_in_use") from None


def _serve_replicas(args: argparse.Namespace, settings: Any) -> int:
    """``serve --replicas N``: the same app on N Ray Serve replicas (see engine.server.replicas);
    the model each replica loads is checked here first, before Ray starts."""
    import time

    from engine import Engine

    if args.replicas < 1:
        raise EngineError(f"--replicas must be at least 1 (got {args.replicas})", code="invalid_request")
    try:
        autoscaling = json.loads(args.ray_autoscaling) if args.ray_autoscaling else None
    except ValueError as exc:
        raise EngineError(f"--ray-autoscaling is not JSON: {exc}", code="invalid_request") from None
    if not args.load:
        # A replica refuses POST /v1/images/load (each holds the model it started with),
        # so replicas started without one could never serve an image.
        raise EngineError("serve --replicas needs --load MODEL: each replica loads it when it starts and "
                          "cannot load one later", code="invalid_request")
    Engine(allow_download=settings.allow_hub).images.check_load(args.load)
    try:
        from engine.server import replica_serve as replicas
    except ImportError as exc:
        raise EngineError(f"serving replicas needs Ray Serve: pip install 'diffusion-engine[ray]' ({exc})",
                          code="missing_extra") from None
    replicas.deploy(settings, load=args.load, replicas=args.replicas, autoscaling=autoscaling,
                    address=args.ray_address, host=args.host, port=args.port)
    print(f"serving {args.replicas if autoscaling is None else 'autoscaled'} replicas on Ray Serve at "
          f"http://{args.host}:{args.port}/ (Ctrl-C stops them)", file=sys.stderr)
    import signal

    signal.signal(signal.SIGTERM, signal.default_int_handler)  # a TERM stops the replicas as Ctrl-C does
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        return 130
    finally:
        replicas.shutdown()


def _cmd_doctor(args: argparse.Namespace) -> int:
    """Versions, then one verdict per family for inference and training: what this machine
    does, why, and what would do better."""
    from engine import Engine

    report = Engine().doctor(as_json=args.json)
    print(report if args.json else flag_words(report))  # the verdicts' advice, as flags
    return 0


cmd_doctor = _cmd_doctor
