"""A tiny local stand-in for the Hugging Face Hub, for tests without internet.

It answers, over real HTTP on 127.0.0.1, the endpoints that the unmodified `huggingface_hub` and
`datasets` clients call for a public repo (found by logging what they ask):

    GET  /api/{models|datasets}/{repo}[/revision/{rev}]      repo info: sha, siblings
    GET  /api/{models|datasets}/{repo}/tree/{rev}[/{path}]   listing (?recursive=true)
    POST /api/{models|datasets}/{repo}/paths-info/{rev}      form field `paths` (repeated)
    HEAD/GET /{repo}/resolve/{rev}/{file}                    model files (Range supported)
    HEAD/GET /datasets/{repo}/resolve/{rev}/{file}           dataset files

Errors carry the `X-Error-Code` header the client maps to its exceptions (RepoNotFound,
RevisionNotFound, EntryNotFound). Authorization is not checked; the log notes only that it was sent.

Use it with `HF_ENDPOINT=server.url` in the client's environment:

    with HubServer() as hub:
        hub.add_repo("model", "acme/tiny", {"config.json": b"{...}"})
        ...
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit

LFS_SUFFIXES = (".safetensors", ".bin", ".parquet", ".arrow")


@dataclass
class Repo:
    repo_type: str  # "model" | "dataset"
    repo_id: str
    files: dict[str, bytes]
    sha: str
    refs: dict[str, str] = field(default_factory=dict)

    def entry(self, path: str) -> dict:
        data = self.files[path]
        entry = {"type": "file", "path": path, "size": len(data), "oid": git_blob_sha1(data)}
        if path.endswith(LFS_SUFFIXES):
            entry["lfs"] = {"oid": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134}
        return entry

    def folders(self) -> set[str]:
        out = set()
        for path in self.files:
            parts = path.split("/")[:-1]
            for i in range(1, len(parts) + 1):
                out.add("/".join(parts[:i]))
        return out

    def folder_entry(self, path: str) -> dict:
        oid = hashlib.sha1(("tree:" + path + ":" + self.sha).encode()).hexdigest()
        return {"type": "directory", "path": path, "oid": oid, "size": 0}

    def etag(self, path: str) -> str:
        data = self.files[path]
        if path.endswith(LFS_SUFFIXES):
            return hashlib.sha256(data).hexdigest()
        return git_blob_sha1(data)


def git_blob_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass(frozen=True)
class Faults:
    """What one file request suffers: a pause before its body, and a dropped connection after `cut` bytes."""

    pause: float = 0.0
    cut: int | None = None


class HubServer:
    """A threaded HTTP server serving in-memory repos; `requests` logs (method, path) of each call."""

    def __init__(self, echo: bool = False) -> None:
        self.echo = echo  # print each request (to discover what a client asks)
        self.repos: dict[tuple[str, str], Repo] = {}
        self.requests: list[tuple[str, str, dict]] = []
        self.cut_after: dict[str, int] = {}  # file path -> bytes to send before dropping, once
        self.delay = 0.0  # seconds to wait before each file body (to make downloads overlap)
        self.slow: dict[str, float] = {}  # file path -> extra seconds before its body (to interrupt it)
        self.tamper: dict[str, bytes] = {}  # file path -> bytes served instead (listings keep the true hash)
        self._lock = threading.Lock()
        self._httpd: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # -- repos -------------------------------------------------------------------------------
    def add_repo(self, repo_type: str, repo_id: str, files: dict[str, bytes], branch: str = "main") -> str:
        digest = hashlib.sha1()
        for path in sorted(files):
            digest.update(path.encode() + b"\0" + files[path])
        sha = digest.hexdigest()
        repo = Repo(repo_type, repo_id, dict(files), sha, refs={branch: sha})
        self.repos[(repo_type, repo_id)] = repo
        return sha

    def add_folder(self, repo_type: str, repo_id: str, folder: Path) -> str:
        folder = Path(folder)
        files = {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}
        return self.add_repo(repo_type, repo_id, files)

    # -- lifecycle ---------------------------------------------------------------------------
    @property
    def url(self) -> str:
        assert self._httpd is not None, "server not started"
        host, port = self._httpd.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> HubServer:
        handler = type("Handler", (_Handler,), {"hub": self})
        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="hub-server", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None

    def __enter__(self) -> HubServer:
        return self if self._httpd is not None else self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def log(self, method: str, path: str, headers: dict) -> Faults:
        """Log a request and fix, in the same step, the faults it will suffer.

        Deciding at arrival (not when the body is about to be sent) is what keeps a slow request of
        a killed client from consuming a cut that the test set up afterwards for the next client.
        """
        route = urlsplit(path).path
        file = unquote(route.split("/resolve/", 1)[1].split("/", 1)[-1]) if "/resolve/" in route else ""
        with self._lock:
            self.requests.append((method, path, headers))
            cut = self.cut_after.pop(file, None) if method == "GET" and file else None
            faults = Faults(pause=self.delay + self.slow.get(file, 0.0) if file else 0.0, cut=cut)
        if self.echo:
            print(f"{method} {path} {headers.get('Range', '')}", flush=True)
        return faults

    def paths_requested(self, method: str | None = None) -> list[str]:
        return [p for m, p, _ in self.requests if method is None or m == method]


class _Handler(BaseHTTPRequestHandler):
    # HTTP/1.0: one request per connection, so no keep-alive thread outlives stop().
    protocol_version = "HTTP/1.0"
    hub: HubServer

    def log_message(self, format: str, *args: object) -> None:  # quiet
        pass

    # -- dispatch ----------------------------------------------------------------------------
    def do_HEAD(self) -> None:
        self._dispatch("HEAD")

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def _dispatch(self, method: str) -> None:
        split = urlsplit(self.path)
        path, query = split.path, parse_qs(split.query)
        kept = {k.title(): v for k, v in self.headers.items() if k.lower() in ("range", "user-agent")}
        if self.headers.get("Authorization"):
            kept["Authorization"] = "<present>"  # the value is never kept
        self.faults = self.hub.log(method, self.path, kept)
        try:
            if path.startswith("/api/"):
                self._api(method, path[len("/api/") :], query)
            else:
                self._resolve(method, path.lstrip("/"))
        except BrokenPipeError:
            pass

    # -- API ---------------------------------------------------------------------------------
    def _api(self, method: str, rest: str, query: dict) -> None:
        m = re.match(r"^(models|datasets)/([^/]+/[^/]+)(?:/(revision|tree|paths-info)/([^/]+)(?:/(.*))?)?$", rest)
        if not m:
            return self._error(404, "RepoNotFound", f"unknown api path {rest}")
        kind, repo_id, action, rev, sub = m.groups()
        repo = self.hub.repos.get((kind[:-1], repo_id))
        if repo is None:
            return self._error(404, "RepoNotFound", f"Repository {repo_id} not found")
        sha = self._sha(repo, unquote(rev or "main"))
        if sha is None:
            return self._error(404, "RevisionNotFound", f"Invalid rev id: {rev}")
        if action in (None, "revision"):
            return self._json(self._info(repo, sha))
        if action == "tree":
            recursive = query.get("recursive", ["false"])[0].lower() in ("true", "1")
            return self._json(self._tree(repo, unquote(sub or ""), recursive))
        if action == "paths-info" and method == "POST":
            length = int(self.headers.get("Content-Length") or 0)
            form = parse_qs(self.rfile.read(length).decode())
            out = []
            folders = repo.folders()
            for p in form.get("paths", []):
                p = p.strip("/")
                if p in repo.files:
                    out.append(repo.entry(p))
                elif p in folders:
                    out.append(repo.folder_entry(p))
            return self._json(out)
        return self._error(404, "EntryNotFound", f"unsupported {method} {rest}")

    def _info(self, repo: Repo, sha: str) -> dict:
        return {
            "_id": repo.sha[:24],
            "id": repo.repo_id,
            "author": repo.repo_id.split("/")[0],
            "sha": sha,
            "private": False,
            "gated": False,
            "disabled": False,
            "downloads": 0,
            "likes": 0,
            "tags": [],
            "lastModified": "2025-01-01T00:00:00.000Z",
            "createdAt": "2025-01-01T00:00:00.000Z",
            "siblings": [{"rfilename": p} for p in sorted(repo.files)],
            "cardData": {},
        }

    def _tree(self, repo: Repo, sub: str, recursive: bool) -> list[dict]:
        prefix = sub.strip("/") + "/" if sub.strip("/") else ""
        entries = []
        for folder in sorted(repo.folders()):
            if folder.startswith(prefix) and folder != prefix.rstrip("/"):
                rel = folder[len(prefix) :]
                if recursive or "/" not in rel:
                    entries.append(repo.folder_entry(folder))
        for path in sorted(repo.files):
            if path.startswith(prefix):
                rel = path[len(prefix) :]
                if recursive or "/" not in rel:
                    entries.append(repo.entry(path))
        return entries

    @staticmethod
    def _sha(repo: Repo, rev: str) -> str | None:
        if rev == repo.sha:
            return rev
        return repo.refs.get(rev)

    # -- files -------------------------------------------------------------------------------
    def _resolve(self, method: str, rest: str) -> None:
        kind = "model"
        if rest.startswith("datasets/"):
            kind, rest = "dataset", rest[len("datasets/") :]
        m = re.match(r"^([^/]+/[^/]+)/resolve/([^/]+)/(.+)$", rest)
        if not m:
            return self._error(404, "RepoNotFound", f"unknown path {rest}")
        repo_id, rev, file = m.group(1), unquote(m.group(2)), unquote(m.group(3))
        repo = self.hub.repos.get((kind, repo_id))
        if repo is None:
            return self._error(404, "RepoNotFound", f"Repository {repo_id} not found")
        sha = self._sha(repo, rev)
        if sha is None:
            return self._error(404, "RevisionNotFound", f"Invalid rev id: {rev}")
        if file not in repo.files:
            return self._error(404, "EntryNotFound", f"{file} does not exist", sha=sha)
        data = self.hub.tamper.get(file, repo.files[file]) if method == "GET" else repo.files[file]
        start, end = 0, len(data) - 1
        status = 200
        rng = self.headers.get("Range")
        if rng and method == "GET":
            rm = re.match(r"bytes=(\d*)-(\d*)", rng)
            if rm:
                if rm.group(1):
                    start = int(rm.group(1))
                    end = int(rm.group(2)) if rm.group(2) else end
                elif rm.group(2):
                    start = max(0, len(data) - int(rm.group(2)))
                end = min(end, len(data) - 1)
                status = 206
        body = data[start : end + 1] if data else b""
        self.send_response(status)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("ETag", f'"{repo.etag(file)}"')
        self.send_header("X-Repo-Commit", sha)
        if status == 206:
            self.send_header("Content-Range", f"bytes {start}-{end}/{len(data)}")
        self.end_headers()
        if method == "HEAD":
            return
        cut = self.faults.cut
        if self.faults.pause:
            time.sleep(self.faults.pause)
        if cut is not None and cut < len(body):
            # Simulate a dropped connection mid-download (for resume tests).
            self.wfile.write(body[:cut])
            self.wfile.flush()
            time.sleep(0.05)
            self.close_connection = True
            return
        self.wfile.write(body)

    # -- helpers -----------------------------------------------------------------------------
    def _json(self, payload: object) -> None:
        body = json.dumps(payload).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _error(self, status: int, code: str, message: str, sha: str | None = None) -> None:
        body = json.dumps({"error": message}).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.send_header("X-Error-Code", code)
        self.send_header("X-Error-Message", message)
        if sha:
            self.send_header("X-Repo-Commit", sha)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)


# -- fixtures: a tiny model repo and a tiny text dataset repo, built locally --------------------

SENTENCES = [
    "Once upon a time there was a little cat who liked to play in the garden.",
    "The dog ran to the park and found a red ball under a big tree.",
    "Lily and Tom built a tall tower of blocks, then it fell down and they laughed.",
    "A small bird sang a happy song every morning by the window.",
    "The sun was warm and the children went to the sea to swim.",
    "Mom made a cake for the party and everyone said thank you.",
]


def build_model_folder(folder: Path, preset_json: Path, weights: bool = True) -> Path:
    """config.json (tiny Qwen2), a tokenizer trained here on a few sentences, model.safetensors.

    The tokenizer is a byte-level BPE (as Qwen2's is), so AutoTokenizer, which picks Qwen2Tokenizer
    for a qwen2 config, encodes exactly as the trained tokenizer does.
    """
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    values = json.loads(Path(preset_json).read_text())
    config = AutoConfig.for_model(**values)

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=config.vocab_size,
        special_tokens=["<|endoftext|>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(SENTENCES * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<pad>")
    fast.save_pretrained(folder)

    config.eos_token_id = fast.eos_token_id
    config.pad_token_id = fast.pad_token_id
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    if weights:
        model.save_pretrained(folder)  # config.json + model.safetensors
    else:
        config.save_pretrained(folder)
    return folder


def dataset_files(lines_per_split: int = 40) -> dict[str, bytes]:
    """A README and jsonl files with a `text` field: train and validation splits."""

    def jsonl(rows: Iterable[str]) -> bytes:
        return "".join(json.dumps({"text": r}) + "\n" for r in rows).encode()

    train = [SENTENCES[i % len(SENTENCES)] + f" Story number {i}." for i in range(lines_per_split)]
    valid = [SENTENCES[(i + 3) % len(SENTENCES)] for i in range(lines_per_split // 4)]
    readme = b"---\nlicense: mit\n---\n# tiny stories for tests\n"
    return {
        "README.md": readme,
        "data/train-00000-of-00001.jsonl": jsonl(train),
        "data/validation-00000-of-00001.jsonl": jsonl(valid),
    }


# The opening of a few games, in UCI notation as laion/strategic_game_chess writes its `Moves`.
OPENING = ["e2e4", "e7e5", "g1f3", "b8c6", "f1b5", "a7a6", "b5a4", "g8f6", "e1g1", "f8e7", "f1e1", "b7b5"]
RESULTS = [("1-0", "CHECKMATE"), ("0-1", "RESIGNATION"), ("1/2-1/2", "STALEMATE")]


def chess_games(count: int = 40) -> list[dict]:
    """Rows shaped like laion/strategic_game_chess: `Moves` (a list of UCI moves), `Termination`, `Result`."""
    return [
        {"Moves": OPENING[: 4 + i % (len(OPENING) - 3)], "Termination": RESULTS[i % 3][1], "Result": RESULTS[i % 3][0]}
        for i in range(count)
    ]


def chess_dataset_files(count: int = 40) -> dict[str, bytes]:
    """A README and one jsonl train split of chess_games(count): a dataset without a `text` column."""
    rows = "".join(json.dumps(row) + "\n" for row in chess_games(count)).encode()
    return {
        "README.md": b"---\nlicense: cc-by-4.0\n---\n# chess games for tests\n",
        "data/train-00000-of-00001.jsonl": rows,
    }


if __name__ == "__main__":  # manual use: python tests/hub_server.py  (serves until Ctrl-C)
    import sys
    import tempfile

    root = Path(__file__).resolve().parents[1]
    with tempfile.TemporaryDirectory() as tmp, HubServer() as hub:
        hub.add_folder(
            "model", "acme/tiny-qwen", build_model_folder(Path(tmp) / "m", root / "src/hpcfsdp/presets/tiny.json")
        )
        hub.add_repo("dataset", "acme/tiny-stories", dataset_files())
        print(f"HF_ENDPOINT={hub.url}", flush=True)
        try:
            while True:
                time.sleep(1)
        except KeyboardInterrupt:
            sys.exit(0)
