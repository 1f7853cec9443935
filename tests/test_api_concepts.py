"""GET /v1/concepts and /v1/concepts/{id} of a real `cde serve` (tiny model, CPU, one worker),
with a labels CSV given by --concept-labels; top tokens checked against the official generator."""

import csv

import httpx
import pytest

from tests.api_server import ServerProcess
from tests.oracle import official_generator

LABELS = [(0, "Dogs", "known"), (1, "hot dogs", "known"), (2, "Cats", "known"), (96, "Mystery", "unknown")]


@pytest.fixture(scope="module")
def server(tiny_official_dir, tmp_path_factory):
    path = tmp_path_factory.mktemp("labels") / "labels.csv"
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["concept_id", "concept_name", "head"])
        writer.writerows(LABELS)
    srv = ServerProcess(tiny_official_dir, "--concept-labels", str(path), workers=1)
    yield srv
    srv.stop()


def get(server, path, **params):
    return httpx.get(server.base_url + path, params=params, timeout=60)


def test_search_is_case_insensitive_substring(server):
    r = get(server, "/concepts", search="DOG")
    assert r.status_code == 200
    assert r.json() == {"object": "list", "data": [{"id": 0, "type": "known", "label": "Dogs"},
                                                    {"id": 1, "type": "known", "label": "hot dogs"}]}


def test_empty_search_lists_first_n_with_discovered_types(server):
    data = get(server, "/concepts").json()["data"]
    assert [(c["id"], c["type"]) for c in data] == [(0, "known"), (1, "known"), (2, "known"), (96, "discovered")]
    assert [c["id"] for c in get(server, "/concepts", limit=2).json()["data"]] == [0, 1]


@pytest.mark.parametrize("limit", ["0", "1001", "many"])
def test_bad_limit_is_a_400_on_limit(server, limit):
    r = get(server, "/concepts", limit=limit)
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "limit" and r.json()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("concept_id", [2, 5])
def test_top_tokens_match_the_official_generator(server, tiny_official_dir, concept_id):
    expected = official_generator(tiny_official_dir).concept_top_tokens(concept_id, k=10)
    r = get(server, f"/concepts/{concept_id}", k=10)
    assert r.status_code == 200
    body = r.json()
    assert (body["id"], body["type"]) == (concept_id, "known")
    assert body["label"] == ("Cats" if concept_id == 2 else "Known: #5")
    assert [t["token"] for t in body["top_tokens"]] == [tok for tok, _ in expected]
    assert [t["score"] for t in body["top_tokens"]] == pytest.approx([s for _, s in expected], rel=1e-5, abs=1e-6)


def test_default_k_is_15(server):
    assert len(get(server, "/concepts/3").json()["top_tokens"]) == 15


@pytest.mark.parametrize(("path", "status", "param"), [
    ("/concepts/96", 404, "id"), ("/concepts/-1", 404, "id"), ("/concepts/abc", 400, "id"),
    ("/concepts/3?k=0", 400, "k"), ("/concepts/3?k=101", 400, "k"),
])
def test_bad_concept_requests(server, path, status, param):
    r = httpx.get(server.base_url + path, timeout=60)
    assert r.status_code == status
    assert r.json()["error"]["param"] == param


def test_without_a_labels_file_known_ids_are_listed_by_number():
    from gateway.concepts import ConceptLabels

    catalog = ConceptLabels().catalog(3)
    assert catalog == [{"id": i, "type": "known", "label": f"Known: #{i}"} for i in range(3)]
