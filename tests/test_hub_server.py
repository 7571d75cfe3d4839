"""Tests of the loopback Hugging Face Hub (tests/hub_server.py) driven by the real huggingface_hub/transformers.

Every request goes to 127.0.0.1 only: in-process tests patch huggingface_hub's import-time constants with
``hub.patch_client``; subprocess tests set ``HF_ENDPOINT`` & co. before huggingface_hub is imported.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import urllib.error
import urllib.request
from pathlib import Path

import pytest


sys.path.insert(0, str(Path(__file__).resolve().parent))
from hub_server import DEFAULT_TOKEN, DEFAULT_USER, LoopbackHub  # noqa: E402


huggingface_hub = pytest.importorskip("huggingface_hub")
from huggingface_hub import HfApi, hf_hub_download, snapshot_download  # noqa: E402
from huggingface_hub import constants as hf_constants  # noqa: E402
from huggingface_hub.errors import (  # noqa: E402
    HfHubHTTPError,
    LocalEntryNotFoundError,
    OfflineModeIsEnabled,
    RemoteEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)


OTHER_TOKEN = "hf_loopback_other_token"
SUBPROCESS_TIMEOUT = 60


@pytest.fixture
def hub():
    with LoopbackHub(tokens={DEFAULT_TOKEN: DEFAULT_USER, OTHER_TOKEN: "other"}) as server:
        yield server
    assert server._server is None  # stopped by the context manager


@pytest.fixture
def api(hub, tmp_path):
    """An HfApi pointed at the loopback hub (created inside the patch: HfApi freezes its endpoint at init)."""
    with hub.patch_client(cache_dir=tmp_path / "cache"):
        yield HfApi(token=hub.token)


def _no_proxy_opener():
    return urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _folder(tmp_path: Path, files: dict[str, str]) -> Path:
    root = tmp_path / "folder"
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def _tiny_vit_dir(tmp_path: Path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    config = transformers.ViTConfig(
        image_size=8, patch_size=4, num_channels=3, hidden_size=8, num_hidden_layers=2,
        num_attention_heads=2, intermediate_size=16, num_labels=3,
    )
    torch.manual_seed(0)
    model = transformers.ViTForImageClassification(config).eval()
    out = tmp_path / "tiny-vit"
    model.save_pretrained(out)
    return model, out


def test_create_repo_private_exist_ok_and_token_is_sent(hub, api):
    url = huggingface_hub.create_repo("user/tiny", private=True, token=hub.token)  # module-level HfApi is patched too
    assert url.startswith(hub.url) and url.repo_id == "user/tiny"
    again = api.create_repo("user/tiny", private=True, exist_ok=True)
    assert again.repo_id == "user/tiny"
    with pytest.raises(HfHubHTTPError) as exc:
        api.create_repo("user/tiny")
    assert exc.value.response.status_code == 409

    info = api.repo_info("user/tiny")
    assert info.private is True and info.id == "user/tiny"
    assert [s.rfilename for s in info.siblings] == [".gitattributes"]  # the Hub's initial commit
    assert api.whoami()["name"] == DEFAULT_USER

    log = hub.requests_log
    assert [r.path for r in log[:3]] == ["/api/repos/create"] * 3
    assert [r.status for r in log[:3]] == [200, 409, 409]
    assert all(r.authorization == f"Bearer {hub.token}" for r in log)
    assert hub.unhandled_requests() == []


def test_private_repo_rejects_missing_wrong_and_foreign_tokens(hub, api, tmp_path):
    api.create_repo("user/secret", private=True)
    api.upload_file(path_or_fileobj=b"top secret", path_in_repo="notes.txt", repo_id="user/secret")

    # No token: 401 + RepoNotFound, like the Hub (which does not reveal that the repo exists).
    with pytest.raises(RepositoryNotFoundError) as exc:
        hf_hub_download("user/secret", "notes.txt", token=False, cache_dir=tmp_path / "c1")
    assert exc.value.response.status_code == 401
    with pytest.raises(RepositoryNotFoundError):
        HfApi(token=False).model_info("user/secret")
    # Valid token of a user without access: 404.
    with pytest.raises(RepositoryNotFoundError) as exc:
        hf_hub_download("user/secret", "notes.txt", token=OTHER_TOKEN, cache_dir=tmp_path / "c2")
    assert exc.value.response.status_code == 404
    # Unknown token: 401 on any endpoint.
    with pytest.raises(HfHubHTTPError) as exc:
        HfApi(token="hf_not_a_real_token").model_info("user/secret")
    assert exc.value.response.status_code == 401
    # Other users cannot write either.
    with pytest.raises(HfHubHTTPError) as exc:
        HfApi(token=OTHER_TOKEN).create_repo("user/theirs")
    assert exc.value.response.status_code == 403

    path = hf_hub_download("user/secret", "notes.txt", token=hub.token, cache_dir=tmp_path / "c3")
    assert Path(path).read_bytes() == b"top secret"

    downloads = [r for r in hub.requests_log if "/resolve/" in r.path]
    assert [(r.method, r.status, r.authorization) for r in downloads] == [
        ("HEAD", 401, None),
        ("HEAD", 404, f"Bearer {OTHER_TOKEN}"),
        ("HEAD", 200, f"Bearer {hub.token}"),
        ("GET", 200, f"Bearer {hub.token}"),
    ]


def test_upload_folder_then_transformers_from_pretrained(hub, api, tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    model, model_dir = _tiny_vit_dir(tmp_path)
    api.create_repo("user/tiny-vit", private=True)
    commit = api.upload_folder(repo_id="user/tiny-vit", folder_path=model_dir, commit_message="add model")

    weights = (model_dir / "model.safetensors").read_bytes()
    assert hub.read_file("user/tiny-vit", "model.safetensors") == weights
    assert hub.get_repo("user/tiny-vit").branches["main"] == commit.oid
    paths = [r.path for r in hub.requests_log]
    assert "/api/models/user/tiny-vit/preupload/main" in paths
    assert "/api/models/user/tiny-vit/commit/main" in paths
    assert not any("lfs" in p or "xet" in p for p in paths)  # small safetensors went as regular files

    hub.clear_log()
    loaded = transformers.AutoModelForImageClassification.from_pretrained("user/tiny-vit", token=hub.token).eval()
    x = torch.randn(2, 3, 8, 8)
    with torch.no_grad():
        torch.testing.assert_close(loaded(x).logits, model(x).logits)
    log = hub.requests_log
    assert any(r.method == "HEAD" and r.path.endswith("/model.safetensors") for r in log)
    assert any(r.method == "GET" and r.path.endswith("/model.safetensors") for r in log)
    assert all(r.authorization == f"Bearer {hub.token}" for r in log)
    assert hub.unhandled_requests() == []

    # Same files once more: the client skips the no-op commit (preupload returns the remote oids).
    again = api.upload_folder(repo_id="user/tiny-vit", folder_path=model_dir)
    assert again.oid == commit.oid


def test_branch_revisions_and_errors(hub, api, tmp_path):
    api.create_repo("user/rev")
    main_commit = api.upload_file(path_or_fileobj=b"v1", path_in_repo="dir/weights.txt", repo_id="user/rev")
    api.create_branch("user/rev", branch="dev")
    dev_commit = api.upload_file(
        path_or_fileobj=b"v2", path_in_repo="dir/weights.txt", repo_id="user/rev", revision="dev"
    )
    api.upload_file(path_or_fileobj=b"{}", path_in_repo="extra.json", repo_id="user/rev", revision="dev")
    api.create_tag("user/rev", tag="v1.0", revision=main_commit.oid)

    cache = tmp_path / "dl"
    assert Path(hf_hub_download("user/rev", "dir/weights.txt", cache_dir=cache)).read_bytes() == b"v1"
    assert Path(hf_hub_download("user/rev", "dir/weights.txt", revision="dev", cache_dir=cache)).read_bytes() == b"v2"
    assert Path(hf_hub_download("user/rev", "dir/weights.txt", revision="v1.0", cache_dir=cache)).read_bytes() == b"v1"
    pinned = hf_hub_download("user/rev", "dir/weights.txt", revision=dev_commit.oid, cache_dir=cache)
    assert Path(pinned).read_bytes() == b"v2"

    assert api.model_info("user/rev").sha == main_commit.oid
    dev_info = api.model_info("user/rev", revision="dev")
    assert dev_info.sha != main_commit.oid
    assert sorted(s.rfilename for s in dev_info.siblings) == [".gitattributes", "dir/weights.txt", "extra.json"]
    refs = api.list_repo_refs("user/rev")
    assert {b.name for b in refs.branches} == {"main", "dev"} and [t.name for t in refs.tags] == ["v1.0"]
    assert len(api.list_repo_commits("user/rev", revision="dev")) == 4  # initial + 1 on main + 2 on dev

    snap = Path(snapshot_download("user/rev", revision="dev", cache_dir=tmp_path / "snap"))
    assert (snap / "extra.json").read_bytes() == b"{}" and (snap / "dir" / "weights.txt").read_bytes() == b"v2"
    assert not (Path(snapshot_download("user/rev", cache_dir=tmp_path / "snap")) / "extra.json").exists()

    with pytest.raises(RevisionNotFoundError):
        hf_hub_download("user/rev", "dir/weights.txt", revision="nope", cache_dir=cache)
    with pytest.raises(RevisionNotFoundError):
        api.upload_file(path_or_fileobj=b"x", path_in_repo="x", repo_id="user/rev", revision="nope")
    with pytest.raises(RemoteEntryNotFoundError):
        hf_hub_download("user/rev", "missing.bin", cache_dir=cache)
    with pytest.raises(RepositoryNotFoundError):
        api.model_info("user/does-not-exist")
    assert hub.unhandled_requests() == []


def test_dataset_repo_deletions_and_pull_request(hub, api, tmp_path):
    from huggingface_hub import CommitOperationAdd, CommitOperationDelete

    api.create_repo("user/data", repo_type="dataset")
    folder = _folder(tmp_path, {"a/1.txt": "1", "a/2.txt": "2", "b.txt": "b"})
    api.upload_folder(repo_id="user/data", repo_type="dataset", folder_path=folder)
    api.create_commit(
        "user/data", repo_type="dataset", commit_message="prune",
        operations=[CommitOperationDelete("a/"), CommitOperationAdd("c.txt", b"c")],
    )
    assert sorted(api.list_repo_files("user/data", repo_type="dataset")) == [".gitattributes", "b.txt", "c.txt"]
    assert api.dataset_info("user/data").id == "user/data"
    path = hf_hub_download("user/data", "c.txt", repo_type="dataset", cache_dir=tmp_path / "dl")
    assert Path(path).read_bytes() == b"c"

    pr = api.create_commit(
        "user/data", repo_type="dataset", commit_message="proposal", create_pr=True,
        operations=[CommitOperationAdd("b.txt", b"changed")],
    )
    assert pr.pr_url is not None and pr.pr_revision == "refs/pr/1"
    refs = api.list_repo_refs("user/data", repo_type="dataset", include_pull_requests=True)
    assert [ref.ref for ref in refs.pull_requests] == ["refs/pr/1"]
    proposed = hf_hub_download("user/data", "b.txt", repo_type="dataset", revision="refs/pr/1", cache_dir=tmp_path)
    assert Path(proposed).read_bytes() == b"changed"
    assert hub.read_file("user/data", "b.txt", repo_type="dataset") == b"b"  # main untouched
    assert hub.unhandled_requests() == []


def test_readme_yaml_validator_hook(tmp_path):
    def validator(content: str, repo_type: str) -> list[str]:
        return [] if "license:" in content else ["license is required"]

    with LoopbackHub(yaml_validator=validator) as hub, hub.patch_client(cache_dir=tmp_path / "cache"):
        api = HfApi(token=hub.token)
        api.create_repo("user/card")
        api.upload_file(path_or_fileobj=b"---\nlicense: mit\n---\n", path_in_repo="README.md", repo_id="user/card")
        with pytest.raises(ValueError, match="license is required"):
            api.upload_file(path_or_fileobj=b"---\ntags: [x]\n---\n", path_in_repo="README.md", repo_id="user/card")
        assert hub.read_file("user/card", "README.md").startswith(b"---\nlicense: mit")


def test_offline_mode_in_process_uses_cache_and_sends_nothing(hub, tmp_path):
    transformers = pytest.importorskip("transformers")
    _, model_dir = _tiny_vit_dir(tmp_path)
    cache = tmp_path / "cache"
    with hub.patch_client(cache_dir=cache):
        HfApi(token=hub.token).create_repo("user/offline", private=True)
        HfApi(token=hub.token).upload_folder(repo_id="user/offline", folder_path=model_dir)
        transformers.AutoConfig.from_pretrained("user/offline", token=hub.token)  # fills the cache
    hub.clear_log()
    with hub.patch_client(cache_dir=cache, offline=True):
        assert transformers.AutoConfig.from_pretrained("user/offline", token=hub.token).num_labels == 3
        with pytest.raises(OSError):
            transformers.AutoConfig.from_pretrained("user/never-downloaded", token=hub.token)
        with pytest.raises(LocalEntryNotFoundError) as exc:
            hf_hub_download("user/offline", "model.safetensors", cache_dir=tmp_path / "empty")
        assert isinstance(exc.value.__cause__, OfflineModeIsEnabled)
    assert hub.requests_log == []


def test_resolve_headers_head_and_range(hub, api):
    api.create_repo("user/raw")
    commit = api.upload_file(path_or_fileobj=b"0123456789", path_in_repo="data.bin", repo_id="user/raw")
    url = f"{hub.url}/user/raw/resolve/main/data.bin"
    opener = _no_proxy_opener()
    with opener.open(urllib.request.Request(url, method="HEAD")) as resp:
        assert resp.status == 200 and resp.read() == b""
        assert resp.headers["X-Repo-Commit"] == commit.oid
        assert resp.headers["Content-Length"] == "10"
        assert resp.headers["ETag"].strip('"') == hub.get_repo("user/raw").commits[commit.oid].files["data.bin"].git_oid
    with opener.open(urllib.request.Request(url, headers={"Range": "bytes=3-"})) as resp:
        assert resp.status == 206 and resp.read() == b"3456789"
        assert resp.headers["Content-Range"] == "bytes 3-9/10"
    with pytest.raises(urllib.error.HTTPError) as exc:
        opener.open(f"{hub.url}/user/raw/resolve/main/nothing")
    assert exc.value.code == 404 and exc.value.headers["X-Error-Code"] == "EntryNotFound"
    assert exc.value.headers["X-Repo-Commit"] == commit.oid


@pytest.mark.filterwarnings("ignore:Use .content=:DeprecationWarning")  # raised inside huggingface_hub lfs.py
def test_lfs_mode_uploads_through_lfs_batch_api(tmp_path):
    payload = bytes(range(256)) * 64
    with LoopbackHub(lfs_mode="auto") as hub, hub.patch_client(cache_dir=tmp_path / "cache"):
        api = HfApi(token=hub.token)
        api.create_repo("user/lfs")
        api.upload_file(path_or_fileobj=payload, path_in_repo="model.safetensors", repo_id="user/lfs")
        api.upload_file(path_or_fileobj=b"{}", path_in_repo="config.json", repo_id="user/lfs")
        paths = [(r.method, r.path.split("?")[0]) for r in hub.requests_log]
        assert ("POST", "/user/lfs.git/info/lfs/objects/batch") in paths
        assert any(m == "PUT" and p.startswith("/lfs-upload/") for m, p in paths)
        assert not any("xet" in p for _, p in paths)
        siblings = {s.rfilename: s for s in api.model_info("user/lfs", files_metadata=True).siblings}
        assert siblings["model.safetensors"].lfs is not None and siblings["model.safetensors"].size == len(payload)
        assert siblings["config.json"].lfs is None
        assert Path(hf_hub_download("user/lfs", "model.safetensors")).read_bytes() == payload
        assert hub.unhandled_requests() == []


def test_patch_client_restores_and_server_stops(tmp_path):
    endpoint, template = hf_constants.ENDPOINT, hf_constants.HUGGINGFACE_CO_URL_TEMPLATE
    api_endpoint = huggingface_hub.hf_api.api.endpoint
    transformers_hub = pytest.importorskip("transformers.utils.hub")
    shared_api = transformers_hub.hf_api()  # transformers' shared HfApi, endpoint frozen at creation
    hub = LoopbackHub().start()
    url = hub.url
    try:
        with hub.patch_client(cache_dir=tmp_path):
            assert hf_constants.ENDPOINT == url and huggingface_hub.hf_api.api.endpoint == url
            assert hf_constants.HF_HUB_DISABLE_XET and hf_constants.HF_HUB_DISABLE_TELEMETRY
            assert transformers_hub.hf_api().endpoint == url
        assert (hf_constants.ENDPOINT, hf_constants.HUGGINGFACE_CO_URL_TEMPLATE) == (endpoint, template)
        assert huggingface_hub.hf_api.api.endpoint == api_endpoint
        assert transformers_hub.hf_api() is shared_api
        with _no_proxy_opener().open(f"{url}/api/agent-harnesses", timeout=5) as resp:
            assert resp.status == 200
    finally:
        hub.stop()
    hub.stop()  # idempotent
    with pytest.raises(urllib.error.URLError):
        _no_proxy_opener().open(f"{url}/api/agent-harnesses", timeout=5)


def _run_client(script: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)],
        env=env, capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT,
    )


def test_hf_endpoint_env_in_subprocess_and_offline_mode(hub, tmp_path):
    """The documented env-var route: HF_ENDPOINT set before huggingface_hub is imported (here with xet *enabled*:
    the server answers "regular" to preupload, so no xet traffic happens even then)."""
    env = hub.client_env(hf_home=tmp_path / "hf_home", token=hub.token)
    env["HF_HUB_DISABLE_XET"] = "0"
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "config.json").write_text('{"a": 1}')
    (folder / "model.safetensors").write_bytes(b"\x01" * 2048)
    online = _run_client(
        f"""
        import json, sys
        from huggingface_hub import constants, create_repo, hf_hub_download, upload_folder
        assert constants.ENDPOINT == {hub.url!r}, constants.ENDPOINT
        assert constants.HF_HUB_DISABLE_TELEMETRY
        create_repo("user/sub", private=True)
        upload_folder(repo_id="user/sub", folder_path={str(folder)!r})
        print(json.dumps(open(hf_hub_download("user/sub", "config.json")).read()))
        """,
        env,
    )
    assert online.returncode == 0, online.stderr
    assert json.loads(online.stdout.strip().splitlines()[-1]) == '{"a": 1}'
    assert hub.read_file("user/sub", "model.safetensors") == b"\x01" * 2048
    assert all(r.authorization == f"Bearer {hub.token}" for r in hub.requests_log)  # HF_TOKEN env var was used
    assert not any("xet" in r.path or "lfs" in r.path for r in hub.requests_log)

    n_requests = len(hub.requests_log)
    offline_env = hub.client_env(hf_home=tmp_path / "empty_home", token=hub.token)
    offline_env["HF_HUB_OFFLINE"] = "1"
    offline = _run_client(
        """
        from huggingface_hub import hf_hub_download
        try:
            hf_hub_download("user/sub", "config.json")
        except Exception as exc:
            print(type(exc).__name__)
        else:
            print("DOWNLOADED")
        """,
        offline_env,
    )
    assert offline.returncode == 0, offline.stderr
    assert offline.stdout.strip().splitlines()[-1] in ("LocalEntryNotFoundError", "OfflineModeIsEnabled")
    assert len(hub.requests_log) == n_requests  # offline mode sent nothing
