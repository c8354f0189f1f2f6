"""Many clients, one server: the generate queue under load, on loopback.

Starts a real server (``diffusion-engine serve``, uvicorn) on 127.0.0.1 with
a tiny pipeline loaded, then ``--clients`` threads each send ``--requests``
synchronous generates one after another. Reported: failed (an answer other
than 200, or for the bounded run other than 200 / 429), lost (no answer, or
an answer the server has no finished job for), every image decoded by PIL at
the size asked, the most jobs ever waiting (sampled, and as the server
counted it) against the bound, p50 / p95 latency and throughput.

A second run lowers the bound (``--low-bound``): the requests beyond it get
429 with ``Retry-After`` and nothing else breaks (the accepted ones all
finish with valid images).

``--batch-probe`` times what merging consecutive same-size jobs into one
pipeline call would give, in process: N separate calls, one call with the N
prompts and seeds as the engine runs it (its memory plan chooses the images
per forward: one on the CPU), and one call forced to one forward.

``--ray`` runs the load through one server with a thread per core (the fair baseline),
then 1 and 2 replicas on Ray Serve (``serve --replicas``), one thread each.

    .venv/bin/python bench/serve_load.py [--clients 32] [--requests 4] [--low-bound 8] [--batch-probe] [--ray]
"""

from __future__ import annotations

import argparse
import base64
import io
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import httpx  # noqa: E402
from PIL import Image  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "load-bench"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def build_tiny(folder: Path) -> Path:
    from engine.contract.plugins import load_registry

    registry = load_registry()
    return registry.build_tiny_pipeline(registry.family("sdxl"), folder / "models" / "tiny-sdxl")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _threads_in(status: dict[str, Any]) -> int | None:
    """The compute threads a server's status reports: its loaded plan's ``threads``."""
    threads = status["pipeline"]["plan"]["resolved"].get("threads") or {}
    return threads.get("value")


class Server:
    """A ``serve`` child on a free loopback port, with the tiny pipeline loaded."""

    def __init__(self, work: Path, pipeline: Path, queue_size: int, replicas: int = 0,
                 threads: int | None = None) -> None:
        """``replicas``: that many replicas on Ray Serve (``serve --replicas``); 0: the single process.
        ``threads``: the server's compute threads (``OMP_NUM_THREADS``, which the plan takes
        over its own choice); None: the plan's (one per physical core; a Ray replica gets
        Ray's ``OMP_NUM_THREADS``, its ``num_cpus``: 1)."""
        self.port = free_port()
        self.threads: int | None = None
        self.url = f"http://127.0.0.1:{self.port}"
        outputs = work / "runs"
        command = [sys.executable, "-m", "engine", "serve", "--port", str(self.port), "--token", TOKEN,
                   "--models", str(pipeline.parent), "--outputs", str(outputs), "--load", str(pipeline),
                   "--queue-size", str(queue_size)]
        if replicas:  # a fixed count through Ray Serve's own autoscaling config (1 included)
            command += ["--ray-autoscaling", f'{{"min_replicas": {replicas}, "max_replicas": {replicas}}}']
        self.log = (work / f"server-{queue_size}-{replicas}.log").open("w")
        env = {**os.environ, "OMP_NUM_THREADS": str(threads)} if threads else None
        self.process = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT, cwd=ROOT, env=env)

    def __enter__(self) -> Server:
        try:
            return self._wait_ready()
        except BaseException:
            self.__exit__()  # a server that never came up is stopped too (its Ray with it)
            raise

    def _wait_ready(self) -> Server:
        deadline = time.monotonic() + 300
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"the server exited ({self.process.returncode}); see {self.log.name}")
            try:
                answer = httpx.get(f"{self.url}/v1/images/status", headers=AUTH, timeout=5)
                if answer.status_code == 200 and answer.json().get("pipeline"):
                    self.threads = _threads_in(answer.json())
                    return self  # (Ray Serve's proxy answers 404/503 in plain text until the app is up)
            except (httpx.HTTPError, ValueError):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("the server did not come up within 300 s")
            time.sleep(0.2)

    def __exit__(self, *exc: object) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.process.kill()
        self.log.close()


def valid_images(payload: dict[str, Any], size: int) -> bool:
    images = payload.get("images") or []
    try:
        return len(images) == 1 and all(
            Image.open(io.BytesIO(base64.b64decode(image))).size == (size, size) for image in images
        )
    except (OSError, ValueError):
        return False


def load_run(server: Server, clients: int, requests: int, steps: int, size: int, bound: int) -> dict[str, Any]:
    """Every client sends its requests one after another; what came back, and the queue's depth meanwhile."""
    outcomes: list[dict[str, Any]] = []
    lock = threading.Lock()
    depths: list[int] = []
    sampling = threading.Event()

    def sample() -> None:
        with httpx.Client(headers=AUTH, timeout=30) as client:
            while not sampling.is_set():
                try:
                    depths.append(int(client.get(f"{server.url}/v1/images/status").json()["queue"]["waiting"]))
                except (httpx.HTTPError, KeyError, ValueError):
                    pass
                sampling.wait(0.02)

    def client_run(index: int) -> None:
        with httpx.Client(headers=AUTH, timeout=600) as client:
            for k in range(requests):
                body = {"prompt": f"client {index} request {k}", "steps": steps, "width": size, "height": size,
                        "seed": index * 100 + k}
                started = time.perf_counter()
                outcome: dict[str, Any] = {"client": index}
                try:
                    answer = client.post(f"{server.url}/v1/images/generate", json=body)
                    outcome.update(status=answer.status_code, job=answer.headers.get("X-Job-Id"),
                                   retry_after=answer.headers.get("Retry-After"))
                    if answer.status_code == 200:
                        outcome["valid"] = valid_images(answer.json(), size)
                except httpx.HTTPError as exc:
                    outcome.update(status=None, error=f"{type(exc).__name__}: {exc}")
                outcome["seconds"] = time.perf_counter() - started
                with lock:
                    outcomes.append(outcome)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    threads = [threading.Thread(target=client_run, args=(i,)) for i in range(clients)]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - started
    sampling.set()
    sampler.join()
    status = httpx.get(f"{server.url}/v1/images/status", headers=AUTH).json()
    ok = [o for o in outcomes if o["status"] == 200]
    with httpx.Client(headers=AUTH, timeout=30) as client:  # each job asked of the replica that owns it
        done_ids = {o["job"] for o in ok if o["job"]
                    and client.get(f"{server.url}/v1/images/jobs/{o['job']}").json().get("state") == "done"}
    latencies = sorted(o["seconds"] for o in ok)
    return {
        "sent": clients * requests,
        "answered": len([o for o in outcomes if o["status"] is not None]),
        "ok": len(ok),
        "refused_429": len([o for o in outcomes if o["status"] == 429]),
        "429_with_retry_after": all(o["retry_after"] and o["retry_after"].isdigit()
                                    for o in outcomes if o["status"] == 429),
        "failed": len([o for o in outcomes if o["status"] not in (200, 429)]),
        "lost": len([o for o in outcomes if o["status"] is None])
        + len([o for o in ok if o["job"] not in done_ids]),
        "invalid_images": len([o for o in ok if not o.get("valid")]),
        "max_waiting_sampled": max(depths, default=0),
        "max_waiting_server": status["queue"]["max_waiting"],
        "bound": bound,
        "p50_s": round(statistics.median(latencies), 3) if latencies else None,
        "p95_s": round(latencies[max(0, round(0.95 * len(latencies)) - 1)], 3) if latencies else None,
        "wall_s": round(wall, 2),
        "images_per_s": round(len(ok) / wall, 2),
        "errors": sorted({o["error"] for o in outcomes if "error" in o})[:3],
    }


def batch_probe(pipeline: Path, steps: int, size: int, counts: tuple[int, ...] = (4, 8), repeats: int = 3) -> None:
    """Separate calls vs one merged call (as the engine runs it, and forced to one forward)."""
    from engine.hardware.probe import probe
    from engine.service.facade import Engine

    engine = Engine(hardware=probe(verify=False), runs_dir=pipeline.parent / "probe-runs")
    engine.images.load(str(pipeline))
    options = {"steps": steps, "width": size, "height": size}
    engine.images.generate("warm-up", **options)
    for n in counts:
        prompts, seeds = [f"prompt {k}" for k in range(n)], list(range(n))
        rows: dict[str, list[float]] = {"separate": [], "merged": [], "merged, one forward": []}
        for _ in range(repeats):
            start = time.perf_counter()
            for prompt, seed in zip(prompts, seeds, strict=True):
                engine.images.generate(prompt, seed=seed, **options)
            rows["separate"].append(time.perf_counter() - start)
            start = time.perf_counter()
            engine.images.generate(prompts[0], prompts=prompts, seeds=seeds, **options)
            rows["merged"].append(time.perf_counter() - start)
            start = time.perf_counter()
            engine.images.generate(prompts[0], prompts=prompts, seeds=seeds, batch=n, **options)
            rows["merged, one forward"].append(time.perf_counter() - start)
        line = ", ".join(f"{name} {statistics.median(times):.3f} s" for name, times in rows.items())
        print(f"batch probe, {n} same-size jobs ({size} px, {steps} steps, median of {repeats}): {line}")


def report(title: str, result: dict[str, Any]) -> None:
    print(f"\n{title}")
    for name, value in result.items():
        print(f"  {name:22} {value}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--steps", type=int, default=1)
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--queue-size", type=int, default=128)
    parser.add_argument("--low-bound", type=int, default=8, help="the lowered bound of the second run (0: skip it)")
    parser.add_argument("--batch-probe", action="store_true")
    parser.add_argument("--ray", action="store_true", help="instead: 1 vs 2 replicas on Ray Serve, side by side")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="serve-load-"))
    pipeline = build_tiny(work)
    if args.ray:
        return ray_mode(work, pipeline, args)
    healthy = True
    with Server(work, pipeline, args.queue_size) as server:
        print(f"server: {server.url} (diffusion-engine serve); {args.clients} clients x {args.requests} requests, "
              f"{args.size} px, {args.steps} step(s)")
        result = load_run(server, args.clients, args.requests, args.steps, args.size, args.queue_size)
        report(f"bound {args.queue_size}", result)
        healthy &= (result["failed"] == result["lost"] == result["invalid_images"] == result["refused_429"] == 0
                    and result["max_waiting_server"] <= args.queue_size)
    if args.low_bound:
        with Server(work, pipeline, args.low_bound) as server:
            result = load_run(server, args.clients, args.requests, args.steps, args.size, args.low_bound)
            report(f"bound lowered to {args.low_bound}", result)
            healthy &= (result["failed"] == result["lost"] == result["invalid_images"] == 0
                        and result["refused_429"] > 0 and result["429_with_retry_after"]
                        and result["ok"] + result["refused_429"] == result["sent"]
                        and result["max_waiting_server"] <= args.low_bound)
    if args.batch_probe:
        batch_probe(pipeline, args.steps, args.size)
    print("\nverdict:", "every rule held" if healthy else "A RULE FAILED")
    return 0 if healthy else 1


def ray_mode(work: Path, pipeline: Path, args: argparse.Namespace) -> int:
    """The same load through one server with every core's thread, then 1 and 2 replicas
    on Ray Serve (``serve --replicas``), one after another.

    Each replica is one Ray actor of ``num_cpus=1``, which computes on one thread; so the
    fair baseline for N replicas is the single process with the same total threads
    (here: one per core), not one replica, which leaves the other cores idle. What must
    hold is 0 failed, 0 lost, every image valid, and both replicas serving."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    runs = {"single": ("1 process", 0, cores), "one": ("1 replica on Ray Serve", 1, None),
            "two": ("2 replicas on Ray Serve", 2, None)}
    results = {}
    for key, (label, replicas, threads) in runs.items():
        with Server(work, pipeline, args.queue_size, replicas=replicas, threads=threads) as server:
            results[key] = load_run(server, args.clients, args.requests, args.steps, args.size, args.queue_size)
            report(f"{label}, {server.threads} thread(s) each (as its status reports)", results[key])
    single, one, two = results["single"], results["one"], results["two"]
    print(f"\n2 replicas (1 thread each) vs 1 process with {cores} threads (same total threads): throughput "
          f"x{two['images_per_s'] / single['images_per_s']:.2f}, p50 {single['p50_s']} -> {two['p50_s']} s, "
          f"p95 {single['p95_s']} -> {two['p95_s']} s")
    print(f"2 replicas vs 1 replica (1 thread, the other cores idle): x{two['images_per_s'] / one['images_per_s']:.2f}")
    healthy = all(r["failed"] == r["lost"] == r["invalid_images"] == 0 for r in results.values())
    print("verdict:", "every rule held" if healthy else "A RULE FAILED")
    return 0 if healthy else 1


if __name__ == "__main__":
    sys.exit(main())
