"""Preflight: check every model and dataset a params file names before anything is downloaded.

    problems, notes = check(params)   # [(params key, what is wrong; the fix)], [(key, note)]

Models: a local directory must exist with a config.json of a supported family and safetensors
weights that open as every command opens them (the headers), and a local expert must have the
local base's structure (featcal_core.io.structure); a Hub model must exist at its revision (the
Hub's file listing; offline: the cache) with safetensors weights, or a safetensors conversion pull
request to use (a note), and a supported config (config.json is the only file fetched); every
expert must be of the base's family.
`evaluation.harness`: lm-eval must be installed (else one line, before anything else), its
include_path a folder, its tasks known to lm-eval, and the base a causal LM; the tasks'
evaluation sources, which the run then never reads, are not checked (a note each).
Datasets: a local save_to_disk folder must open (memory-mapped: no rows are read) with its split,
its input column and, for evaluation, its label column; where the head is zero-shot, class names
must be given or come from the label feature or a prompt set, one per class. A Hub dataset must
exist (the Hub's API) and have its config, split and columns as its card says (datasets' builder
reads the card and the file listing, no rows); offline it is left to the run (a note). Nothing
here writes or downloads weights or rows.

With a `zoo:` section the models and tasks come from the zoo, which the run builds first: there
is nothing to check yet.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from featcal_core.errors import FeatCalError

log = logging.getLogger(__name__)

Finding = tuple[str, str]  # (params key, one line: what is wrong and the fix / the note)


class Notes(list[Finding]):
    """The notes of a check, and among them the items it could not check: `unchecked` holds
    (params key, why: "offline", "unreachable" or "not read")."""

    def __init__(self) -> None:
        super().__init__()
        self.unchecked: list[Finding] = []

    def skip(self, key: str, text: str, why: str) -> None:
        """Note that `key` was not checked, and why."""
        self.append((key, text))
        self.unchecked.append((key, why))


def check(params: Any, *, cache_dir: str | Path | None = None) -> tuple[list[Finding], Notes]:
    """(problems, notes) of the models and datasets of `params` (featcal_core.params.Params);
    `notes.unchecked` names the items that could not be checked."""
    problems: list[Finding] = []
    notes = Notes()
    harness = params.evaluation.harness
    if harness is not None:  # lm-eval installed (else one line, now), its tasks known
        from featcal_core.evaluation.harness import check_settings, require_lm_eval

        require_lm_eval()
        experts = list(params.models.experts) if params.models is not None else None
        problems += check_settings(harness, experts)
    if params.zoo is not None:
        notes.append(("zoo", "models and tasks come from the zoo, which the run builds first"))
        return problems, notes
    families = {}
    roles = {"models.base": params.models.base}
    roles.update({f"models.experts.{t}": r for t, r in params.models.experts.items()})
    configs: dict[str, Path] = {}  # role → config.json of a Hub model (compared below)
    offline = bool(params.models.hub_offline)  # the run reads the cache only
    cache_dir = cache_dir or params.models.hub_cache
    for role, ref in roles.items():
        families[role] = _check_model(role, ref, cache_dir, problems, notes, configs, offline)
    base = families.get("models.base")
    for role, family in families.items():
        if family is _ADAPTER:
            families[role] = base  # an adapter stands for a model of the base's family
        elif base is not None and family is not None and family.name != base.name:
            problems.append(
                (
                    role,
                    f"is a {family.name} model, the base a {base.name} one; "
                    "every expert must be fine-tuned from the base",
                )
            )
    _check_structure(roles, families, problems)
    _check_hub_configs(configs, families, problems)
    _check_hub_vocabularies(roles, families, configs, problems)
    if harness is not None and base is not None and base is not _ADAPTER and not base.causal:
        problems.append(
            (
                "evaluation.harness",
                f"lm-evaluation-harness scores causal LMs; models.base is a {base.name} model; "
                "remove evaluation.harness",
            )
        )
    hub: dict = {}  # one Hub lookup per dataset and config, however many roles read it
    for task, spec in params.tasks.items():
        sources = {"calibration": spec.calibration}
        if harness is None:
            sources["evaluation"] = spec.evaluation
        else:  # the run never reads them: lm-eval scores the models on its own tasks' data
            notes.append(
                (
                    f"tasks.{task}.evaluation",
                    f"{spec.evaluation.describe()}: not read (lm-evaluation-harness scores the "
                    "models on evaluation.harness.tasks)",
                )
            )
        if spec.validation is not None:
            sources["validation"] = spec.validation
        for role, source in sources.items():
            _check_source(
                f"tasks.{task}.{role}", task, role, spec, source, base, problems, notes, hub
            )
    return problems, notes


# ---------------------------------------------------------------------------------------- models


#: `_check_model`'s answer for a LoRA adapter folder (its family is its base's)
_ADAPTER = object()


def _check_model(
    role: str,
    ref: Any,
    cache_dir,
    problems: list[Finding],
    notes: Notes,
    configs: dict[str, Path] | None = None,
    offline: bool = False,
):
    """The model's architecture adapter (None when it cannot be known); problems appended; a Hub
    model's config.json recorded in `configs` by role."""
    if ref.format != "hf":
        notes.append((role, f"{ref.ref}: an {ref.format} checkpoint, checked when it is imported"))
        return None
    if ref.kind == "local":
        path = Path(ref.path).expanduser()
        if not path.is_dir():
            problems.append(
                (
                    role,
                    f"local model directory {ref.ref!r} does not exist (looked in "
                    f"{path.absolute()}); fix the path, or create it first (e.g. "
                    "`dvc pull`, or save_pretrained there)",
                )
            )
            return None
        from featcal_core.io.adapters import is_adapter

        if role != "models.base" and is_adapter(path):
            return _ADAPTER  # opened over the base by _check_structure
        files = [p.name for p in path.iterdir() if p.is_file()]
        config = path / "config.json" if "config.json" in files else None
        where = str(path)
    else:
        found = _hub_model(role, ref, cache_dir, problems, notes, offline)
        if found is None:
            return None
        files, config, where = found
    if config is None and not any(name.endswith(".safetensors") for name in files):
        problems.append(
            (
                role,
                f"{where} is not a model folder (no config.json, no safetensors weights); point "
                "at a save_pretrained folder or a Hub model id",
            )
        )
        return None
    if not any(name.endswith(".safetensors") for name in files):
        pickled = sorted(n for n in files if n.endswith((".bin", ".pt", ".pth", ".ckpt")))
        problems.append(
            (
                role,
                f"{where} has no safetensors weights"
                f"{' (only ' + ', '.join(pickled) + ')' if pickled else ''}; "
                "pickled weights are not read: save it with save_pretrained "
                "(safetensors) or point at a revision that has them",
            )
        )
    if config is None:
        problems.append((role, f"{where} has no config.json; point at a save_pretrained folder"))
        return None
    if ref.kind != "local" and configs is not None:
        configs[role] = Path(config)
    return _family(role, Path(config), problems)


def _check_hub_configs(configs: dict[str, Path], families: dict, problems: list[Finding]) -> None:
    """Each Hub expert's config.json against the base's, as the run compares them once the
    weights are there (featcal_core.io.structure's shape fields, featcal_core.io.vocabulary's
    `vocab_size`): a fine-tune of another geometry or vocabulary is found before any download.
    Local models are compared on their headers (`_check_structure`)."""
    from featcal_core.io.structure import structure

    base_family = families.get("models.base")
    if base_family is None or base_family is _ADAPTER:
        return

    def fields(path: Path) -> dict[str, Any] | None:
        try:
            config = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None  # reported by `_family`
        if not isinstance(config, dict):
            return None
        found = structure(config)
        for key, inner in (("", config), ("text_config.", config.get("text_config"))):
            if isinstance(inner, dict) and isinstance(inner.get("vocab_size"), int):
                found[f"{key}vocab_size"] = inner["vocab_size"]
        return found

    base_source = configs.get("models.base")
    base = fields(base_source) if base_source is not None else None
    if base is None:
        return  # a local base: its experts are compared on their headers
    for role, path in configs.items():
        family = families.get(role)
        if role == "models.base" or family is None or family.name != base_family.name:
            continue  # a family mismatch is reported already
        theirs = fields(path)
        if theirs is None or theirs.get("model_type") != base.get("model_type"):
            continue  # another config class of the family (e.g. a CLIPModel's vision tower)
        differs = [k for k, v in base.items() if k in theirs and theirs[k] != v]
        if differs:
            key = differs[0]
            problems.append(
                (
                    role,
                    f"config.json has {key} {theirs[key]!r}, the base's {base[key]!r}; "
                    "every expert must be a fine-tune of the base with its geometry and "
                    "vocabulary: point at the expert fine-tuned from this base",
                )
            )


@dataclass
class _Snapshot:
    """A Hub model's snapshot folder as far as `featcal check` fetched it (config.json and
    tokenizer files), or a local folder: what featcal_core.io.vocabulary reads."""

    directory: Path
    config: dict
    role: str


def _check_hub_vocabularies(
    roles: dict[str, Any], families: dict, configs: dict[str, Path], problems: list[Finding]
) -> None:
    """Each expert's token ids against the base's (featcal_core.io.vocabulary) where either is a
    Hub model, from its fetched config.json and tokenizer files (local pairs: `_check_structure`)."""
    from featcal_core.architectures.base import require_tokenizer
    from featcal_core.io.vocabulary import check_same_vocabulary

    def snapshot(role: str) -> _Snapshot | None:
        ref = roles[role]
        folder = configs[role].parent if role in configs else None
        if folder is None and ref.kind == "local" and ref.format == "hf":
            folder = Path(ref.path).expanduser()
        if folder is None:
            return None
        try:
            config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None  # not fetched, or reported already
        what = "base model" if role == "models.base" else "expert"
        return _Snapshot(folder, config, what) if isinstance(config, dict) else None

    base_family = families.get("models.base")
    if base_family is None or base_family is _ADAPTER:
        return
    base = snapshot("models.base")
    if base is not None and "models.base" in configs and base_family.modality == "text":
        try:  # the run's calibration and evaluation tokenize with the base's tokenizer
            require_tokenizer(base.directory, f"Hub model {roles['models.base'].ref!r}")
        except FeatCalError as exc:
            problems.append(("models.base", str(exc)))
    for role in roles:
        family = families.get(role)
        if (
            base is None
            or role == "models.base"
            or getattr(family, "name", None) != base_family.name
        ):
            continue
        if role not in configs and "models.base" not in configs:
            continue  # two local folders: compared with their weights
        other = snapshot(role)
        try:
            if other is not None:
                check_same_vocabulary(base, other)
        except FeatCalError as exc:
            problems.append((role, str(exc)))


def _check_structure(roles: dict[str, Any], families: dict, problems: list[Finding]) -> None:
    """Local models of a known family, opened as every command opens them (config.json and the
    safetensors headers, no weights), and each expert compared with the base
    (featcal_core.io.structure); a model whose family differs from the base's is reported
    already."""
    from featcal_core.architectures.base import require_tokenizer
    from featcal_core.io.adapters import is_adapter, open_expert
    from featcal_core.io.checkpoint import Checkpoint
    from featcal_core.io.structure import check_fine_tune

    opened: dict[str, Checkpoint] = {}
    adapters = {}
    for role, ref in roles.items():
        path = Path(ref.path).expanduser() if ref.kind == "local" else None
        if families.get(role) is None or path is None or not any(path.glob("*.safetensors")):
            continue  # not local, or its config or weights are reported already
        if role != "models.base" and is_adapter(path):
            adapters[role] = path
            continue
        try:
            opened[role] = Checkpoint(path, "base model" if role == "models.base" else "expert")
        except FeatCalError as exc:
            problems.append((role, str(exc)))
    base = opened.pop("models.base", None)
    family = families.get("models.base")
    if base is not None and getattr(family, "modality", "") == "text":
        try:  # the run's calibration and evaluation tokenize with the base's tokenizer
            require_tokenizer(base.directory)
        except FeatCalError as exc:
            problems.append(("models.base", str(exc)))
    for role, path in adapters.items():  # its config, weights and shapes against the base's
        if base is None:
            continue
        try:
            opened[role] = open_expert(path, "expert", base)
        except FeatCalError as exc:
            problems.append((role, str(exc)))
    for role, checkpoint in opened.items():
        if base is None or families[role].name != families["models.base"].name:
            continue
        try:
            check_fine_tune(base, checkpoint)
        except FeatCalError as exc:
            problems.append((role, str(exc)))


def _family(role: str, config: Path, problems: list[Finding]):
    from featcal_core.architectures import detect

    try:
        data = json.loads(config.read_text(encoding="utf-8"))
    except ValueError as exc:
        problems.append(
            (role, f"{config} is not valid JSON ({exc}); fix the file or fetch the model again")
        )
        return None
    except OSError as exc:
        problems.append((role, f"{config} cannot be read ({exc}); fetch the model again"))
        return None
    try:
        return detect(data, source=str(config))
    except FeatCalError as exc:
        problems.append((role, str(exc)))
    return None


def _unreachable(exc: BaseException) -> bool:
    """A failure the download step retries (network, HTTP 429/5xx): the check cannot tell."""
    from featcal_core.provenance.hub import _is_transient

    return _is_transient(exc)


def _hub_model(
    role: str, ref: Any, cache_dir, problems: list[Finding], notes: Notes, offline: bool = False
):
    """(top-level file names, local config.json or None, where) of a Hub model, or None after
    appending the problem. Online: the Hub's listing and config.json; offline: the cache."""
    from huggingface_hub import HfApi, hf_hub_download, try_to_load_from_cache
    from huggingface_hub.errors import LocalEntryNotFoundError

    from featcal_core.provenance.hub import _offline
    from featcal_core.provenance.resolve import _conversion_revision, conversion_fix

    repo_id, revision = ref.repo_id, ref.revision
    where = f"Hub model {ref.ref!r}"
    offline = offline or _offline()
    try:
        if offline:
            config = try_to_load_from_cache(
                repo_id, "config.json", cache_dir=cache_dir, revision=revision
            )
            if not isinstance(config, str):  # worded as the download step words it
                raise LocalEntryNotFoundError(f"{repo_id}: config.json is not cached")
            files = [p.name for p in Path(config).parent.iterdir()]
        else:
            info = HfApi().model_info(repo_id, revision=revision)
            files = [s.rfilename for s in info.siblings or [] if "/" not in s.rfilename]
            config = None
    except Exception as exc:
        _hub_failure(exc, role, ref, offline, "the Hub did not answer", problems, notes)
        return None
    if revision is None and not any(name.endswith(".safetensors") for name in files):
        failures: list[str] = []
        converted = _conversion_revision(repo_id, cache_dir, offline, failures)
        if converted is None and failures:  # the Hub did not list its pull requests
            problems.append(
                (
                    role,
                    f"{where} has no safetensors weights on its default branch and the look-up "
                    f"of its safetensors conversion failed ({failures[0]}); "
                    f"{conversion_fix(repo_id)}",
                )
            )
            return None
        if converted is not None:
            revision = converted[0]
            notes.append(
                (
                    role,
                    f"{where} has pickled weights only on its default branch; the "
                    f"run uses its safetensors conversion {revision} ({converted[1]})",
                )
            )
            files = [*files, "model.safetensors"]  # checked when the conversion is fetched
    if "config.json" in files and config is None:
        from featcal_core.io.vocabulary import TOKENIZER_FILES

        try:  # config.json and the tokenizer's small files, compared with the base's
            for name in ["config.json", *(n for n in files if n in TOKENIZER_FILES)]:
                path = hf_hub_download(repo_id, name, revision=revision, cache_dir=cache_dir)
                config = path if name == "config.json" else config
        except Exception as exc:
            _hub_failure(exc, role, ref, offline, "config.json not fetched", problems, notes)
            return None
    return files, config, where + (f" at {revision}" if revision else "")


def _hub_failure(
    exc: BaseException,
    role: str,
    ref: Any,
    offline: bool,
    unanswered: str,
    problems: list[Finding],
    notes: Notes,
) -> None:
    """A Hub look-up that failed: a note when the Hub did not answer (the download step retries
    those), else a problem worded as the download step words it (hub._hub_error)."""
    from featcal_core.provenance.hub import _hub_error

    if _unreachable(exc):
        notes.skip(
            role,
            f"Hub model {ref.ref!r}: {unanswered} ({type(exc).__name__}); not checked (the "
            "download step retries)",
            "unreachable",
        )
        return
    error = _hub_error(exc, role, ref.ref, ref.repo_id, offline)
    problems.append((role, str(error or f"Hub model {ref.ref!r}: {exc}").removeprefix(f"{role}: ")))


def _own_key(key: str, message: str) -> Finding:
    """(key, message) of an error that may name `key` or a key below it first
    ("tasks.a.evaluation.split: ..."): that key, once."""
    first, sep, rest = message.partition(": ")
    if sep and (first == key or first.startswith(f"{key}.")):
        return first, rest
    return key, message


# -------------------------------------------------------------------------------------- datasets


def _check_source(
    key: str,
    task: str,
    role: str,
    spec: Any,
    source: Any,
    family,
    problems: list[Finding],
    notes: Notes,
    hub: dict,
) -> None:
    """Problems of one data source: missing, no such split, missing columns, no class names.
    hub: the Hub lookups made so far (`_remembered`)."""
    if source.kind == "hub":
        features = _hub_features(key, source, problems, notes, hub)
    else:
        features = _local_features(key, source, problems)
    if features is not None:
        _check_features(key, task, role, spec, source, family, features, problems)


def _local_features(key: str, source: Any, problems: list[Finding]):
    """The features (column → datasets feature) of a local save_to_disk source, or None after
    recording why it does not open."""
    from featcal_core.data.source_rows import open_source

    path = Path(source.path).expanduser()
    if not path.exists():
        problems.append(
            (
                key,
                f"local dataset {source.path!r} does not exist (looked in "
                f"{path.absolute()}); fix the path or save_to_disk it there",
            )
        )
        return None
    try:
        return open_source(source.core(), key=key).features
    except FeatCalError as exc:
        problems.append(_own_key(key, str(exc)))
        return None


def _check_features(
    key: str,
    task: str,
    role: str,
    spec: Any,
    source: Any,
    family,
    features: Any,
    problems: list[Finding],
) -> None:
    """The input column, and for labelled sets the label column and the zero-shot class names."""
    columns = list(features)
    modality = getattr(family, "modality", "")
    if modality:
        default = "image" if modality == "image" else "text"
        column = (source.image_column if modality == "image" else source.text_column) or default
        if column not in columns:
            flag = "image_column" if modality == "image" else "text_column"
            problems.append(
                (
                    key,
                    f"{source.describe()} has no {modality} column {column!r} "
                    f"(has {columns}); set {key}.{flag}",
                )
            )
    if role == "calibration":
        return
    label = source.label_column or "label"
    if label not in columns:
        problems.append(
            (
                key,
                f"{source.describe()} has no label column {label!r} (has "
                f"{columns}); set {key}.label_column",
            )
        )
        return
    if spec.zero_shot:
        from featcal_core.evaluation.prompt_sets import zero_shot_prompts

        feature = features[label]
        try:
            zero_shot_prompts(
                getattr(feature, "names", None) or None,
                class_names=spec.class_names,
                templates=spec.templates,
                prompt_set=spec.prompt_set,
                key=f"tasks.{task}",
            )
        except FeatCalError as exc:
            problems.append(_own_key(f"tasks.{task}", str(exc)))


def _remembered(memo: dict, key: tuple, call):
    """`call()`'s value, or its exception raised again, once per `key` in `memo`."""
    if key not in memo:
        try:
            memo[key] = (call(), None)
        except Exception as exc:
            memo[key] = (None, exc)
    value, error = memo[key]
    if error is not None:
        raise error
    return value


def _hub_features(key: str, source: Any, problems: list[Finding], notes: Notes, memo: dict):
    """The features a Hub dataset's card lists for its config (no rows are downloaded), or None
    after recording a problem (no such dataset, config or split) or a note (offline, the Hub not
    answering, no features listed). `memo`: lookups already made, by dataset, config and
    revision (a task's calibration and evaluation often read one dataset)."""
    from featcal_core.data.source_rows import _datasets_offline

    if _datasets_offline():
        notes.skip(
            key,
            f"{source.describe()}: not checked offline (the run opens it from the datasets cache)",
            "offline",
        )
        return None
    from huggingface_hub import HfApi

    try:
        _remembered(
            memo,
            ("info", source.hub, source.revision),
            lambda: HfApi().dataset_info(source.hub, revision=source.revision),
        )
    except Exception as exc:
        if _unreachable(exc):
            notes.skip(
                key,
                f"Hub dataset {source.hub!r}: the Hub did not answer; not checked",
                "unreachable",
            )
            return None
        status = getattr(getattr(exc, "response", None), "status_code", None)
        what = "does not exist or is private" if status in (401, 404) else f"cannot be read ({exc})"
        problems.append(
            (
                key,
                f"Hub dataset {source.hub!r} {what}; check the id (owner/name) or "
                "log in (`hf auth login`)",
            )
        )
        return None
    import datasets

    pinned = {} if source.revision is None else {"revision": source.revision}
    try:
        builder = _remembered(
            memo,
            ("builder", source.hub, source.config, source.revision),
            lambda: datasets.load_dataset_builder(source.hub, source.config, **pinned),
        )
    except Exception as exc:
        message = " ".join(str(exc).split())
        if _unreachable(exc):
            notes.skip(
                key,
                f"{source.describe()}: the Hub did not answer; not checked "
                f"({type(exc).__name__}: {message[:160]})",
                "unreachable",
            )
        elif "config" in message.lower():
            problems.append(
                (
                    key + ".config",
                    f"{source.describe()}: {message[:300]}; set "
                    f"{key}.config to one of the dataset's configs",
                )
            )
        else:
            problems.append(
                (
                    key,
                    f"{source.describe()} cannot be resolved ({type(exc).__name__}: "
                    f"{message[:300]})",
                )
            )
        return None
    files = getattr(builder.config, "data_files", None) or {}
    splits = list(files) or list(builder.info.splits or {})
    if splits and source.split not in splits:
        problems.append(
            (
                key + ".split",
                f"{source.describe()} has no split {source.split!r} "
                f"(has {splits}); set {key}.split",
            )
        )
        return None
    if builder.info.features is None:
        notes.skip(
            key,
            f"{source.describe()}: the dataset card lists no features; columns are checked "
            "when the run loads it",
            "not read",
        )
        return None
    return builder.info.features
