"""The concept catalog against the official `steerling.concepts.ConceptCatalog` on the same
parquet: search (ranking and tie order), groups, every column of a file `write_catalog` wrote;
and the lookup order, run in real processes against a Hugging Face cache built on disk
(HF_HUB_OFFLINE=1: nothing reaches the network)."""

import dataclasses
import hashlib
import http.server
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import ClassVar

import pytest
from cde.shared.catalog import Catalog, CatalogError, find_catalog, write_catalog
from cde.shared.catalog_file import CatalogFile
from cde.shared.chunk_attribution import load_concept_labels

from tests.catalog_fixture import N_KNOWN, QUERIES, catalog_rows
from tests.hub_cache import cache_repo

pytestmark = pytest.mark.reference

FILTERS = [{}, {"steerable_only": False}, {"head": None}, {"head": "unknown", "steerable_only": False}]


@pytest.fixture(scope="module")
def parquet(tmp_path_factory):
    return write_catalog(tmp_path_factory.mktemp("catalog") / "concept_labels.parquet", catalog_rows())


@pytest.fixture(scope="module")
def official(parquet):
    import pandas as pd
    from steerling.concepts import ConceptCatalog

    return ConceptCatalog(pd.read_parquet(parquet))


@pytest.mark.parametrize("query", QUERIES)
@pytest.mark.parametrize("filters", FILTERS, ids=str)
def test_search_equals_the_official(parquet, official, query, filters):
    ours = Catalog.read(parquet)
    for limit in (10, 1000):
        got = [c.concept_id for c in ours.search(query, limit=limit, **filters)]
        assert got == [c.concept_id for c in official.search(query, limit=limit, **filters)]


def test_the_fixture_has_ties_past_an_insertion_sort():
    # numpy's quicksort only differs from a stable sort past 16 elements: the tie order is
    # tested only if some search has more equal scores than that.
    hits = Catalog.from_rows(catalog_rows()).search("the", limit=1000, head=None, steerable_only=False)
    assert len(hits) > 16


def test_groups_equal_the_official(parquet, official):
    ours = Catalog.read(parquet)
    for cid in range(len(ours)):
        assert ours.group(cid) == official.group(cid), cid
    assert ours.group(9) == [9, 8, 11, 12, 13, 14]


def test_every_column_written_is_what_the_official_reader_reads(official):
    fields = {
        "concept_id": "concept_id",
        "concept_name": "name",
        "concept_description": "description",
        "head": "head",
        "public_group_id": "group_id",
        "group_name": "group_name",
        "is_steerable": "is_steerable",
        "is_tone": "is_tone",
        "is_alignment": "is_alignment",
        "is_demographic": "is_demographic",
    }
    for row in catalog_rows():
        expected = {fields[k]: v for k, v in row.items()}
        if row["concept_description"] is None:
            expected["description"] = "nan"  # the official Concept stringifies a null description
        assert dataclasses.asdict(official.get(row["concept_id"])) == expected


def test_reading_gives_the_official_fields(parquet, official):
    for c in Catalog.read(parquet):
        expected = dataclasses.asdict(official.get(c.concept_id))
        assert dataclasses.asdict(c) == expected | ({"description": None} if c.description is None else {})


def test_legacy_csv_is_still_read(tmp_path):
    path = tmp_path / "labels.csv"
    path.write_text("concept_idx,concept_name\n3,Dogs\n")
    (dog,) = Catalog.read(path)
    assert (dog.concept_id, dog.name, dog.head, dog.is_steerable) == (3, "Dogs", None, True)
    assert [c.concept_id for c in Catalog.read(path).search("dogs")] == [3]


@pytest.mark.parametrize("name", ["concepts.pq", "concept_labels.PARQUET", "concept_labels"])
def test_a_parquet_file_is_read_whatever_its_name(parquet, official, tmp_path, name):
    """`ConceptCatalog.load` reads any path as parquet: the file's bytes say what it is."""
    from steerling.concepts import ConceptCatalog

    path = tmp_path / name
    path.write_bytes(parquet.read_bytes())
    for query in QUERIES[:5]:
        expected = [c.concept_id for c in ConceptCatalog.load(path).search(query)]
        assert [c.concept_id for c in Catalog.read(path).search(query)] == expected, query
    assert CatalogFile.read(path).catalog().by_id.keys() == Catalog.read(parquet).by_id.keys()


def test_a_null_head_matches_no_head_filter(tmp_path):
    """A head column with a null: the official filter `df["head"] == head` leaves the row out of
    every head's search, and its attribution label reads Known."""
    import pandas as pd
    from steerling.attribution.concept_attribution import ConceptLabels as OfficialLabels
    from steerling.concepts import ConceptCatalog

    rows = [{"concept_id": i, "concept_name": f"cat {i}", "head": h} for i, h in enumerate(["known", None, "unknown"])]
    path = write_catalog(tmp_path / "heads.parquet", rows)
    table = pd.read_parquet(path)
    table.loc[1, "head"] = None  # write_catalog fills a missing head with "known"
    table.to_parquet(path)
    ours, official = Catalog.read(path), ConceptCatalog(pd.read_parquet(path))
    for head in ("known", "unknown", None):
        expected = [c.concept_id for c in official.search("cat", head=head, steerable_only=False)]
        assert [c.concept_id for c in ours.search("cat", head=head, steerable_only=False)] == expected, head
    assert load_concept_labels(path).label(1, "discovered") == OfficialLabels(path).label(1, "discovered")


def test_a_spreadsheet_csv_reads_as_the_official_labels(tmp_path):
    """A byte-order mark and ids written as floats, as a spreadsheet exports them: the official
    `ConceptLabels` reads them through pandas."""
    from steerling.attribution.concept_attribution import ConceptLabels as OfficialLabels

    path = tmp_path / "labels.csv"
    path.write_bytes("\ufeffconcept_idx,concept_name\n0.0,Ocean\n1.0,Sailing\n".encode())
    official = OfficialLabels(path)
    assert [load_concept_labels(path).label(i, "known") for i in (0, 1)] == [official.label(i) for i in (0, 1)]


@pytest.mark.parametrize(
    ("rows", "message"),
    [
        ([{"concept_id": 1, "concept_name": "a"}, {"concept_id": 1, "concept_name": "b"}], "appears more than once"),
        ([{"concept_id": 1}], "needs concept_id and concept_name"),
    ],
)
def test_bad_catalogs_are_named(tmp_path, rows, message):
    with pytest.raises(CatalogError, match=message):
        Catalog.from_rows(rows)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("garbage", "neither parquet nor a CSV"),
        ("", "neither parquet nor a CSV"),
        ("concept_id,concept_name\n", "holds no concepts"),
    ],
)
def test_a_file_that_is_no_catalog_is_refused(tmp_path, text, message):
    """Read as a catalog of 0 concepts, it served on, refusing every label by name."""
    path = tmp_path / "labels.parquet"
    path.write_text(text)
    with pytest.raises(CatalogError, match=message):
        Catalog.read(path)


@pytest.mark.parametrize("cell", ["inf", "1e400", "x1"])
def test_an_id_that_is_no_integer_is_refused_with_the_file_named(tmp_path, cell):
    path = tmp_path / "labels.csv"
    path.write_text(f"concept_id,concept_name\n1,a\n{cell},b\n")
    with pytest.raises(CatalogError, match=f"{path}: .*{cell}"):
        Catalog.read(path)


def test_a_parquet_id_column_of_lists_is_refused_with_the_file_named(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "concept_labels.parquet"
    pq.write_table(pa.table({"concept_id": [[1, 2]], "concept_name": ["a"]}), path)
    with pytest.raises(CatalogError, match=f"{path}: .*not an integer id"):
        Catalog.read(path)


def test_a_row_with_a_null_name_is_left_out(tmp_path):
    """The official reader keeps such a row (labelled "nan"); the catalog still loads."""
    rows = [{"concept_id": 1, "concept_name": "a"}, {"concept_id": 2, "concept_name": None}]
    rows.append({"concept_id": 3, "concept_name": float("nan")})
    assert [c.concept_id for c in Catalog.from_rows(rows)] == [1]


def _lookup(env: dict, *args: str) -> str:
    """`find_catalog(*args)` in a fresh process (huggingface_hub reads HF_HOME at import)."""
    code = (
        "import sys; from cde.shared.catalog import find_catalog; "
        "print(find_catalog(*[a or None for a in sys.argv[1:]]))"
    )
    clean = {k: v for k, v in os.environ.items() if k not in ("STEERLING_CONCEPTS_PATH", "HF_HOME", "HF_HUB_CACHE")}
    out = subprocess.run(
        [sys.executable, "-c", code, *args],
        env={**clean, "HF_HUB_OFFLINE": "1", **env},
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return out.stdout.strip()


@pytest.fixture()
def sources(tmp_path):
    """One catalog per source, each with a different single concept."""
    made = {}
    for source in ("explicit", "env", "model", "hub"):
        folder = tmp_path / source
        folder.mkdir()
        made[source] = write_catalog(folder / "concept_labels.parquet", [{"concept_id": 0, "concept_name": source}])
    snapshot = cache_repo(tmp_path / "hf", "guidelabs/steerling", tmp_path / "hub", commit="a" * 40)
    made["hub"] = snapshot / "concept_labels.parquet"
    return made


def test_lookup_order(tmp_path, sources):
    hf, env = {"HF_HOME": str(tmp_path / "hf")}, {"STEERLING_CONCEPTS_PATH": str(sources["env"])}
    model_dir = str(sources["model"].parent)
    assert _lookup({**hf, **env}, str(sources["explicit"]), model_dir) == str(sources["explicit"])
    assert _lookup({**hf, **env}, "", model_dir) == str(sources["env"])
    assert _lookup(hf, "", model_dir) == str(sources["model"])
    assert _lookup(hf, "", str(tmp_path)) == str(sources["hub"])
    assert _lookup({"HF_HOME": str(tmp_path / "empty")}, "", str(tmp_path)) == "None"


def test_the_hub_file_is_the_one_the_official_package_resolves(tmp_path, sources):
    code = (
        "from huggingface_hub import hf_hub_download; from steerling.concepts import _HF_FILENAME, _HF_REPO; "
        "print(hf_hub_download(_HF_REPO, _HF_FILENAME))"
    )
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"}
    official_path = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120, check=True
    ).stdout.strip()
    assert official_path == _lookup({"HF_HOME": str(tmp_path / "hf")}, "", "") == str(sources["hub"])


def test_a_named_file_must_exist(tmp_path, monkeypatch):
    with pytest.raises(CatalogError, match="--concept-labels: no concept catalog"):
        find_catalog(tmp_path / "nope.parquet", None)
    monkeypatch.setenv("STEERLING_CONCEPTS_PATH", str(tmp_path / "missing.parquet"))
    with pytest.raises(CatalogError, match="STEERLING_CONCEPTS_PATH: no concept catalog"):
        find_catalog(None, None)


def test_known_count_matches_the_tiny_preset():
    from cde.shared.config import preset

    assert preset("tiny").n_concepts == N_KNOWN


def test_a_missing_catalog_stops_the_server_with_a_message(tmp_path):
    cmd = [
        sys.executable,
        "-m",
        "cde",
        "gateway",
        "--worker",
        "tcp://127.0.0.1:9",
        "--port",
        "0",
        "--concept-labels",
        str(tmp_path / "nope.parquet"),
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "Traceback" not in out.stderr
    assert f"cde gateway: --concept-labels: no concept catalog at {tmp_path / 'nope.parquet'}" in out.stderr


class _FakeHub(http.server.BaseHTTPRequestHandler):
    """The Hub's file endpoint (`/{repo}/resolve/{revision}/{file}`) on loopback, serving one file:
    what `hf_hub_download` asks for, so the fetch path runs for real without the network."""

    body = b""
    hits: ClassVar[list[str]] = []

    def _headers(self):
        if not self.path.startswith("/guidelabs/steerling/resolve/main/concept_labels.parquet"):
            self.send_error(404)
            return False
        self.hits.append(self.command)
        etag = '"' + hashlib.sha256(self.body).hexdigest() + '"'
        self.send_response(200)
        for k, v in {
            "X-Repo-Commit": "b" * 40,
            "ETag": etag,
            "Content-Length": str(len(self.body)),
            "Content-Type": "application/octet-stream",
        }.items():
            self.send_header(k, v)
        self.end_headers()
        return True

    def do_HEAD(self):
        self._headers()

    def do_GET(self):
        if self._headers():
            self.wfile.write(self.body)

    def log_message(self, *args):
        pass


def test_a_model_from_the_hub_fetches_its_catalog_from_the_hub(tmp_path, sources):
    _FakeHub.body = sources["explicit"].read_bytes()
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _FakeHub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        # The Hub client backs off between its retries (1 + 2 + 4 + 8 + 8 s once the Hub is gone):
        # the child retries as often, without the waits.
        code = (
            "import sys, time; time.sleep = lambda s: None; from cde.shared.catalog import find_catalog; "
            "print(find_catalog(None, sys.argv[1], fetch=sys.argv[2] == '1'))"
        )
        clean = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "STEERLING_CONCEPTS_PATH"))}
        env = {**clean, "HF_HOME": str(tmp_path / "fresh"), "HF_ENDPOINT": f"http://127.0.0.1:{server.server_port}"}
        run = lambda fetch: subprocess.run(
            [sys.executable, "-c", code, str(tmp_path), fetch],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        )
        assert run("0").stdout.strip() == "None" and not _FakeHub.hits  # a directory's model never reaches out
        fetched = Path(run("1").stdout.strip())
        assert "GET" in _FakeHub.hits and fetched.read_bytes() == _FakeHub.body
        assert fetched.is_relative_to(tmp_path / "fresh")  # cached like the weights
        server.shutdown()
        server.server_close()  # refused at once: a bound socket nobody answers costs every retry's timeout
        again = run("1")  # the Hub gone: the cached copy still serves (after the Hub client's retries)
        assert Path(again.stdout.strip()) == fetched
        env["HF_HOME"] = str(tmp_path / "empty")
        env["HF_HUB_OFFLINE"] = "1"  # the same outcome as an unreachable Hub, without its retries
        gone = run("1")  # neither Hub nor cache: no catalog, a warning, no failure
        assert gone.stdout.strip() == "None" and "not fetched" in gone.stderr
    finally:
        server.server_close()


def test_random_queries_equal_the_official(parquet, official):
    """The index (shared/catalog_index.py) against the official scan on queries mixing the
    catalog's words, repeats, case, punctuation inside and around words, and terms without a
    word character."""
    import random

    from tests.catalog_fixture import WORDS

    rng = random.Random(7)
    pieces = [*WORDS, "+", "++", "c+", "+c", "-", "--", "sea-", "-sea", "sea-water", "OCEAN", "a.", "x", "_", "é"]
    ours = Catalog.read(parquet)
    for _ in range(150):
        query = " ".join(rng.choices(pieces, k=rng.randint(1, 6)))
        filters = rng.choice(FILTERS)
        got = [c.concept_id for c in ours.search(query, limit=1000, **filters)]
        assert got == [c.concept_id for c in official.search(query, limit=1000, **filters)], (query, filters)


def test_punctuated_texts_equal_the_official(tmp_path):
    """Names and descriptions whose words are joined by punctuation as well as spaces: terms made
    of punctuation, of words and punctuation, at the ends of texts and inside them; and letters
    the official reader's strings lower otherwise than Python does."""
    import random

    import pandas as pd
    from steerling.concepts import ConceptCatalog

    rng = random.Random(11)
    words, seps = (
        ["sea", "water", "e", "mail", "c", "x", "a", "b", "_", "é"],
        [" ", "-", "--", ".", " - ", "+", "++", ""],
    )

    def text(k: int) -> str:
        return "".join(rng.choice(words) + rng.choice(seps) for _ in range(k)).strip()

    rows = [
        {"concept_id": i, "concept_name": text(rng.randint(1, 3)), "concept_description": text(8)} for i in range(300)
    ]
    # cases whose lowering differs between Python and the official reader's strings
    rows += [
        {"concept_id": 300, "concept_name": "İstanbul", "concept_description": "ΣΑΣ city"},
        {"concept_id": 301, "concept_name": "ΌΣΟΣ", "concept_description": "straße İ"},
    ]
    path = write_catalog(tmp_path / "punctuated.parquet", rows)
    ours, official = Catalog.read(path), ConceptCatalog(pd.read_parquet(path))
    for query in ("istanbul", "i̇stanbul", "σας", "σασ", "όσοσ", "όσος", "straße", "i"):
        got = [c.concept_id for c in ours.search(query, limit=1000)]
        assert got == [c.concept_id for c in official.search(query, limit=1000)], query
    for _ in range(300):
        query = " ".join(text(rng.randint(1, 2)).replace(" ", "") for _ in range(rng.randint(1, 3)))
        got = [c.concept_id for c in ours.search(query, limit=1000)]
        assert got == [c.concept_id for c in official.search(query, limit=1000)], query
