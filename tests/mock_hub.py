"""A loopback Hugging Face Hub for online tests: a local HTTP server on 127.0.0.1 that serves model
and dataset repositories from local folders (subfolders included) through the endpoints
huggingface_hub and datasets call (repository info, the file tree, paths-info, file downloads,
the pull-request listing). A process reaches it with HF_ENDPOINT=<hub.endpoint> (huggingface_hub
reads it when imported: a subprocess's environment).

    with MockHub() as hub:
        hub.add("owner/base", folder)                                  # main
        hub.add("openai/clip", converted, revision="refs/pr/66")        # a conversion pull request
        hub.add("owner/data", parquet_repo, repo_type="dataset")       # a dataset repository
        hub.discussions["openai/clip"] = 401                           # the listing fails
        hub.gated.add("meta-llama/Llama-3.2-3B")                       # files answer 403 GatedRepo
        subprocess.run([...], env={**os.environ, **hub.env(cache)})

Unknown repositories, revisions and files answer 404 with the Hub's error codes."""

from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit


@dataclass
class _Revision:
    commit: str
    folder: Path

    def files(self) -> dict[str, bytes]:
        """Every file under the folder by its path in the repository (posix, subfolders too)."""
        return {
            p.relative_to(self.folder).as_posix(): p.read_bytes()
            for p in sorted(self.folder.rglob("*"))
            if p.is_file()
        }


def _blob_id(data: bytes) -> str:
    """The git blob id the Hub lists (and answers as the ETag) for a file."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass
class MockHub:
    #: repo id -> revision (main, refs/pr/N, a commit) -> its commit and folder
    repos: dict[str, dict[str, _Revision]] = field(default_factory=dict)
    #: repo id -> its pull requests [(number, author)], or the HTTP status the listing fails with
    discussions: dict[str, list[tuple[int, str]] | int] = field(default_factory=dict)
    #: dataset repo id -> revision -> its commit and folder (as `repos`, for datasets)
    dataset_repos: dict[str, dict[str, _Revision]] = field(default_factory=dict)
    #: repositories whose files answer 403 GatedRepo (their info answers, as the Hub's does)
    gated: set[str] = field(default_factory=set)
    #: every request: (method, path with query)
    requests: list[tuple[str, str]] = field(default_factory=list)

    def add(
        self,
        repo_id: str,
        folder: Path,
        revision: str = "main",
        commit: str | None = None,
        repo_type: str = "model",
    ):
        named = repo_id if repo_type == "model" else f"{repo_type}:{repo_id}"
        commit = commit or hashlib.sha1(f"{named}@{revision}".encode()).hexdigest()
        entry = _Revision(commit, Path(folder))
        repos = self.repos if repo_type == "model" else self.dataset_repos
        repos.setdefault(repo_id, {})[revision] = entry
        repos[repo_id][commit] = entry
        return commit

    # ------------------------------------------------------------------------------ the server

    def __enter__(self) -> MockHub:
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:  # no server lines on the test's stderr
                pass

            def do_HEAD(self) -> None:
                hub._answer(self, body=False)

            def do_GET(self) -> None:
                hub._answer(self, body=True)

            def do_POST(self) -> None:  # paths-info: the form's `paths` fields
                length = int(self.headers.get("Content-Length") or 0)
                hub._answer(self, body=True, form=self.rfile.read(length).decode())

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def env(self, cache: Path) -> dict[str, str]:
        """The environment that points huggingface_hub at this Hub and `cache` (online)."""
        return {
            "HF_ENDPOINT": self.endpoint,
            "HF_HUB_CACHE": str(cache),
            "HF_HUB_OFFLINE": "0",
            "TRANSFORMERS_OFFLINE": "0",
            "HF_HUB_DISABLE_TELEMETRY": "1",
            "HF_HUB_DISABLE_XET": "1",
            "HF_TOKEN": "",
            "NO_PROXY": "127.0.0.1,localhost",
            "no_proxy": "127.0.0.1,localhost",
        }

    # ---------------------------------------------------------------------------- the answers

    def _answer(self, request: BaseHTTPRequestHandler, body: bool, form: str = "") -> None:
        self.requests.append((request.command, request.path))
        url = urlsplit(request.path)
        parts = [unquote(p) for p in url.path.strip("/").split("/")]
        query = parse_qs(url.query)
        status, headers, payload = 404, {"X-Error-Code": "RepoNotFound"}, b'{"error": "not found"}'
        if parts[:2] == ["api", "models"] and len(parts) >= 4:
            status, headers, payload = self._api(
                f"{parts[2]}/{parts[3]}", parts[4:], self.repos, query, form
            )
        elif parts[:2] == ["api", "datasets"] and len(parts) >= 4:
            status, headers, payload = self._api(
                f"{parts[2]}/{parts[3]}", parts[4:], self.dataset_repos, query, form
            )
        elif parts[:1] == ["datasets"] and len(parts) >= 6 and parts[3] == "resolve":
            status, headers, payload = self._file(
                f"{parts[1]}/{parts[2]}", parts[4], parts[5:], self.dataset_repos
            )
        elif len(parts) >= 5 and parts[2] == "resolve":
            status, headers, payload = self._file(
                f"{parts[0]}/{parts[1]}", parts[3], parts[4:], self.repos
            )
        if isinstance(payload, (dict, list)):
            payload = json.dumps(payload).encode()
            headers.setdefault("Content-Type", "application/json")
        request.send_response(status)
        for name, value in {"Content-Length": str(len(payload)), **headers}.items():
            request.send_header(name, value)
        request.end_headers()
        if body:
            request.wfile.write(payload)

    def _revision(self, repo_id: str, revision: str, repos: dict[str, dict[str, _Revision]]):
        """(_Revision, None) or (None, the 404 answer)."""
        if repo_id not in repos:
            return None, (404, {"X-Error-Code": "RepoNotFound"}, {"error": "Repository not found"})
        found = repos[repo_id].get(revision)
        if found is None:
            error = {"X-Error-Code": "RevisionNotFound"}
            return None, (404, error, {"error": f"Invalid rev id: {revision}"})
        return found, None

    def _api(self, repo_id: str, rest: list[str], repos, query: dict, form: str):
        if rest[:1] == ["discussions"]:
            listed = self.discussions.get(repo_id, [])
            if isinstance(listed, int):
                return listed, {}, {"error": f"HTTP {listed} for the discussions of {repo_id}"}
            items = [
                {
                    "num": num,
                    "title": "Adding `safetensors` variant of this model",
                    "status": "open",
                    "author": {"name": author},
                    "createdAt": "2024-01-01T00:00:00.000Z",
                    "repo": {"name": repo_id, "type": "model"},
                    "isPullRequest": True,
                }
                for num, author in listed
            ]
            return 200, {}, {"discussions": items, "count": len(items), "start": 0}
        revision = "main"
        if rest[:1] in (["revision"], ["tree"], ["paths-info"]) and len(rest) >= 2:
            revision = rest[1]
        found, missing = self._revision(repo_id, revision, repos)
        if found is None:
            return missing
        files = found.files()
        if rest[:1] == ["tree"]:
            recursive = query.get("recursive", ["false"])[0].lower() == "true"
            tree = _tree(files, "/".join(rest[2:]), recursive)
            if rest[2:] and not tree:  # no such folder
                return 404, {"X-Error-Code": "EntryNotFound"}, {"error": "Entry not found"}
            return 200, {}, tree
        if rest[:1] == ["paths-info"]:
            asked = parse_qs(form).get("paths", [])
            entries = [e for e in _tree(files, "", True) if e["path"] in asked]
            return 200, {}, entries
        info = {
            "id": repo_id,
            "modelId": repo_id,
            "sha": found.commit,
            "private": False,
            "disabled": False,
            "gated": "manual" if repo_id in self.gated else False,
            "tags": [],
            "siblings": [{"rfilename": name} for name in files],
        }
        if repos is self.dataset_repos:
            del info["modelId"]
        return 200, {}, info

    def _file(self, repo_id: str, revision: str, path: list[str], repos):
        found, missing = self._revision(repo_id, revision, repos)
        if found is None:
            return missing
        if repo_id in self.gated:
            error = {
                "X-Error-Code": "GatedRepo",
                "X-Error-Message": "Access to the model is restricted",
            }
            return 403, error, {"error": f"Access to model {repo_id} is restricted"}
        data = found.files().get("/".join(path))
        if data is None:
            return 404, {"X-Error-Code": "EntryNotFound"}, {"error": "Entry not found"}
        headers = {
            "X-Repo-Commit": found.commit,
            "ETag": f'"{_blob_id(data)}"',
            "Content-Type": "application/octet-stream",
        }
        return 200, headers, data


def _tree(files: dict[str, bytes], under: str, recursive: bool) -> list[dict]:
    """The Hub's tree listing of `under` (the root when empty): its files and folders, or with
    `recursive` everything below it, folders before the files they hold."""
    prefix = f"{under.strip('/')}/" if under.strip("/") else ""
    entries: dict[str, dict] = {}
    for name, data in files.items():
        if not name.startswith(prefix):
            continue
        parts = name[len(prefix) :].split("/")
        for depth in range(1, len(parts)):
            folder = prefix + "/".join(parts[:depth])
            if recursive or depth == 1:
                oid = hashlib.sha1(folder.encode()).hexdigest()
                entries.setdefault(folder, {"type": "directory", "oid": oid, "path": folder})
        if recursive or len(parts) == 1:
            entries[name] = {"type": "file", "oid": _blob_id(data), "size": len(data), "path": name}
    return list(entries.values())
