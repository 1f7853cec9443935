"""The built-in demo model: the trained reference model shipped in the package, unpacked into
CDE_HOME safely (nothing lands outside its directory), atomically and once, also when several
processes start at the same time; served with no --model (real `cde serve`, real openai client),
it searches, steers by label and solves held-out arithmetic, judged by the training program's own
checkers (an independent reference: the engine and the API never read them)."""

import io
import os
import subprocess
import sys
import tarfile

import pytest
from cde.worker.checkpoint import load_checkpoint
from cde.worker.demo_model import DEMO_NAME, ArchiveError, install

from cde.train import heldout, tasks
from cde.train.text import on_topic_share
from tests.api_server import REPO, ServerProcess

DEMO_DIR = "from cde.worker.demo_model import demo_model_dir; print(demo_model_dir())"


def _archive(path, files: dict[str, bytes], symlinks: dict[str, str] | None = None):
    with tarfile.open(path, "w:xz") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        for name, target in (symlinks or {}).items():
            info = tarfile.TarInfo(name)
            info.type, info.linkname = tarfile.SYMTYPE, target
            tar.addfile(info)
    return path


@pytest.mark.parametrize(
    "files,symlinks",
    [
        ({"config.json": b"{}", "../escaped": b"x"}, None),
        ({"config.json": b"{}"}, {"link": "../../escaped"}),
    ],
)
def test_install_never_writes_outside_its_directory(tmp_path, files, symlinks):
    home = tmp_path / "home"
    packed = _archive(tmp_path / "evil.tar.xz", files, symlinks)
    with pytest.raises(ArchiveError, match="refused to unpack"):
        install(packed, home, "m")
    assert not (tmp_path / "escaped").exists() and not (home.parent.parent / "escaped").exists()
    assert list(home.iterdir()) == []  # no model directory, no half-unpacked temporary


def test_install_keeps_absolute_names_inside_its_directory(tmp_path):
    outside = tmp_path / "absolute"
    dest = install(_archive(tmp_path / "a.tar.xz", {"config.json": b"{}", str(outside): b"x"}), tmp_path / "home", "m")
    assert not outside.exists() and (dest / str(outside).lstrip("/")).read_bytes() == b"x"


def test_install_is_atomic_and_once(tmp_path):
    home = tmp_path / "home"
    with pytest.raises(ArchiveError, match=r"no config\.json"):
        install(_archive(tmp_path / "bad.tar.xz", {"model.safetensors": b"x"}), home, "m")
    assert list(home.iterdir()) == []
    dest = install(_archive(tmp_path / "ok.tar.xz", {"config.json": b"{}", "w": b"1"}), home, "m")
    assert dest == home / "m" and sorted(p.name for p in dest.iterdir()) == ["config.json", "w"]
    (dest / "w").write_text("kept")
    (tmp_path / "ok.tar.xz").unlink()  # found installed: the archive is not read again
    assert install(tmp_path / "ok.tar.xz", home, "m") == dest and (dest / "w").read_text() == "kept"


def test_first_use_from_several_processes_at_once(tmp_path):
    """Three processes unpack the shipped archive at the same moment: all get the same complete
    directory; no temporary is left behind."""
    env = {**os.environ, "CDE_HOME": str(tmp_path)}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", DEMO_DIR],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(3)
    ]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], [err for _, err in outs]
    [path] = {out.strip() for out, _ in outs}
    [digest] = (tmp_path / "demo").iterdir()
    assert [p.name for p in digest.iterdir()] == [DEMO_NAME] and path == str(digest / DEMO_NAME)
    cfg, _ = load_checkpoint(path)
    assert cfg.instruct and cfg.n_concepts == 77


def test_serving_the_demo_never_imports_the_training_program(tmp_path):
    code = (
        "import sys, cde.cli, cde.commands.serve, cde.commands.generate, cde.commands.bench_engine, "
        "worker.zmq_server, worker.engine, gateway.app; " + DEMO_DIR + "; sys.exit('cde.train' in sys.modules)"
    )
    res = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        env={**os.environ, "CDE_HOME": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert res.returncode == 0, res.stderr


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """`cde serve` with no --model, in a fresh CDE_HOME."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CDE_HOME", str(tmp_path_factory.mktemp("cde-home")))
        srv = ServerProcess(None, workers=1)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(demo):
    from openai import OpenAI

    return OpenAI(base_url=demo.base_url, api_key="none")


def test_the_demo_is_served_under_its_name(client):
    assert [m.id for m in client.models.list().data] == [DEMO_NAME]


def test_the_demo_solves_held_out_arithmetic(client):
    probs = [p for p in heldout.problems(2, seed=1) if p.family == "arithmetic"]
    for p in probs:
        reply = (
            client.chat.completions.create(
                model=DEMO_NAME, messages=heldout.messages(p), max_tokens=heldout.MAX_TOKENS, temperature=0
            )
            .choices[0]
            .message.content
        )
        assert tasks.check(p, reply), (p.prompt, reply)


def test_the_demo_searches_and_steers_by_label(demo, client):
    import httpx

    hits = httpx.get(demo.base_url + "/concepts", params={"search": "ocean"}, timeout=30).json()["data"]
    assert hits[0]["name"] == "Ocean" and hits[0]["group_name"] == "Ocean"
    group = httpx.get(f"{demo.base_url}/concepts/{hits[0]['id']}", timeout=30).json()["group"]
    assert [
        c["name"]
        for c in httpx.get(demo.base_url + "/concepts", params={"limit": 200}, timeout=30).json()["data"]
        if c["id"] in group["concept_ids"]
    ] == ["Ocean", "Marine life", "Sailing", "Seashore"]

    def text(steering=None):
        out = client.chat.completions.create(
            model=DEMO_NAME,
            messages=[{"role": "user", "content": "Write a few sentences."}],
            max_tokens=64,
            temperature=0,
            extra_body={"steering": steering} if steering else None,
        )
        return out.choices[0].message.content

    # A neutral prompt: the unsteered reply is about something else; steered, about the ocean.
    assert on_topic_share(text(), "Ocean") < 0.5
    by_label = text({"concepts": ["ocean"], "preset": "amplify", "strength": 32})
    assert on_topic_share(by_label, "Ocean") >= 0.5, by_label
    assert by_label == text({"concepts": [hits[0]["id"]], "preset": "amplify", "strength": 32})


class _Zeros(io.RawIOBase):
    """`size` zero bytes, read without holding them."""

    def __init__(self, size: int):
        self.left = size

    def readinto(self, buf) -> int:
        n = min(len(buf), self.left)
        buf[:n] = bytes(n)
        self.left -= n
        return n


def test_an_archive_that_unpacks_past_its_limit_is_refused(tmp_path):
    """Issue 32, finding 8: a 305 KB .tar.xz wrote 2 GiB. An archive unpacks to at most 32x its
    size + 64 MiB: this one (~15 KB) says 96 MiB and is refused before that member is written,
    and what it did write is removed."""
    packed = tmp_path / "bomb.tar.xz"
    with tarfile.open(packed, "w:xz", preset=0) as tar:
        first = tarfile.TarInfo("config.json")
        first.size = 2
        tar.addfile(first, io.BytesIO(b"{}"))
        bomb = tarfile.TarInfo("model.safetensors")
        bomb.size = 96 << 20
        tar.addfile(bomb, _Zeros(bomb.size))
    assert packed.stat().st_size < 1 << 20
    home = tmp_path / "home"
    with pytest.raises(ArchiveError, match="refused to unpack past"):
        install(packed, home, "m")
    assert list(home.iterdir()) == []
