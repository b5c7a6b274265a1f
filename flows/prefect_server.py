"""A supervised local Prefect server (SQLite in its PREFECT_HOME) on a free loopback port.

Two kinds: `prefect server start` (with Prefect's services: schedules fire; `featcal serve`, and
the tests' server shared by many flow processes), and the API alone (`temporary=True`: what every
featcal command that runs flows starts when PREFECT_API_URL is unset, `flows.environment.
command_api`, in place of Prefect's own temporary server, at the same start-up cost). Either is
stopped when the `with` block ends and, on Linux, also when the process that started it dies
however it dies, SIGKILL included (the parent-death signal: the server gets SIGTERM; it starts no
processes of its own). Given an auth string (`api_auth_string`: a random token kept in a user-only
file in PREFECT_HOME), the server refuses every API request without it (HTTP basic auth; only
GET /health and /ready stay open). Its environment carries `SERVER_OF`=<pid of the process that
started it>, so that it can be found. This module does not import Prefect.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import fcntl
import importlib.util
import logging
import os
import secrets
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

from featcal_core.errors import FeatCalError

log = logging.getLogger(__name__)


#: the basic-auth user name; the password is the token in TOKEN_FILE
AUTH_USER = "featcal"
#: the file in PREFECT_HOME holding the local server's API token (mode 0600)
TOKEN_FILE = "featcal-api-token"
#: in the server's environment: the pid of the process that started it
SERVER_OF = "FEATCAL_PREFECT_SERVER_OF"


def api_auth_string(home: str | Path) -> str:
    """The local server's basic-auth string `featcal:TOKEN`, its token read from `home`/TOKEN_FILE
    or, the first time, generated and written there (created user-only, mode 0600). FeatCalError
    if the file is a symlink, empty, or not private to this user (owner or mode), or `home`
    has no space or cannot be written (`check_home`)."""
    check_home(home)
    path = Path(home) / TOKEN_FILE
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    if path.exists() or path.is_symlink():
        return f"{AUTH_USER}:{_read_token(path)}"
    # written in full under a private name, then linked into place: a command starting at the
    # same moment never reads a half-written token; the loser of the race reads the winner's
    token = secrets.token_urlsafe(32)
    draft = path.with_name(f".{TOKEN_FILE}.{os.getpid()}-{secrets.token_hex(4)}")
    try:
        fd = os.open(draft, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as file:
            file.write(token + "\n")
        os.link(draft, path)
    except FileExistsError:
        token = _read_token(path)
    except OSError as err:
        raise FeatCalError(f"cannot create the Prefect API token file {path}: {err}") from err
    else:
        log.info("generated the local Prefect server's API token in %s", path)
    finally:
        draft.unlink(missing_ok=True)
    return f"{AUTH_USER}:{token}"


def _read_token(path: Path) -> str:
    """The token in an existing token file, after checking that only this user can read it."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as err:  # a symlink (ELOOP) included
        raise FeatCalError(
            f"cannot read the Prefect API token file {path} ({err}); delete it and a new token "
            "is generated at the next start"
        ) from err
    with os.fdopen(fd) as file:
        info = os.fstat(file.fileno())  # the opened file itself: no check-then-open race
        if info.st_uid != os.getuid():
            raise FeatCalError(
                f"the Prefect API token file {path} is owned by uid {info.st_uid}, not by you "
                f"(uid {os.getuid()}); delete it (a new token is generated) or, as its owner, "
                f"run `chmod 600 {path}`"
            )
        if not stat.S_ISREG(info.st_mode):
            raise FeatCalError(
                f"the Prefect API token file {path} is not a regular file; remove it"
            )
        if info.st_mode & 0o077:
            raise FeatCalError(
                f"the Prefect API token file {path} has mode {stat.filemode(info.st_mode)}: "
                f"other users can read it; run `chmod 600 {path}` (and consider deleting it so "
                "that a new token is generated)"
            )
        token = file.read().strip()
    if not token:
        raise FeatCalError(
            f"the Prefect API token file {path} is empty; delete it and a new token is generated "
            "at the next start"
        )
    return token


#: what to do about a PREFECT_HOME without space for the local server's database
_HOME_FIX = (
    "free space there, or point PREFECT_HOME at a folder on another disk (or PREFECT_API_URL "
    "at a running Prefect server)"
)
#: what to do about a PREFECT_HOME that cannot be written
_HOME_WRITABLE = (
    "make it writable, or point PREFECT_HOME at a folder you can write (or PREFECT_API_URL "
    "at a running Prefect server)"
)
#: the free space below which a server that exited at start-up is put down to its full disk
LOW_SPACE_BYTES = 64 * 2**20
#: what `check_home` writes (and removes) to prove that PREFECT_HOME takes a write
_PROBE_BYTES = 64 * 2**10


def home_of(home: str | Path | None = None) -> Path:
    """The PREFECT_HOME a server started with `home` uses: `home`, else this process's
    PREFECT_HOME, else Prefect's default `~/.prefect`."""
    chosen = home or os.environ.get("PREFECT_HOME") or Path.home() / ".prefect"
    return Path(chosen).expanduser()


def check_home(home: str | Path) -> None:
    """FeatCalError naming `home` and the fix when it (or, not yet created, the folder it would
    be created in) has no space or cannot be written: a few KiB are written there and removed
    (nothing is left, `home` is not created)."""
    home = Path(home).expanduser()
    place = home
    while not place.exists() and place != place.parent:
        place = place.parent
    probe = place / f".featcal-space-probe-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            left = _PROBE_BYTES
            while left:  # a nearly full disk takes part of a write, then refuses the rest
                left -= os.write(fd, b"\0" * left)
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as err:
        if err.errno in (errno.ENOSPC, errno.EDQUOT):
            problem, fix = f"has no space left ({err.strerror})", _HOME_FIX
        else:
            problem, fix = f"cannot be written ({err.strerror or err})", _HOME_WRITABLE
        raise FeatCalError(
            f"PREFECT_HOME {home} {problem}: the local Prefect server keeps its database there; "
            f"{fix}"
        ) from err
    finally:
        with suppress(OSError):  # never created on a read-only disk
            probe.unlink()


def _exit_reason(server: subprocess.Popen, home: Path) -> str:
    """Why the local server exited before it answered, as far as can be told from outside:
    its PREFECT_HOME full, read-only or nearly full, else its exit status alone."""
    status = f"the local Prefect server exited with status {server.returncode}"
    try:
        check_home(home)
    except FeatCalError as err:
        return f"{err} ({status})"
    place = home if home.exists() else home.parent
    try:
        free = shutil.disk_usage(place).free
    except OSError:
        free = None
    if free is not None and free < LOW_SPACE_BYTES:
        return (
            f"{status}: PREFECT_HOME {home} has only {free / 2**20:.1f} MiB free, too little "
            f"for the server's database; {_HOME_FIX}"
        )
    return f"{status}; run `prefect server start` by hand to see why, or set PREFECT_API_URL"


#: the file in PREFECT_HOME whose lock serialises the start-up of local servers on that home
START_LOCK = ".featcal-server-start.lock"


@contextmanager
def start_lock(home: str | Path) -> Iterator[None]:
    """Hold, across processes, the start-up lock of servers on `home`'s database: two commands
    starting at once would run the database's migrations together, and one server would exit
    (SQLite "database is locked"). The lock file is opened without following links."""
    path = Path(home) / START_LOCK
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    except OSError as err:
        raise FeatCalError(
            f"cannot open the Prefect start-up lock {path}: {err}; remove it"
        ) from err
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # released by the kernel if this process dies
        yield
    finally:
        os.close(fd)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _healthy(api_url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{api_url}/health", timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


_PR_SET_PDEATHSIG = 1


def _parent_death_signal():
    """A function for Popen's preexec_fn that makes Linux send the child SIGTERM when this
    process dies, however it dies (SIGKILL included); None where prctl is unavailable. The libc
    function is looked up here, in the parent, so the child only calls it. The signal is tied to
    the *thread* that forks (Linux sends it when that thread ends), so start servers from the
    main thread, or from a thread that outlives the server. A parent that died before prctl
    took effect is caught by comparing the parent pid."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def arm() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:  # died between the fork and prctl
            os._exit(1)

    return arm


def wait_healthy(
    api_url: str,
    timeout_s: float,
    server: subprocess.Popen | None = None,
    home: str | Path | None = None,
) -> None:
    """Wait until the Prefect API at `api_url` answers; FeatCalError after `timeout_s` seconds or
    as soon as `server` (the process serving it, when known) exits: then naming its PREFECT_HOME
    (`home_of(home)`) when that has no space or cannot be written."""
    deadline = time.monotonic() + timeout_s
    while not _healthy(api_url):
        if server is not None and server.poll() is not None:
            raise FeatCalError(_exit_reason(server, home_of(home)))
        if time.monotonic() > deadline:
            raise FeatCalError(f"the local Prefect server did not answer at {api_url}")
        time.sleep(0.1)


def _temporary_command(port: int) -> tuple[list[str], dict[str, str]]:
    """The command and environment of Prefect's own temporary server (the API alone, no UI, the
    services an ephemeral server runs), as `prefect.server.api.server.SubprocessASGIServer`
    starts it."""
    spec = importlib.util.find_spec("prefect")
    if spec is None or not spec.submodule_search_locations:
        raise FeatCalError("prefect is not installed; pip install prefect, or set PREFECT_API_URL")
    app_dir = Path(next(iter(spec.submodule_search_locations))).parent
    command = [
        sys.executable,
        "-m",
        "uvicorn",
        "--app-dir",
        str(app_dir),
        "--factory",
        "prefect.server.api.server:create_app",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--log-level",
        "error",
        "--lifespan",
        "on",
    ]
    env = {
        "PREFECT_UI_ENABLED": "0",
        "PREFECT__SERVER_EPHEMERAL": "1",
        "PREFECT__SERVER_FINAL": "1",
    }
    return command, env


def start_server(
    *,
    port: int | None = None,
    home: str | Path | None = None,
    auth: str | None = None,
    ui: bool = False,
    temporary: bool = False,
) -> tuple[subprocess.Popen, str]:
    """Start a Prefect server on 127.0.0.1 and return at once (not waiting for it to answer: see
    `wait_healthy`) with the process and its API URL; stop it with `stop_server`.

    port: None picks a free one. home: the server's PREFECT_HOME (its SQLite database); None keeps
    this process's. auth: a basic-auth string `user:password` (`api_auth_string`) that every API
    request must carry, passed in the server's environment (never its command line); None leaves
    the API open. ui: also serve Prefect's web UI (at the API URL without `/api`). temporary: the
    API alone as Prefect's temporary server runs it (no schedules, no UI) instead of
    `prefect server start`. On Linux the server gets SIGTERM when the thread that called this
    ends, as it does when the process dies (SIGKILL included): call it from the main thread or
    from a thread that outlives the server."""
    port = _free_port() if port is None else port
    env = dict(os.environ)
    if temporary:
        command, extra = _temporary_command(port)
        env.update(extra)
    else:
        command = [
            sys.executable,
            "-m",
            "prefect",
            "server",
            "start",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--ui" if ui else "--no-ui",
            "--analytics-off",
        ]
    env[SERVER_OF] = str(os.getpid())
    api_url = f"http://127.0.0.1:{port}/api"
    if ui:  # the UI's page asks /ui-settings where the API is: this port, not the default 4200
        env["PREFECT_UI_API_URL"] = api_url
    if home is not None:
        env["PREFECT_HOME"] = str(home)
    if auth is not None:
        env["PREFECT_SERVER_API_AUTH_STRING"] = auth  # the server checks requests against it
        env["PREFECT_API_AUTH_STRING"] = auth  # and its own clients, if any, send it
    server = subprocess.Popen(
        command,
        start_new_session=True,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=env,
        preexec_fn=_parent_death_signal(),
    )
    return server, api_url


def stop_server(server: subprocess.Popen, timeout_s: float = 30.0) -> None:
    """SIGTERM the server's process group; SIGKILL it if it has not exited after `timeout_s`."""
    try:
        os.killpg(server.pid, signal.SIGTERM)
    except ProcessLookupError:  # already gone
        server.wait()
        return
    try:
        server.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait()


@contextmanager
def local_server(
    timeout_s: float = 180.0,
    *,
    port: int | None = None,
    home: str | Path | None = None,
    auth: str | None = None,
    ui: bool = False,
    temporary: bool = False,
) -> Iterator[str]:
    """A supervised `start_server`; yields its API URL once it answers, stops it on exit."""
    check_home(home_of(home))
    server, api_url = start_server(port=port, home=home, auth=auth, ui=ui, temporary=temporary)
    try:
        wait_healthy(api_url, timeout_s, server, home)
        log.info(
            "local Prefect server at %s (pid %d, %s)",
            api_url,
            server.pid,
            "basic auth" if auth else "no auth",
        )
        yield api_url
    finally:
        stop_server(server)
