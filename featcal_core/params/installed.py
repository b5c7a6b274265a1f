"""The params files that ship with featcal: the paper's setting (paper-clip-vit-b32), the zoo and
comparison settings. Their source is the repository's params/ folder; a wheel installs them as
featcal_core/params/files/ (pyproject.toml), a source checkout reads params/ itself.

A bare name, without `.yaml` and without a folder, that is no existing file names one of them,
from any working directory:

    featcal run --params paper-clip-vit-b32
    featcal params list
    featcal params show paper-clip-vit-b32 > my.yaml
"""

from __future__ import annotations

from pathlib import Path

#: where a wheel installs them
INSTALLED = Path(__file__).resolve().parent / "files"


def _source() -> Path | None:
    """The params/ folder of a source checkout (featcal_core's parent holds pyproject.toml)."""
    root = Path(__file__).resolve().parents[2]
    return root / "params" if (root / "pyproject.toml").is_file() else None


def params_folder() -> Path | None:
    """The folder of the shipped params files (None: neither installed nor in a checkout)."""
    for folder in (INSTALLED, _source()):
        if folder is not None and folder.is_dir() and any(folder.glob("*.yaml")):
            return folder
    return None


def installed_params() -> dict[str, Path]:
    """{name: file} of every shipped params file, by name (the file name without .yaml)."""
    folder = params_folder()
    return {path.stem: path for path in sorted(folder.glob("*.yaml"))} if folder else {}


def resolve_params(path: str | Path) -> Path:
    """The params file `path` names: itself when it exists, or when it has a suffix or a folder;
    otherwise the shipped file of that name, when there is one (else `path`, which the caller
    reports as not found)."""
    path = Path(path)
    if path.exists() or path.suffix or len(path.parts) != 1:
        return path
    return installed_params().get(path.name, path)


def installed_hint() -> str:
    """Where a user finds a params file to start from (for a not-found message)."""
    names = list(installed_params())
    if not names:
        return "see featcal params list"
    shown = ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")
    return (
        f"`featcal params list` lists the installed ones ({shown}): pass one by name "
        "(--params paper-clip-vit-b32) or copy one with `featcal params show NAME > my.yaml`"
    )
