"""Where a task's rows come from: a Hub dataset (id, config, split) or a local save_to_disk
directory (path, optional split), with optional column names. Plain data; the run configuration
(featcal_core/params/tasks.py) validates the same fields."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from featcal_core.errors import FeatCalError


@dataclass(frozen=True)
class DataSource:
    hub: str | None = None
    config: str | None = None
    revision: str | None = None  # Hub only: branch, tag or commit (None: the default branch)
    path: str | None = None
    split: str | None = None
    image_column: str | None = None
    text_column: str | None = None
    label_column: str | None = None

    @property
    def kind(self) -> str:
        return "hub" if self.hub is not None else "local"

    def identity(self) -> tuple[Any, ...]:
        """What identifies the rows: (hub, config, split) or (normalised path, split)."""
        if self.hub is not None:  # (a revision only when given: older records stay equal)
            pinned = () if self.revision is None else (self.revision,)
            return ("hub", self.hub, self.config, self.split, *pinned)
        assert self.path is not None  # a local source (as_data_source checks it)
        return ("local", os.path.normpath(os.path.expanduser(self.path)), self.split)

    def describe(self) -> str:
        if self.hub is not None:
            config = f", config {self.config}" if self.config else ""
            revision = f"@{self.revision}" if self.revision else ""
            return f"hub {self.hub}{revision}{config}, split {self.split}"
        split = f", split {self.split}" if self.split else ""
        return f"path {self.path}{split}"


def as_data_source(source: Any, key: str = "data source") -> DataSource:
    """A DataSource from a mapping or any object with the same attribute names."""
    names = [f.name for f in fields(DataSource)]
    if isinstance(source, DataSource):
        return source
    if isinstance(source, Mapping):
        unknown = sorted(set(source) - set(names))
        if unknown:
            raise FeatCalError(f"{key}: unknown keys {unknown}; allowed: {names}")
        values = dict(source)
    else:
        values = {name: getattr(source, name, None) for name in names}
    result = DataSource(**values)
    if (result.hub is None) == (result.path is None):
        raise FeatCalError(f"{key}: give exactly one of 'hub' or 'path'")
    return result
