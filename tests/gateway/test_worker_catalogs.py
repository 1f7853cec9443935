"""The concept catalog reaches a gateway started without --model (two-host style: `cde worker`
and `cde gateway --worker ...`, real processes over TCP, plain and CURVE): names, search and
groups work as the official `steerling.concepts.ConceptCatalog` reads the worker's file. Workers
of one model that hold different catalogs: the gateway logs it and refuses steering by name."""

import time

import httpx
import pytest
from cde.shared.catalog import write_catalog

from tests.catalog_fixture import NAMED, catalog_rows
from tests.cde_procs import CdeProcess, Gateway, TinyWorker


@pytest.fixture(scope="module")
def catalogs(tmp_path_factory):
    d = tmp_path_factory.mktemp("catalogs")
    # B renames everything A names by hand: the same name means different concepts in the two.
    other = [
        r | {"concept_name": f"other {r['concept_id']}"} if r["concept_id"] in NAMED else r
        for r in catalog_rows(seed=1)
    ]
    return write_catalog(d / "a.parquet", catalog_rows()), write_catalog(d / "b.parquet", other)


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    d = tmp_path_factory.mktemp("keys")
    gen = CdeProcess("keys", "generate", str(d), "--name", "worker", "--name", "gateway")
    assert gen.proc.wait(30) == 0, gen.output
    return d


@pytest.fixture(scope="module")
def workers(tiny_dir, catalogs, keys):
    """Three workers of one model, started together: A plain, A over CURVE, B plain."""
    curve = [
        "--curve-secret-key",
        str(keys / "worker.key_secret"),
        "--curve-authorized-keys",
        str(keys / "gateway.key"),
    ]
    started = {}
    for name, catalog, extra in (("a", catalogs[0], []), ("a_curve", catalogs[0], curve), ("b", catalogs[1], [])):
        started[name] = TinyWorker(tiny_dir, "--concept-labels", str(catalog), *extra)
    for w in started.values():
        w.wait_for("worker ready", timeout=180)
    yield started
    for w in started.values():
        w.stop()


def official(parquet):
    import pandas as pd
    from steerling.concepts import ConceptCatalog

    return ConceptCatalog(pd.read_parquet(parquet))


def names_work(g: Gateway, parquet) -> None:
    ref = official(parquet)
    for query in ("ocean", "harbor", "dog cat"):
        r = httpx.get(f"{g.url}/v1/concepts", params={"search": query, "limit": 50}, timeout=30)
        assert r.status_code == 200, r.text
        assert [c["id"] for c in r.json()["data"]] == [c.concept_id for c in ref.search(query, limit=50)]
    steered = g.complete(steering={"concepts": ["harbor lights"], "group": True}, attribution={"top_k": 5})
    assert steered.status_code == 200, steered.text
    for concept in steered.json()["choices"][0]["attribution"]["chunks"][0]["concepts"]:
        if concept["type"] == "known":
            assert concept["label"] == f"Known: {ref.get(concept['id']).name}"


def test_a_gateway_without_model_gets_the_workers_catalog(workers, catalogs, gateways):
    g = gateways("--worker", workers["a"].endpoint, "--wait", "120")
    names_work(g, catalogs[0])
    assert "concept catalog" in g.output
    workers["a"].wait_for(r"CPU threads: 1 \(OMP_NUM_THREADS\)")  # logged at start


def test_the_catalog_crosses_a_curve_link(workers, catalogs, keys, gateways):
    g = gateways(
        "--worker", workers["a_curve"].endpoint, "--wait", "120",
        "--curve-secret-key", str(keys / "gateway.key_secret"), "--curve-server-key", str(keys / "worker.key"),
    )  # fmt: skip
    names_work(g, catalogs[0])


def test_workers_that_disagree_refuse_steering_by_name(workers, gateways):
    g = gateways("--worker", workers["a"].endpoint, "--worker", workers["b"].endpoint, "--wait", "120")
    r = g.complete(steering={"concepts": ["harbor lights"]})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert "hold different concept catalogs" in error["message"] and error["param"].startswith("steering")
    assert httpx.get(f"{g.url}/v1/concepts", params={"search": "ocean"}, timeout=30).status_code == 400
    assert g.complete(steering={"concepts": [9]}).status_code == 200  # ids mean the same everywhere
    deadline = time.monotonic() + 10
    while "hold different concept catalogs" not in g.output:
        assert time.monotonic() < deadline, g.output
        time.sleep(0.1)
