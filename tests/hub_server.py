"""A loopback stand-in for the Hugging Face Hub HTTP API, for tests of publishing and loading.

Standard library only. ``LoopbackHub`` runs a ``ThreadingHTTPServer`` on ``127.0.0.1`` (a free port picked by
the OS) in a daemon thread and keeps repositories in memory: every commit gets a 40-hex sha, branches and tags
map to shas. It speaks the subset of the Hub API that ``huggingface_hub`` 2.4 and ``transformers`` 5 use to
create repos, upload files/folders (preupload + NDJSON commit, regular uploads and the basic git-LFS transfer),
manage branches/tags, read repo metadata and download files (``/resolve`` with ``HEAD`` and ``GET``).

The client must be pointed at it *and* kept off the network. ``huggingface_hub`` reads ``HF_ENDPOINT`` (and
``HF_HUB_OFFLINE``, ``HF_HUB_DISABLE_TELEMETRY``, ``HF_HUB_DISABLE_XET``...) into module constants when it is
first imported, so either

* run the client in a subprocess with ``env=hub.client_env(hf_home=tmp_path)`` (the env vars then exist before
  the import), or
* in-process, wrap the client calls in ``with hub.patch_client(cache_dir=tmp_path / "cache"):`` which patches
  the already-imported constants (``ENDPOINT``, the ``/resolve`` URL template, the module-level ``HfApi``'s
  endpoint, telemetry/xet/offline flags, token location) and restores them on exit.

Minimal use::

    from tests.hub_server import LoopbackHub

    with LoopbackHub() as hub, hub.patch_client(cache_dir=tmp_path / "cache"):
        from huggingface_hub import HfApi
        api = HfApi(token=hub.token)
        api.create_repo("user/tiny", private=True)
        api.upload_folder(repo_id="user/tiny", folder_path=model_dir)
        model = AutoModel.from_pretrained("user/tiny", token=hub.token)
        assert hub.requests_log[-1].authorization == f"Bearer {hub.token}"

Access control mimics the Hub: an unknown token gets 401 ("Invalid credentials in Authorization header") on
every endpoint; a private or missing repo gets 401 ``RepoNotFound`` without a token and 404 ``RepoNotFound``
with a token that has no access; writing needs a token whose user owns the namespace (or is a member of the
org, see ``orgs``), else 401 (no token) / 403. A gated repo (``repo.gated`` set) serves its files only to its
owners and to the users in ``repo.gated_users``; others get 401 (no token) / 403 ``GatedRepo``. Xet is never offered: the preupload answer is ``"regular"`` for
every file unless ``lfs_mode="auto"``, and the xet token endpoints answer 501.
"""

from __future__ import annotations

import base64
import contextlib
import fnmatch
import hashlib
import json
import os
import sys
import tempfile
import threading
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime, timezone
from functools import cached_property
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, quote, unquote, urlsplit


DEFAULT_USER = "user"
DEFAULT_TOKEN = "hf_loopback_user_token"

REPO_TYPES = {"models": "model", "datasets": "dataset", "spaces": "space", "kernels": "kernel"}
URL_PREFIXES = {"model": "", "dataset": "datasets/", "space": "spaces/", "kernel": "kernels/"}

# Files stored as LFS when ``lfs_mode="auto"`` (subset of the Hub's default .gitattributes), or >= lfs_threshold.
LFS_PATTERNS = (
    "*.safetensors", "*.bin", "*.pt", "*.pth", "*.ckpt", "*.h5", "*.onnx", "*.msgpack", "*.npy", "*.npz",
    "*.pkl", "*.pickle", "*.gguf", "*.tflite", "*.zip", "*.tar.gz", "*.parquet", "*.arrow",
)
DEFAULT_GITATTRIBUTES = "".join(f"{pattern} filter=lfs diff=lfs merge=lfs -text\n" for pattern in LFS_PATTERNS)

MAX_BODY_BYTES = 1 << 30  # refuse absurd bodies rather than buffering them


def _now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"


def git_blob_sha1(content: bytes) -> str:
    """Git object id of a blob (what the Hub calls ``oid``/``blobId`` for regular files)."""
    return hashlib.sha1(b"blob %d\0" % len(content) + content).hexdigest()


@dataclass(frozen=True)
class Blob:
    content: bytes
    lfs: bool = False

    @property
    def size(self) -> int:
        return len(self.content)

    @cached_property
    def sha256(self) -> str:
        return hashlib.sha256(self.content).hexdigest()

    @cached_property
    def lfs_pointer(self) -> bytes:
        return (f"version https://git-lfs.github.com/spec/v1\noid sha256:{self.sha256}\nsize {self.size}\n").encode()

    @cached_property
    def git_oid(self) -> str:
        """Git blob id: of the content for regular files, of the pointer file for LFS files (as on the Hub)."""
        return git_blob_sha1(self.lfs_pointer if self.lfs else self.content)

    @property
    def etag(self) -> str:
        return self.sha256 if self.lfs else git_blob_sha1(self.content)


@dataclass
class Commit:
    sha: str
    parent: str | None
    files: dict[str, Blob]
    title: str
    message: str
    author: str
    date: str


@dataclass
class Repo:
    repo_type: str
    repo_id: str
    private: bool
    created_at: str
    commits: dict[str, Commit] = field(default_factory=dict)
    branches: dict[str, str] = field(default_factory=dict)
    tags: dict[str, str] = field(default_factory=dict)
    pull_requests: dict[int, str] = field(default_factory=dict)
    lfs_objects: dict[str, bytes] = field(default_factory=dict)
    gated: bool | str = False
    #: Users granted access to a gated repo (its terms accepted); everyone else is refused its files.
    gated_users: set[str] = field(default_factory=set)

    @property
    def namespace(self) -> str:
        return self.repo_id.split("/")[0]

    @property
    def url_path(self) -> str:
        return URL_PREFIXES[self.repo_type] + self.repo_id


@dataclass(frozen=True)
class RecordedRequest:
    """One request as the server saw it (``path`` is the raw path, ``query`` the parsed query string)."""

    method: str
    path: str
    query: dict[str, list[str]]
    headers: dict[str, str]  # lower-cased names
    authorization: str | None
    status: int
    handled: bool  # False when the server did not recognise the endpoint (404) or failed on it (500)


class HubError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        code: str | None = None,
        headers: dict[str, str] | None = None,
        extra: dict[str, Any] | None = None,
    ):
        super().__init__(message)
        self.extra = extra or {}
        self.status = status
        self.message = message
        self.code = code
        self.headers = headers or {}


class _Unhandled(HubError):
    pass


class LoopbackHub:
    """In-memory Hub on ``http://127.0.0.1:<port>``. Use as a context manager, or call ``start()``/``stop()``.

    Args:
        tokens: token -> user name. Defaults to ``{DEFAULT_TOKEN: DEFAULT_USER}``.
        orgs: user name -> organisations the user may read/write.
        lfs_mode: ``"never"`` (default) answers preupload with ``uploadMode="regular"`` for every file, so nothing
            goes through LFS or xet. ``"auto"`` answers ``"lfs"`` for files matching ``LFS_PATTERNS`` or of at
            least ``lfs_threshold`` bytes; the client must then have xet disabled (``HF_HUB_DISABLE_XET=1``, which
            ``client_env``/``patch_client`` set) and uploads through the LFS batch API served here.
        yaml_validator: ``f(readme_content, repo_type) -> list of error messages`` used by ``/api/validate-yaml``
            (called by the client before committing a README.md). Default: accept everything. The real Hub
            validates the YAML metadata (e.g. ``model-index``); plug e.g. a ``yaml.safe_load``-based check here.
    """

    def __init__(
        self,
        *,
        tokens: dict[str, str] | None = None,
        orgs: dict[str, list[str]] | None = None,
        lfs_mode: str = "never",
        lfs_threshold: int = 10 * 1024 * 1024,
        yaml_validator: Callable[[str, str], list[str]] | None = None,
    ) -> None:
        if lfs_mode not in ("never", "auto"):
            raise ValueError("lfs_mode must be 'never' or 'auto'")
        self.tokens = dict(tokens) if tokens is not None else {DEFAULT_TOKEN: DEFAULT_USER}
        self.orgs = {user: list(names) for user, names in (orgs or {}).items()}
        self.lfs_mode = lfs_mode
        self.lfs_threshold = lfs_threshold
        self.yaml_validator = yaml_validator
        self.repos: dict[tuple[str, str], Repo] = {}
        self._lock = threading.RLock()
        self._log: list[RecordedRequest] = []
        self._log_lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self._url: str | None = None

    # ------------------------------------------------------------------ lifecycle

    @property
    def token(self) -> str:
        """The first configured token (by default the token of ``DEFAULT_USER``)."""
        return next(iter(self.tokens))

    @property
    def user(self) -> str:
        return self.tokens[self.token]

    @property
    def url(self) -> str:
        """``http://127.0.0.1:<port>`` (still the last address after ``stop()``, which then refuses connections)."""
        if self._url is None:
            raise RuntimeError("LoopbackHub was never started")
        return self._url

    def start(self) -> LoopbackHub:
        if self._server is not None:
            return self
        handler = type("_BoundHandler", (_Handler,), {"hub": self})
        server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        server.daemon_threads = True
        self._server = server
        self._url = "http://{}:{}".format(*server.server_address[:2])
        self._thread = threading.Thread(
            target=server.serve_forever, kwargs={"poll_interval": 0.05}, name="loopback-hub", daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        server, thread = self._server, self._thread
        self._server = self._thread = None
        if server is None:
            return
        server.shutdown()
        server.server_close()
        if thread is not None:
            thread.join(timeout=5)

    def __enter__(self) -> LoopbackHub:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ------------------------------------------------------------------ request log

    @property
    def requests_log(self) -> list[RecordedRequest]:
        with self._log_lock:
            return list(self._log)

    def clear_log(self) -> None:
        with self._log_lock:
            self._log.clear()

    def unhandled_requests(self) -> list[RecordedRequest]:
        return [r for r in self.requests_log if not r.handled]

    def _record(self, entry: RecordedRequest) -> None:
        with self._log_lock:
            self._log.append(entry)

    # ------------------------------------------------------------------ client configuration

    def client_env(self, hf_home: str | os.PathLike | None = None, token: str | None = None) -> dict[str, str]:
        """Environment for a subprocess running huggingface_hub/transformers against this server.

        Starts from ``os.environ``, points ``HF_ENDPOINT`` here, disables telemetry, xet and offline mode,
        removes tokens/OIDC settings inherited from the caller and sets ``HF_TOKEN`` only if ``token`` is given.
        ``hf_home`` (recommended: a tmp dir) isolates the cache and the token file.
        """
        env = dict(os.environ)
        for name in (
            "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_OIDC_RESOURCE", "HF_OIDC_ID_TOKEN", "HF_HUB_OFFLINE",
            "TRANSFORMERS_OFFLINE", "HUGGINGFACE_CO_STAGING", "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE",
            "HF_TOKEN_PATH", "HF_HUB_ENABLE_HF_TRANSFER",
        ):
            env.pop(name, None)
        env.update(
            HF_ENDPOINT=self.url,
            HF_HUB_DISABLE_TELEMETRY="1",
            HF_HUB_DISABLE_XET="1",
            HF_HUB_DISABLE_UPDATE_CHECK="1",
            HF_HUB_DISABLE_PROGRESS_BARS="1",
            HF_HUB_DISABLE_IMPLICIT_TOKEN="1" if token is None else "0",
            NO_PROXY="127.0.0.1,localhost",
            no_proxy="127.0.0.1,localhost",
        )
        if hf_home is not None:
            env["HF_HOME"] = str(hf_home)
        if token is not None:
            env["HF_TOKEN"] = token
        return env

    @contextlib.contextmanager
    def patch_client(
        self, cache_dir: str | os.PathLike | None = None, token: str | None = None, offline: bool = False
    ) -> Iterator[None]:
        """Point an already-imported huggingface_hub (and transformers, which goes through it) at this server.

        Patches the import-time constants and the module-level ``HfApi`` used by ``huggingface_hub.create_repo``
        & co., forces telemetry/xet off and online mode, hides any token of the developer (env vars and token
        file) and sets ``HF_TOKEN`` to ``token`` if given. Everything is restored on exit.
        ``cache_dir`` becomes the default download cache (``HF_HUB_CACHE``) when given. ``offline=True`` turns
        on huggingface_hub's offline mode (what ``HF_HUB_OFFLINE=1`` does at import time) instead.
        """
        from urllib.parse import urlsplit as _urlsplit

        from huggingface_hub import constants, hf_api

        saved_env = {name: os.environ.get(name) for name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_OIDC_RESOURCE")}
        patches: list[tuple[Any, str, Any]] = [
            (constants, "ENDPOINT", self.url),
            (constants, "HUGGINGFACE_CO_URL_TEMPLATE", self.url + "/{repo_id}/resolve/{revision}/{filename}"),
            (constants, "HF_URL_HOSTS", frozenset(constants.HF_URL_HOSTS | {_urlsplit(self.url).hostname})),
            (constants, "HF_HUB_DISABLE_TELEMETRY", True),
            (constants, "HF_HUB_DISABLE_XET", True),
            (constants, "HF_HUB_OFFLINE", offline),
            (constants, "HF_HUB_DISABLE_IMPLICIT_TOKEN", token is None),
            (constants, "HF_TOKEN_PATH", os.path.join(tempfile.gettempdir(), f"loopback-no-token-{uuid.uuid4().hex}")),
            (hf_api.api, "endpoint", self.url),
        ]
        if cache_dir is not None:
            patches += [(constants, name, str(cache_dir)) for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE")]
        transformers_hub = sys.modules.get("transformers.utils.hub")
        if transformers_hub is not None and hasattr(transformers_hub, "_hf_api"):
            # transformers keeps one shared HfApi whose endpoint is frozen at its first use: drop it so that it is
            # rebuilt against this server (and drop ours on exit so the next user does not get a stale endpoint).
            patches.append((transformers_hub, "_hf_api", None))
        originals = [(obj, name, getattr(obj, name)) for obj, name, _ in patches]
        try:
            for obj, name, value in patches:
                setattr(obj, name, value)
            for name in saved_env:
                os.environ.pop(name, None)
            if token is not None:
                os.environ["HF_TOKEN"] = token
            yield
        finally:
            for obj, name, value in reversed(originals):
                setattr(obj, name, value)
            for name, value in saved_env.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value

    # ------------------------------------------------------------------ direct (test-side) access

    def get_repo(self, repo_id: str, repo_type: str = "model") -> Repo | None:
        with self._lock:
            return self.repos.get((repo_type, repo_id))

    def read_file(self, repo_id: str, filename: str, revision: str = "main", repo_type: str = "model") -> bytes:
        with self._lock:
            repo = self.repos[(repo_type, repo_id)]
            return repo.commits[self._resolve_revision(repo, revision)].files[filename].content

    # ------------------------------------------------------------------ auth helpers

    def _user_for(self, authorization: str | None) -> str | None:
        """User of a bearer token; None without a token; raises 401 for an unknown token."""
        if not authorization:
            return None
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() != "bearer" or token.strip() not in self.tokens:
            raise HubError(401, "Invalid credentials in Authorization header")
        return self.tokens[token.strip()]

    def _may_access(self, user: str | None, namespace: str) -> bool:
        return user is not None and (user == namespace or namespace in self.orgs.get(user, ()))

    def _repo(self, repo_type: str, repo_id: str, user: str | None, write: bool = False) -> Repo:
        repo = self.repos.get((repo_type, repo_id))
        if repo is None or (repo.private and not self._may_access(user, repo.namespace)):
            raise HubError(401 if user is None else 404, "Repository not found", "RepoNotFound")
        if write and not self._may_access(user, repo.namespace):
            if user is None:
                raise HubError(401, "You must be authenticated to write to this repository")
            raise HubError(403, f"You don't have the rights to write to {repo_type}s/{repo_id}")
        return repo

    @staticmethod
    def _resolve_revision(repo: Repo, revision: str) -> str:
        if revision in repo.branches:
            return repo.branches[revision]
        if revision in repo.tags:
            return repo.tags[revision]
        if revision.startswith("refs/pr/") and revision[8:].isdigit() and int(revision[8:]) in repo.pull_requests:
            return repo.pull_requests[int(revision[8:])]
        if revision.startswith("refs/heads/") and revision[11:] in repo.branches:
            return repo.branches[revision[11:]]
        if len(revision) == 40 and revision in repo.commits:
            return revision
        raise HubError(404, f"Invalid rev id: {revision}", "RevisionNotFound")

    def _new_commit(
        self, repo: Repo, parent: str | None, files: dict[str, Blob], title: str, message: str, author: str
    ) -> Commit:
        tree = sorted((p, b.git_oid) for p, b in files.items())
        seed = json.dumps([repo.repo_id, parent, title, tree, uuid.uuid4().hex])
        commit = Commit(hashlib.sha1(seed.encode()).hexdigest(), parent, files, title, message, author, _now())
        repo.commits[commit.sha] = commit
        return commit

    # ------------------------------------------------------------------ JSON views

    def _tree_entry(self, path: str, blob: Blob) -> dict[str, Any]:
        entry: dict[str, Any] = {"type": "file", "oid": blob.git_oid, "size": blob.size, "path": path}
        if blob.lfs:
            entry["lfs"] = {"oid": blob.sha256, "size": blob.size, "pointerSize": len(blob.lfs_pointer)}
        return entry

    def _info(self, repo: Repo, sha: str, blobs: bool) -> dict[str, Any]:
        commit = repo.commits[sha]
        siblings = []
        for path in sorted(commit.files):
            blob = commit.files[path]
            sibling: dict[str, Any] = {"rfilename": path}
            if blobs:
                sibling.update(size=blob.size, blobId=blob.git_oid)
                if blob.lfs:
                    sibling["lfs"] = {"size": blob.size, "sha256": blob.sha256, "pointerSize": len(blob.lfs_pointer)}
            siblings.append(sibling)
        info: dict[str, Any] = {
            "_id": hashlib.sha1(repo.repo_id.encode()).hexdigest()[:24],
            "id": repo.repo_id,
            "author": repo.namespace,
            "sha": sha,
            "lastModified": commit.date,
            "createdAt": repo.created_at,
            "private": repo.private,
            "gated": repo.gated,
            "disabled": False,
            "downloads": 0,
            "likes": 0,
            "tags": [],
            "siblings": siblings,
            "usedStorage": sum(b.size for b in commit.files.values()),
        }
        if repo.repo_type == "model":
            info["modelId"] = repo.repo_id
            info["spaces"] = []
            config = commit.files.get("config.json")
            if config is not None:
                with contextlib.suppress(ValueError, AttributeError):
                    cfg = json.loads(config.content)
                    info["config"] = {k: cfg[k] for k in ("architectures", "model_type") if k in cfg}
                    info["library_name"] = "transformers"
                    info["tags"] = ["transformers"] + ([cfg["model_type"]] if "model_type" in cfg else [])
        return info

    # ------------------------------------------------------------------ endpoint implementations

    def dispatch(self, method: str, path: str, query: dict[str, list[str]], headers: dict[str, str], body: bytes):
        """Return ``(status, headers, body_bytes)``; raise ``HubError`` for Hub-style errors."""
        segs = [unquote(s) for s in path.split("/")[1:]]
        if segs and segs[-1] == "" and len(segs) > 1:
            segs = segs[:-1]
        user = self._user_for(headers.get("authorization"))
        with self._lock:
            if segs[:1] == ["api"]:
                return self._api(method, segs[1:], query, headers, body, user)
            if segs[:1] == ["lfs-upload"] and len(segs) == 5 and method == "PUT":
                return self._lfs_put(segs[1], f"{segs[2]}/{segs[3]}", segs[4], body)
            if segs[:1] == ["lfs-verify"] and len(segs) == 4 and method == "POST":
                return self._lfs_verify(segs[1], f"{segs[2]}/{segs[3]}", body)
            repo_type, rest = "model", segs
            if rest and rest[0] in ("datasets", "spaces", "kernels"):
                repo_type, rest = REPO_TYPES[rest[0]], rest[1:]
            if len(rest) >= 5 and rest[2] == "resolve" and method in ("GET", "HEAD"):
                repo_id, revision, filename = f"{rest[0]}/{rest[1]}", rest[3], "/".join(rest[4:])
                return self._resolve(repo_type, repo_id, revision, filename, headers, user, method)
            if rest[2:] == ["info", "lfs", "objects", "batch"] and rest[1].endswith(".git") and method == "POST":
                return self._lfs_batch(repo_type, f"{rest[0]}/{rest[1][:-4]}", body, user)
        raise _Unhandled(404, f"loopback hub: unsupported endpoint {method} {path}")

    def _api(self, method, segs, query, headers, body, user):
        if segs == ["whoami-v2"] and method == "GET":
            if user is None:
                raise HubError(401, "Invalid credentials in Authorization header")
            orgs = [{"name": org, "type": "org"} for org in self.orgs.get(user, [])]
            auth = {"type": "access_token", "accessToken": {"displayName": "loopback", "role": "write"}}
            return _json({"type": "user", "id": user, "name": user, "fullname": user, "orgs": orgs, "auth": auth})
        if segs == ["agent-harnesses"] and method == "GET":
            return _json({"harnesses": []})
        if segs == ["validate-yaml"] and method == "POST":
            payload = _load_json(body)
            errors = []
            if self.yaml_validator is not None:
                errors = list(self.yaml_validator(str(payload.get("content", "")), payload.get("repoType") or "model"))
            return _json({"errors": [{"message": m} for m in errors], "warnings": []}, status=400 if errors else 200)
        if segs == ["repos", "create"] and method == "POST":
            return self._create_repo(_load_json(body), user)
        if segs == ["repos", "delete"] and method == "DELETE":
            payload = _load_json(body)
            repo_type = payload.get("type") or "model"
            repo_id = f"{payload.get('organization') or user}/{payload['name']}"
            repo = self._repo(repo_type, repo_id, user, write=True)
            del self.repos[(repo.repo_type, repo.repo_id)]
            return _json({})
        if len(segs) >= 3 and segs[0] in REPO_TYPES:
            repo_type, repo_id, rest = REPO_TYPES[segs[0]], f"{segs[1]}/{segs[2]}", segs[3:]
            return self._repo_api(method, repo_type, repo_id, rest, query, body, user)
        raise _Unhandled(404, f"loopback hub: unsupported endpoint {method} /api/{'/'.join(segs)}")

    def _create_repo(self, payload: dict[str, Any], user: str | None):
        if user is None:
            raise HubError(401, "You must be authenticated to create a repository")
        namespace = payload.get("organization") or user
        name = payload.get("name")
        repo_type = payload.get("type") or "model"
        if not name or repo_type not in URL_PREFIXES:
            raise HubError(400, "Invalid repo name or type")
        if not self._may_access(user, namespace):
            raise HubError(403, f"You don't have the rights to create a {repo_type} under the namespace {namespace!r}")
        repo_id = f"{namespace}/{name}"
        url = f"{self.url}/{URL_PREFIXES[repo_type]}{repo_id}"
        if (repo_type, repo_id) in self.repos:
            # The Hub's 409 body carries the url: create_repo(exist_ok=True) reads it.
            raise HubError(409, f"You already created this {repo_type} repo", extra={"url": url})
        private = payload.get("visibility") == "private" or bool(payload.get("private"))
        repo = Repo(repo_type, repo_id, private, _now())
        initial = self._new_commit(repo, None, {".gitattributes": Blob(DEFAULT_GITATTRIBUTES.encode())},
                                   "initial commit", "", user)
        repo.branches["main"] = initial.sha
        self.repos[(repo_type, repo_id)] = repo
        return _json({"url": url, "name": repo_id, "id": hashlib.sha1(repo_id.encode()).hexdigest()[:24]})

    def _repo_api(self, method, repo_type, repo_id, rest, query, body, user):
        head = rest[0] if rest else None
        if method == "GET" and (not rest or (head == "revision" and len(rest) >= 2)):
            repo = self._repo(repo_type, repo_id, user)
            sha = self._resolve_revision(repo, "/".join(rest[1:]) if rest else "main")
            return _json(self._info(repo, sha, blobs=_flag(query, "blobs")))
        if head == "tree" and method == "GET" and len(rest) >= 2:
            repo = self._repo(repo_type, repo_id, user)
            files = repo.commits[self._resolve_revision(repo, rest[1])].files
            return _json(_tree(self, files, "/".join(rest[2:]).strip("/"), _flag(query, "recursive")))
        if head == "paths-info" and method == "POST" and len(rest) == 2:
            repo = self._repo(repo_type, repo_id, user)
            files = repo.commits[self._resolve_revision(repo, rest[1])].files
            form = parse_qs(body.decode())
            wanted = form.get("paths", []) + form.get("paths[]", [])
            out = []
            for p in wanted:
                p = p.strip("/")
                if p in files:
                    out.append(self._tree_entry(p, files[p]))
                elif any(f.startswith(p + "/") for f in files):
                    out.append(_folder_entry(p))
            return _json(out)
        if head == "refs" and method == "GET":
            repo = self._repo(repo_type, repo_id, user)
            data: dict[str, Any] = {
                "branches": [_ref(n, f"refs/heads/{n}", s) for n, s in repo.branches.items()],
                "tags": [_ref(n, f"refs/tags/{n}", s) for n, s in repo.tags.items()],
                "converts": [],
            }
            if _flag(query, "include_prs"):
                data["pullRequests"] = [_ref(f"refs/pr/{n}", f"refs/pr/{n}", s) for n, s in repo.pull_requests.items()]
            return _json(data)
        if head == "commits" and method == "GET" and len(rest) == 2:
            repo = self._repo(repo_type, repo_id, user)
            sha, out = self._resolve_revision(repo, rest[1]), []
            while sha is not None and len(out) < 10_000:
                c = repo.commits[sha]
                out.append({"id": c.sha, "title": c.title, "message": c.message, "date": c.date,
                            "authors": [{"user": c.author}]})
                sha = c.parent
            return _json(out)
        if head == "branch" and len(rest) == 2 and method in ("POST", "DELETE"):
            repo = self._repo(repo_type, repo_id, user, write=True)
            branch = rest[1]
            if method == "DELETE":
                if branch not in repo.branches:
                    raise HubError(404, f"Invalid rev id: {branch}", "RevisionNotFound")
                if branch == "main":
                    raise HubError(403, "Cannot delete the default branch")
                del repo.branches[branch]
                return _json({})
            if branch in repo.branches:
                raise HubError(409, f"Reference already exists: refs/heads/{branch}")
            start = _load_json(body).get("startingPoint") or "main"
            repo.branches[branch] = self._resolve_revision(repo, start)
            return _json({})
        if head == "tag" and len(rest) == 2 and method in ("POST", "DELETE"):
            repo = self._repo(repo_type, repo_id, user, write=True)
            if method == "DELETE":
                if rest[1] not in repo.tags:
                    raise HubError(404, f"Invalid rev id: {rest[1]}", "RevisionNotFound")
                del repo.tags[rest[1]]
                return _json({})
            tag = _load_json(body).get("tag")
            if not tag:
                raise HubError(400, "Missing tag name")
            if tag in repo.tags:
                raise HubError(409, f"Tag {tag} already exists")
            repo.tags[tag] = self._resolve_revision(repo, rest[1])
            return _json({})
        if head == "settings" and method == "PUT":
            repo = self._repo(repo_type, repo_id, user, write=True)
            payload = _load_json(body)
            if "private" in payload:
                repo.private = bool(payload["private"])
            if "visibility" in payload:
                repo.private = payload["visibility"] == "private"
            if "gated" in payload:
                repo.gated = payload["gated"]
            return _json({})
        if head == "preupload" and method == "POST" and len(rest) == 2:
            return self._preupload(repo_type, repo_id, rest[1], _load_json(body), user)
        if head == "commit" and method == "POST" and len(rest) == 2:
            return self._commit(repo_type, repo_id, rest[1], body, _flag(query, "create_pr"), user)
        if head in ("xet-read-token", "xet-write-token"):
            raise HubError(501, "loopback hub: xet storage is not supported; set HF_HUB_DISABLE_XET=1")
        endpoint = f"/api/{repo_type}s/{repo_id}/{'/'.join(rest)}"
        raise _Unhandled(404, f"loopback hub: unsupported endpoint {method} {endpoint}")

    def _upload_mode(self, path: str, size: int) -> str:
        if self.lfs_mode == "never" or size == 0:
            return "regular"
        name = path.rsplit("/", 1)[-1]
        if size >= self.lfs_threshold or any(fnmatch.fnmatch(name, pattern) for pattern in LFS_PATTERNS):
            return "lfs"
        return "regular"

    def _preupload(self, repo_type, repo_id, revision, payload, user):
        repo = self._repo(repo_type, repo_id, user, write=True)
        files = repo.commits[self._resolve_revision(repo, revision)].files
        out = []
        for f in payload.get("files", []):
            mode = self._upload_mode(f["path"], int(f.get("size", 0)))
            existing = files.get(f["path"])
            oid = None
            if existing is not None:
                oid = existing.sha256 if mode == "lfs" else git_blob_sha1(existing.content)
            out.append({"path": f["path"], "uploadMode": mode, "shouldIgnore": False, "oid": oid})
        return _json({"files": out})

    def _commit(self, repo_type, repo_id, revision, body, create_pr, user):
        repo = self._repo(repo_type, repo_id, user, write=True)
        base_sha = self._resolve_revision(repo, revision)
        lines = [json.loads(line) for line in body.decode().splitlines() if line.strip()]
        if not lines or lines[0].get("key") != "header":
            raise HubError(400, "Commit payload must start with a header line")
        header = lines[0]["value"]
        parent = header.get("parentCommit")
        if parent is not None and parent != base_sha:
            raise HubError(412, "A commit has happened since. Please refresh and try again.")
        files = dict(repo.commits[base_sha].files)
        for line in lines[1:]:
            key, value = line.get("key"), line.get("value", {})
            path = str(value.get("path", "")).strip("/")
            if not path or any(part in ("", ".", "..") for part in path.split("/")):
                raise HubError(400, f"Invalid path: {value.get('path')!r}")
            if key == "file":
                raw = value["content"]
                files[path] = Blob(base64.b64decode(raw) if value.get("encoding") == "base64" else raw.encode())
            elif key == "lfsFile":
                content = repo.lfs_objects.get(value.get("oid", ""))
                if content is None:
                    raise HubError(422, f"LFS pointer of {path} points to an object that was never uploaded")
                files[path] = Blob(content, lfs=True)
            elif key == "deletedFile":
                if path not in files:
                    raise HubError(404, f"A file with this name doesn't exist: {path}", "EntryNotFound")
                del files[path]
            elif key == "deletedFolder":
                matching = [p for p in files if p.startswith(path + "/")]
                if not matching:
                    raise HubError(404, f"A folder with this name doesn't exist: {path}", "EntryNotFound")
                for p in matching:
                    del files[p]
            else:
                raise HubError(400, f"Unknown commit operation {key!r}")
        commit = self._new_commit(repo, base_sha, files, header.get("summary") or "commit",
                                  header.get("description") or "", user or "")
        pr_url = None
        if create_pr:
            number = max(repo.pull_requests, default=0) + 1
            repo.pull_requests[number] = commit.sha
            pr_url = f"{self.url}/{repo.url_path}/discussions/{number}"
        elif revision in repo.branches:
            repo.branches[revision] = commit.sha
        elif revision.startswith("refs/pr/") and revision[8:].isdigit() and int(revision[8:]) in repo.pull_requests:
            repo.pull_requests[int(revision[8:])] = commit.sha
        else:
            raise HubError(400, f"Can only commit to a branch or pull request, not {revision!r}")
        commit_url = f"{self.url}/{repo.url_path}/commit/{commit.sha}"
        return _json({"success": True, "commitOid": commit.sha, "commitUrl": commit_url, "pullRequestUrl": pr_url})

    def _resolve(self, repo_type, repo_id, revision, filename, headers, user, method):
        repo = self._repo(repo_type, repo_id, user)
        if repo.gated and user not in repo.gated_users and not self._may_access(user, repo.namespace):
            # Like the Hub: metadata stays readable, files need an accepted access request.
            message = f"Access to {repo_type} {repo_id} is restricted. You must have access to it and be authenticated."
            raise HubError(401 if user is None else 403, message, "GatedRepo")
        sha = self._resolve_revision(repo, revision)
        blob = repo.commits[sha].files.get(filename)
        if blob is None:
            raise HubError(404, "Entry not found", "EntryNotFound", {"X-Repo-Commit": sha})
        out_headers = {
            "ETag": f'"{blob.etag}"',
            "X-Repo-Commit": sha,
            "Accept-Ranges": "bytes",
            "Content-Type": "application/octet-stream",
            "Content-Disposition": f'inline; filename="{quote(filename.rsplit("/", 1)[-1])}"',
        }
        if blob.lfs:
            out_headers.update({"X-Linked-Etag": f'"{blob.sha256}"', "X-Linked-Size": str(blob.size)})
        content, status = blob.content, 200
        range_header = headers.get("range")
        if range_header and range_header.startswith("bytes=") and method == "GET":
            start_s, _, end_s = range_header[6:].split(",")[0].partition("-")
            if start_s.isdigit():
                start = int(start_s)
                end = min(int(end_s), blob.size - 1) if end_s.isdigit() else blob.size - 1
                if start >= blob.size or start > end:
                    raise HubError(416, "Range not satisfiable", headers={"Content-Range": f"bytes */{blob.size}"})
                content, status = blob.content[start : end + 1], 206
                out_headers["Content-Range"] = f"bytes {start}-{end}/{blob.size}"
        return status, out_headers, content

    def _lfs_batch(self, repo_type, repo_id, body, user):
        repo = self._repo(repo_type, repo_id, user, write=True)
        payload = _load_json(body)
        if payload.get("operation") != "upload":
            raise HubError(400, "loopback hub: only LFS uploads are supported")
        objects = []
        for obj in payload.get("objects", []):
            oid, size = str(obj.get("oid")), int(obj.get("size", 0))
            entry: dict[str, Any] = {"oid": oid, "size": size, "authenticated": True}
            if oid not in repo.lfs_objects:
                base = f"{self.url}/lfs-upload/{repo_type}/{repo_id}/{oid}"
                entry["actions"] = {
                    "upload": {"href": base, "header": {}},
                    "verify": {"href": f"{self.url}/lfs-verify/{repo_type}/{repo_id}", "header": {}},
                }
            objects.append(entry)
        return _json({"transfer": "basic", "objects": objects}, content_type="application/vnd.git-lfs+json")

    def _lfs_put(self, repo_type, repo_id, oid, body):
        # Like a pre-signed S3 URL: no Authorization header is sent here, so none is required.
        repo = self.repos.get((repo_type, repo_id))
        if repo is None:
            raise HubError(404, "Repository not found", "RepoNotFound")
        if hashlib.sha256(body).hexdigest() != oid:
            raise HubError(400, "LFS object content does not match its sha256")
        repo.lfs_objects[oid] = body
        return 200, {"ETag": f'"{oid}"'}, b""

    def _lfs_verify(self, repo_type, repo_id, body):
        repo = self.repos.get((repo_type, repo_id))
        payload = _load_json(body)
        if repo is None or payload.get("oid") not in repo.lfs_objects:
            raise HubError(404, "LFS object not found")
        if len(repo.lfs_objects[payload["oid"]]) != int(payload.get("size", -1)):
            raise HubError(400, "LFS object size mismatch")
        return _json({"success": True})


def _tree(hub: LoopbackHub, files: dict[str, Blob], prefix: str, recursive: bool) -> list[dict[str, Any]]:
    if prefix and prefix not in files and not any(p.startswith(prefix + "/") for p in files):
        raise HubError(404, f"Entry not found: {prefix}", "EntryNotFound")
    base = prefix + "/" if prefix else ""
    out: list[dict[str, Any]] = []
    dirs: set[str] = set()
    for path in sorted(files):
        if not path.startswith(base):
            continue
        rel = path[len(base) :]
        parts = rel.split("/")
        for depth in range(1, len(parts)):
            if depth > 1 and not recursive:
                break
            dirs.add(base + "/".join(parts[:depth]))
        if recursive or len(parts) == 1:
            out.append(hub._tree_entry(path, files[path]))
    return [_folder_entry(d) for d in sorted(dirs)] + out


def _folder_entry(path: str) -> dict[str, Any]:
    return {"type": "directory", "oid": hashlib.sha1(path.encode()).hexdigest(), "size": 0, "path": path}


def _ref(name: str, ref: str, sha: str) -> dict[str, str]:
    return {"name": name, "ref": ref, "targetCommit": sha}


def _flag(query: dict[str, list[str]], name: str) -> bool:
    return any(v.lower() in ("1", "true", "yes") for v in query.get(name, []))


def _load_json(body: bytes) -> dict[str, Any]:
    if not body:
        return {}
    try:
        data = json.loads(body)
    except ValueError as exc:
        raise HubError(400, f"Invalid JSON body: {exc}") from None
    if not isinstance(data, dict):
        raise HubError(400, "JSON body must be an object")
    return data


def _json(data: Any, status: int = 200, content_type: str = "application/json"):
    return status, {"Content-Type": content_type}, json.dumps(data).encode()


class _Handler(BaseHTTPRequestHandler):
    hub: LoopbackHub  # set on the bound subclass
    server_version = "LoopbackHub/1.0"
    protocol_version = "HTTP/1.0"  # one request per connection: no idle keep-alive threads to clean up
    timeout = 30  # socket timeout, so a stuck client can never pin a handler thread forever

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - silence stderr logging
        pass

    def _read_body(self) -> bytes:
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            chunks, total = [], 0
            for _ in range(1_000_000):  # bounded
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    break
                total += size
                if total > MAX_BODY_BYTES:
                    raise HubError(413, "Payload too large")
                chunks.append(self.rfile.read(size))
                self.rfile.readline()
            return b"".join(chunks)
        length = int(self.headers.get("Content-Length") or 0)
        if length > MAX_BODY_BYTES:
            raise HubError(413, "Payload too large")
        return self.rfile.read(length) if length else b""

    def _handle(self) -> None:
        split = urlsplit(self.path)
        headers = {k.lower(): v for k, v in self.headers.items()}
        query = parse_qs(split.query, keep_blank_values=True)
        handled = True
        try:
            body = self._read_body()
            status, out_headers, content = self.hub.dispatch(self.command, split.path, query, headers, body)
        except HubError as err:
            handled = not isinstance(err, _Unhandled)
            status, content = err.status, json.dumps({"error": err.message, **err.extra}).encode()
            out_headers = {"Content-Type": "application/json", "X-Error-Message": err.message, **err.headers}
            if err.code:
                out_headers["X-Error-Code"] = err.code
        except Exception as exc:  # a bug in the server: answer 500 rather than hanging the client
            handled, status = False, 500
            content = json.dumps({"error": f"loopback hub internal error: {exc!r}"}).encode()
            out_headers = {"Content-Type": "application/json"}
        self.hub._record(
            RecordedRequest(self.command, self.path, query, headers, headers.get("authorization"), status, handled)
        )
        self.send_response(status)
        for name, value in out_headers.items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(content)))
        self.send_header("Connection", "close")
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(content)

    do_GET = do_HEAD = do_POST = do_PUT = do_DELETE = do_PATCH = do_OPTIONS = _handle
