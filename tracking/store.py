"""Where MLflow runs go: the tracking URI, the artifact root, the experiment, the git commit.

The store: the MLFLOW_TRACKING_URI environment variable, else `tracking.mlflow_tracking_uri`, else
the SQLite store `<project_root>/mlruns/mlflow.db` with artifacts in
`<project_root>/mlruns/artifacts`. Every path is made absolute, so processes started from other
working directories (Prefect workers, Dask) share one store. `mlflow` is imported only by
`ensure_experiment`; MLFLOW_DISABLE_TELEMETRY is set to true (unless set) when this module is
imported.
"""

from __future__ import annotations

import logging
import os
import re
import shlex
import subprocess
from pathlib import Path
from urllib.parse import urlsplit

from featcal_core.params import TrackingSettings

# before MLflow can be imported (every tracking module that imports it sets this)
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")

__all__ = [
    "STORE_DIR",
    "artifact_root",
    "browse_command",
    "ensure_experiment",
    "git_commit",
    "opened_store",
    "store_failure",
    "tracking_uri",
]

log = logging.getLogger(__name__)

STORE_DIR = "mlruns"  # under the project root: mlflow.db and artifacts/

# Backends that keep runs in a database; their default artifact root is ./mlruns relative to the
# working directory, so these get an absolute one. (http, databricks and file stores choose their own.)
_DATABASE_SCHEMES = ("sqlite", "postgresql", "mysql", "mssql")


def tracking_uri(settings: TrackingSettings, project_root: Path) -> str:
    """The tracking URI: MLFLOW_TRACKING_URI, else `settings.mlflow_tracking_uri`, else the local
    SQLite store `sqlite:////<project_root>/mlruns/mlflow.db`.

    A relative SQLite path is made absolute: against the working directory for the environment
    variable (MLflow's own reading), against `project_root` for the settings (as params.yaml paths).
    """
    project_root = Path(project_root).expanduser().resolve()
    env = os.environ.get("MLFLOW_TRACKING_URI", "").strip()
    if env:
        return _absolute_sqlite(env, Path.cwd())
    if settings.mlflow_tracking_uri:
        return _absolute_sqlite(settings.mlflow_tracking_uri.strip(), project_root)
    return _sqlite_uri(project_root / STORE_DIR / "mlflow.db")


def artifact_root(uri: str, project_root: Path) -> str | None:
    """Where new experiments keep their artifacts, as a file URI; None: the server or store decides.

    SQLite: `artifacts/` beside the database file (for the default store:
    `<project_root>/mlruns/artifacts`); other databases: `<project_root>/mlruns/artifacts`.
    """
    scheme = _scheme(uri)
    if scheme == "sqlite":
        db = _sqlite_path(uri)
        if db is not None:
            return (db.parent / "artifacts").as_uri()
    if scheme in _DATABASE_SCHEMES:
        return (Path(project_root).expanduser().resolve() / STORE_DIR / "artifacts").as_uri()
    return None


def browse_command(uri: str) -> str | None:
    """How to look at the runs of the store at `uri`, runnable as printed: for a database or
    file store the command `mlflow ui --backend-store-uri <uri>` (the URI quoted for a POSIX
    shell where it needs it; SQLite with `--workers 1`: one server process on the file); for a
    tracking server (http, https) its address; None for any other store (databricks)."""
    scheme = _scheme(uri)
    if scheme in ("http", "https"):
        return uri
    if scheme not in (*_DATABASE_SCHEMES, "file"):
        return None
    command = ["mlflow", "ui", "--backend-store-uri", uri]
    if scheme == "sqlite":
        command += ["--workers", "1"]
    return shlex.join(command)


#: the store `ensure_experiment` last opened in this process (what `opened_store` names)
_opened: str | None = None


def ensure_experiment(name: str, uri: str, artifact_root: str | Path | None) -> str:
    """The id of experiment `name` in the store at `uri`, created with an absolute artifact
    location when missing (a deleted experiment of that name is restored)."""
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    global _opened
    _opened = uri
    _make_sqlite_dir(uri)
    client = MlflowClient(uri)
    experiment = client.get_experiment_by_name(name)
    if experiment is None:
        location = _location_uri(artifact_root)
        try:
            return client.create_experiment(name, artifact_location=location)
        except MlflowException as exc:  # created meanwhile by another process
            experiment = client.get_experiment_by_name(name)
            if experiment is None:
                raise exc from None
    if experiment.lifecycle_stage == "deleted":
        log.warning("MLflow experiment %r was deleted; restoring it", name)
        client.restore_experiment(experiment.experiment_id)
    return experiment.experiment_id


def opened_store() -> str | None:
    """Where the store this process last opened (`ensure_experiment`) lives: a SQLite store's
    database file, any other store's URI without its user and password; None before one is
    opened."""
    if _opened is None:
        return None
    path = _sqlite_path(_opened)
    if path is not None:
        return str(path)
    parts = urlsplit(_opened)
    return parts._replace(netloc=parts.netloc.rpartition("@")[2]).geturl()


def store_failure(exc: BaseException) -> str | None:
    """One line of what failed when `exc` (or an exception it came from) was raised by the
    tracking store's database layer (SQLAlchemy, MLflow's store): the innermost message, e.g.
    "sqlite3.OperationalError: database or disk is full"; None for any other exception."""
    chain, seen = [], set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        chain.append(current)
        current = current.__cause__ or current.__context__
    if not any(type(e).__module__.split(".")[0] in ("sqlalchemy", "mlflow") for e in chain):
        return None
    inner = chain[-1]
    text = " ".join(str(inner).split())[:300]
    return f"{type(inner).__module__}.{type(inner).__name__}: {text}"


def git_commit(project_root: Path) -> tuple[str, bool | None]:
    """(HEAD commit, whether tracked files differ from it) for `project_root`; ("unknown", None)
    when it is not in a git work tree or git is unavailable."""
    try:
        head = _git(project_root, "rev-parse", "HEAD")
    except (OSError, subprocess.SubprocessError):
        return "unknown", None
    if not re.fullmatch(r"[0-9a-f]{40,64}", head):
        return "unknown", None
    try:
        dirty = bool(_git(project_root, "status", "--porcelain", "--untracked-files=no"))
    except (OSError, subprocess.SubprocessError):
        dirty = None
    return head, dirty


def _git(cwd: Path, *args: str) -> str:
    done = subprocess.run(
        ["git", *args], cwd=cwd, capture_output=True, text=True, timeout=10, check=True
    )
    return done.stdout.strip()


def _scheme(uri: str) -> str:
    """The backend of a store URI: "sqlite", "postgresql" (for postgresql+psycopg2), "file", ..."""
    scheme = urlsplit(uri).scheme.lower()
    if len(scheme) <= 1:  # a plain path (or a Windows drive letter)
        return "file"
    return scheme.split("+", 1)[0]


def _sqlite_path(uri: str) -> Path | None:
    """The database file of a `sqlite:///path` URI; None for in-memory databases."""
    if _scheme(uri) != "sqlite" or not uri.lower().startswith("sqlite:///"):
        return None
    path = uri[len("sqlite:///") :].split("?", 1)[0]
    if not path or path == ":memory:":
        return None
    return Path(path)


def _sqlite_uri(path: Path) -> str:
    return f"sqlite:///{path.as_posix()}"  # absolute path: sqlite:////abs/path


def _absolute_sqlite(uri: str, base: Path) -> str:
    path = _sqlite_path(uri)
    if path is None or path.is_absolute():
        return uri
    query = uri.split("?", 1)[1] if "?" in uri else None
    absolute = _sqlite_uri((base / path).resolve())
    return f"{absolute}?{query}" if query else absolute


def _make_sqlite_dir(uri: str) -> None:
    path = _sqlite_path(uri)
    if path is not None:
        path.expanduser().parent.mkdir(parents=True, exist_ok=True)


def _location_uri(location: str | Path | None) -> str | None:
    if location is None:
        return None
    text = str(location)
    if "://" in text or text.startswith("file:"):
        return text
    return Path(text).expanduser().resolve().as_uri()
