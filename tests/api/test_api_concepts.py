"""GET /v1/concepts and /v1/concepts/{id} of a real `cde serve` (tiny model, CPU, one worker) with
a catalog in the official schema given by --concept-labels: search, groups and every field
against the official `ConceptCatalog` on the same parquet, top tokens against the official
generator. (The built-in demo model's catalog: tests/worker/test_demo_model.py.)"""

import dataclasses

import httpx
import pytest
from cde.shared.catalog import write_catalog

from tests.api_server import ServerProcess
from tests.catalog_fixture import N_KNOWN, QUERIES, catalog_rows
from tests.oracle import official_generator

pytestmark = pytest.mark.reference

# API query parameters -> the official search's keyword arguments
FILTERS = [
    ({}, {}),
    ({"steerable_only": "false"}, {"steerable_only": False}),
    ({"head": "any"}, {"head": None}),
    ({"head": "unknown", "steerable_only": "0"}, {"head": "unknown", "steerable_only": False}),
]
FIELDS = (
    "name",
    "description",
    "head",
    "group_id",
    "group_name",
    "is_steerable",
    "is_tone",
    "is_alignment",
    "is_demographic",
)


@pytest.fixture(scope="module")
def catalog_path(tmp_path_factory):
    return write_catalog(tmp_path_factory.mktemp("catalog") / "labels.parquet", catalog_rows())


@pytest.fixture(scope="module")
def official(catalog_path):
    import pandas as pd
    from steerling.concepts import ConceptCatalog

    return ConceptCatalog(pd.read_parquet(catalog_path))


@pytest.fixture(scope="module")
def server(tiny_official_dir, catalog_path):
    srv = ServerProcess(tiny_official_dir, "--concept-labels", str(catalog_path), workers=1)
    yield srv
    srv.stop()


def get(server, path, **params):
    return httpx.get(server.base_url + path, params=params, timeout=60)


def as_official(entry: dict) -> dict:
    """An API entry in the official `Concept`'s fields (which stringifies a null description)."""
    out = {"concept_id": entry["id"]} | {k: entry[k] for k in FIELDS}
    return out | ({"description": "nan"} if entry["description"] is None else {})


def test_search_equals_the_official_catalog(server, official):
    for query in QUERIES:
        for params, kwargs in FILTERS:
            data = get(server, "/concepts", search=query, limit=1000, **params).json()["data"]
            expected = official.search(query, limit=1000, **kwargs)
            assert [as_official(c) for c in data] == [dataclasses.asdict(c) for c in expected], (query, params)
            assert all(c["type"] == ("known" if c["head"] == "known" else "discovered") for c in data)
    default = get(server, "/concepts", search="the").json()["data"]
    assert [c["id"] for c in default] == [c.concept_id for c in official.search("the", limit=20)]


def test_listing_is_the_catalog_in_file_order_filtered_when_asked(server, official):
    df = official.to_df()
    everything = get(server, "/concepts", limit=1000).json()["data"]
    assert [c["id"] for c in everything] == df["concept_id"].tolist()
    assert [c["label"] for c in everything] == df["concept_name"].tolist()
    steerable_known = get(server, "/concepts", limit=1000, head="known", steerable_only="true").json()["data"]
    assert [c["id"] for c in steerable_known] == df[(df["head"] == "known") & df["is_steerable"]]["concept_id"].tolist()
    assert [c["id"] for c in get(server, "/concepts", limit=2).json()["data"]] == [0, 1]


@pytest.mark.parametrize("concept_id", [2, 9, 40])
def test_one_concept_has_its_fields_group_and_top_tokens(server, official, tiny_official_dir, concept_id):
    expected = official_generator(tiny_official_dir).concept_top_tokens(concept_id, k=10)
    body = get(server, f"/concepts/{concept_id}", k=10).json()
    assert as_official(body) == dataclasses.asdict(official.get(concept_id))
    assert (body["id"], body["type"], body["label"]) == (concept_id, "known", official.get(concept_id).name)
    group = official.get(concept_id).group_id
    assert body["group"] == (
        None if group is None else {"id": group, "name": f"group {group}", "concept_ids": official.group(concept_id)}
    )
    assert [t["token"] for t in body["top_tokens"]] == [tok for tok, _ in expected]
    assert [t["score"] for t in body["top_tokens"]] == pytest.approx([s for _, s in expected], rel=1e-5, abs=1e-6)


def test_default_k_is_15(server):
    assert len(get(server, "/concepts/3").json()["top_tokens"]) == 15


@pytest.mark.parametrize(
    ("path", "status", "param"),
    [
        (f"/concepts/{N_KNOWN}", 404, "id"),
        ("/concepts/-1", 404, "id"),
        ("/concepts/abc", 400, "id"),
        ("/concepts/%D9%A1", 400, "id"),  # Arabic-Indic one: int() reads it, no client means it
        ("/concepts/%201", 400, "id"),
        ("/concepts/3?k=%201", 400, "k"),
        ("/concepts/3?k=0", 400, "k"),
        ("/concepts/3?k=101", 400, "k"),
        ("/concepts?limit=0", 400, "limit"),
        ("/concepts?limit=1001", 400, "limit"),
        ("/concepts?limit=many", 400, "limit"),
        ("/concepts?head=discovered", 400, "head"),
        ("/concepts?search=sea&steerable_only=maybe", 400, "steerable_only"),
        ("/concepts?search=" + "sea+" * 300, 400, "search"),
    ],
)
def test_bad_concept_requests(server, path, status, param):
    r = httpx.get(server.base_url + path, timeout=60)
    assert r.status_code == status
    assert r.json()["error"]["param"] == param and r.json()["error"]["type"] == "invalid_request_error"


def test_without_a_catalog_known_ids_are_listed_and_found_by_number():
    from cde.gateway.concepts import ConceptLabels

    labels = ConceptLabels()
    assert [c["label"] for c in labels.listing(3, steerable_only=False, head=None)] == [
        "Known: #0",
        "Known: #1",
        "Known: #2",
    ]
    assert [c["id"] for c in labels.search("#2", 3, limit=10, steerable_only=True, head="known")] == [2]
    assert labels.search("ocean", 3, limit=10, steerable_only=True, head="known") == []
