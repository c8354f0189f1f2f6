"""Serving replicas on Ray Serve, for real: a local Ray, two CPU replicas of a tiny pipeline,
the HTTP API on loopback, concurrent jobs, 429s, events, cancel, and a replica killed mid-job;
the front guarded as the single server is, and nothing of it listening beyond loopback."""

from __future__ import annotations

import concurrent.futures
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
import ray

from engine.server.settings import ServerSettings


TOKEN = "replica-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
MAX_BODY = 1 << 20


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.fixture(scope="module")
def service(tiny_pipeline: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    from engine.server import replica_serve as replicas

    model = tiny_pipeline("zimage")
    outputs = tmp_path_factory.mktemp("outputs")
    settings = ServerSettings(model_roots=(model.parent,), output_roots=(outputs,), queue_size=1, token=TOKEN,
                              max_body_bytes=MAX_BODY)
    port = free_port()
    replicas.deploy(settings, load=str(model), replicas=2, port=port,
                    ray_init={"num_cpus": 2, "object_store_memory": 80 * 1024 * 1024, "include_dashboard": False,
                              "log_to_driver": False})
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        replicas.shutdown()


def owner(job_id: str) -> str:
    return job_id.rsplit(".", 1)[1]


def finish(client: httpx.Client, job_id: str, timeout: float = 120) -> dict[str, object]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        answer = client.get(f"/v1/images/jobs/{job_id}")
        assert answer.status_code == 200, answer.text
        job = answer.json()
        if job["state"] in ("done", "failed", "cancelled"):
            return job
        time.sleep(0.1)
    raise AssertionError(f"job {job_id} did not finish")


@pytest.mark.slow
def test_concurrent_jobs_complete_or_get_429_none_lost_and_both_replicas_serve(service: str) -> None:
    body = {"prompt": "a fox", "width": 128, "height": 128, "steps": 6}  # long enough that the burst overlaps
    with httpx.Client(base_url=service, timeout=60, headers=AUTH) as client:
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(lambda i: client.post("/v1/images/jobs", json={**body, "seed": i}), range(10)))
        assert {a.status_code for a in answers} <= {202, 429}, [a.text for a in answers if a.status_code not in (202, 429)]
        refused = [a for a in answers if a.status_code == 429]
        assert all(a.headers.get("retry-after") for a in refused)
        accepted = [a.json()["id"] for a in answers if a.status_code == 202]
        # each replica holds one running and one waiting job: at least both replicas' share got in
        assert len(accepted) >= 2 and refused, (len(accepted), len(refused))
        with client.stream("GET", f"/v1/images/jobs/{accepted[0]}/events") as events:
            names = [line[6:].strip() for line in events.iter_lines() if line.startswith("event:")]
        assert names[-1] == "done", names  # followed on its replica to the end (steps on the way)
        jobs = [finish(client, job_id) for job_id in accepted]
        assert [j["state"] for j in jobs] == ["done"] * len(accepted) and all(j["images"] for j in jobs)
        more = [client.post("/v1/images/jobs", json={**body, "seed": 100 + i}) for i in range(6)]
        served = {owner(a.json()["id"]) for a in [*answers, *more] if a.status_code == 202}
        for answer in more:
            if answer.status_code == 202:
                assert finish(client, answer.json()["id"])["state"] == "done"
        assert len(served) == 2, served
        assert client.get("/v1/images/status").status_code == 200  # any other route: a replica answers
        refused_load = client.post("/v1/images/load", json={"model": "x"})
        assert refused_load.status_code == 409 and refused_load.json()["error"]["code"] == "not_with_replicas"
        edit = client.delete("/v1/datasets/photos/images/a.png")  # a dataset edit would reach one replica's disk
        assert edit.status_code == 409 and edit.json()["error"]["code"] == "not_with_replicas"


def test_a_killed_replica_fails_its_job_with_the_reason_and_the_service_keeps_answering(service: str) -> None:
    with httpx.Client(base_url=service, timeout=60, headers=AUTH) as client:
        job = client.post("/v1/images/jobs", json={"prompt": "a slow fox", "width": 256, "height": 256,
                                                    "steps": 200}).json()  # still running when killed
        deadline = time.monotonic() + 60
        while client.get(f"/v1/images/jobs/{job['id']}").json()["state"] != "running":
            assert time.monotonic() < deadline
            time.sleep(0.05)
        victim = owner(job["id"])
        actors = [a for a in ray.util.list_named_actors(all_namespaces=True) if victim in a["name"]]
        assert actors, f"no replica actor named for {victim}"
        ray.kill(ray.get_actor(actors[0]["name"], namespace=actors[0]["namespace"]), no_restart=True)
        lost = finish(client, job["id"], timeout=60)
        assert lost["state"] == "failed" and lost["error"]["code"] == "replica_lost", lost
        after = client.post("/v1/images/jobs", json={"prompt": "a fox", "width": 64, "height": 64, "steps": 2})
        assert after.status_code == 202 and owner(after.json()["id"]) != victim
        assert finish(client, after.json()["id"])["state"] == "done"
        assert client.get("/v1/images/status").status_code == 200  # while Ray Serve replaces the replica


def test_the_front_guards_before_it_reads_a_body(service: str) -> None:
    """The front is the door: no token is a 401 (a load too, not a 409), a foreign Host a 403, a body
    past the cap a 413, declared or streamed; the token passes, as ?token= on an event route does."""
    big = b"x" * (3 * MAX_BODY)
    with httpx.Client(base_url=service, timeout=60) as anonymous:
        for method, path in (("POST", "/v1/images/load"), ("POST", "/v1/images/jobs"), ("GET", "/v1/images/status")):
            answer = anonymous.request(method, path, content=big if method == "POST" else None,
                                       headers={"content-type": "application/json"})
            assert answer.status_code == 401 and answer.json()["error"]["code"] == "unauthorized", answer.text
        foreign = anonymous.get("/v1/images/status", headers={**AUTH, "Host": "evil.example"})
        assert foreign.status_code == 403 and foreign.json()["error"]["code"] == "host_not_allowed"
        declared = anonymous.post("/v1/images/jobs", content=big, headers={**AUTH, "content-type": "application/json"})
        assert declared.status_code == 413 and declared.json()["error"]["code"] == "body_too_large"

        def chunks() -> Iterator[bytes]:  # no Content-Length: counted as it streams in
            for _ in range(3):
                yield b"x" * MAX_BODY

        streamed = anonymous.post("/v1/images/jobs", content=chunks(), headers={**AUTH, "content-type": "application/json"})
        assert streamed.status_code == 413 and streamed.json()["error"]["code"] == "body_too_large"
        assert anonymous.get("/v1/images/status", headers=AUTH).status_code == 200
        refused_load = anonymous.post("/v1/images/load", json={"model": "x"}, headers=AUTH)
        assert refused_load.status_code == 409  # with the token: the replicated service's own refusal
        with anonymous.stream("GET", "/v1/training/events", params={"token": TOKEN}) as events:
            assert events.status_code == 200, events.read()


def test_nothing_of_the_service_listens_beyond_loopback(service: str) -> None:
    """Ray's own servers (GCS, raylet, workers, agents), the Serve proxy and the replicas' apps: every
    listening socket of every process of this Ray is on loopback (they were on every interface)."""
    import ipaddress

    import psutil

    node = ray._private.worker.global_worker.node
    roots = [psutil.Process(int(p.process.pid)) for infos in node.all_processes.values() for p in infos]
    processes = {p for root in roots for p in [root, *root.children(recursive=True)]}
    processes |= {psutil.Process(), *psutil.Process().children(recursive=True)}
    listening = []
    for process in processes:
        try:
            listening += [(process.name(), c.laddr) for c in process.net_connections(kind="inet")
                          if c.status == psutil.CONN_LISTEN]
        except psutil.NoSuchProcess:
            continue
    names = {name for name, _ in listening}
    assert any("gcs" in n for n in names) and any("raylet" in n for n in names), names  # the check sees Ray
    outside = [(name, address) for name, address in listening
               if not (getattr(a := ipaddress.ip_address(address.ip), "ipv4_mapped", None) or a).is_loopback]
    assert not outside, outside
