"""`merge_checkpoints`: merge expert checkpoints into one, streaming tensor by tensor.

The output holds the base's tensor names with the same dtypes, in the base's files (and its index,
when it has one) where they fit `max_shard_size`, else split anew into shards with an index
(featcal_core.io.shards), plus the files a model carries, copied from the base (an allow-list,
featcal_core.io.export.carry_files: config.json, generation config, tokenizer, chat template and
processor files; not its README.md or .gitattributes), a `merge.json` record (method,
hyperparameters, featcal version; the base and each expert: folder, sha256 of each weight file,
and where it came from: a Hub model's id, revision and commit, or a local folder) and the merged
model's own card, `README.md` (featcal_core.provenance.merge_card). Experts are
checked against the base first: structure (featcal_core.io.structure) and vocabulary
(featcal_core.io.vocabulary). Tensors are merged one name at a time,
and a tensor larger than CHUNK_ENTRIES entries in row chunks: the method's `prepare` streams over
each expert's task vector chunk by chunk (TIES: its trim thresholds, which hold the magnitudes of
one task vector in float64), then each chunk of rows of the base and of every expert is read,
merged and written before the next one. Peak memory is a few float64 chunks per expert (plus, for
TIES and Breadcrumbs, one float64 copy of the largest tensor); no model, and no expert's large
tensor, is ever held whole (methods with `chunkable = False`, TSV-M and ISO, get whole tensors).

A method that asks for checkpoint-level statistics (`needs_checkpoint`: TIES with `trim: global`)
first gets one `prepare_checkpoint` call whose task-vector streams run over every merged tensor in
the same row chunks; a method with `takes_place` is told each tensor's name and each chunk's first
flat entry index (`Place`), with that checkpoint result.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch

from featcal_core.architectures import detect
from featcal_core.errors import FeatCalError
from featcal_core.io.adapters import open_expert
from featcal_core.io.checkpoint import INDEX_NAME, Checkpoint
from featcal_core.io.export import carry_files
from featcal_core.io.outputs import check_output, guarded_directory
from featcal_core.io.safetensors_io import DTYPES, Reader, SafetensorsFormatError
from featcal_core.io.shard_size import parse_shard_size
from featcal_core.io.shards import Layout, plan_layout, write_layout
from featcal_core.io.structure import check_fine_tune
from featcal_core.memory import peak_rss_bytes
from featcal_core.merging import get
from featcal_core.merging.base import MergeMethod, Place, as_compute
from featcal_core.names import check_names
from featcal_core.progress import stage_progress
from featcal_core.provenance.records import MERGE_RECORD
from featcal_core.version import featcal_version

log = logging.getLogger(__name__)

RECORD_NAME = MERGE_RECORD
RECORD_VERSION = 1
#: tensors with more entries are merged in row chunks of about this many entries (32 MiB float64)
CHUNK_ENTRIES = 1 << 22


def merge_checkpoints(
    base: str | Path,
    experts: Mapping[str, str | Path],
    out: str | Path,
    method: str,
    hyperparameters: dict[str, Any] | None = None,
    overwrite: bool = False,
    progress: bool = True,
    max_shard_size: int | str | None = None,
    base_source: Mapping[str, Any] | None = None,
    expert_sources: Mapping[str, Mapping[str, Any]] | None = None,
) -> dict:
    """Merge `experts` (task → save_pretrained dir, or peft LoRA adapter folder over `base`:
    featcal_core.io.adapters) of `base` with `method`; write `out`, in weight files of at most
    `max_shard_size` (bytes, or "5GB"-style; None: transformers' default, featcal_core.io.shards).
    `base_source` and `expert_sources` (task → ...): where a folder came from, when it is a Hub
    snapshot (`ResolvedModel.source()`: kind, reference, repo_id, revision, commit); a folder
    without one is recorded as local.

    Every expert must have the base's structure (featcal_core.io.structure: config and tensor
    names) and vocabulary (featcal_core.io.vocabulary: vocab size, tokenizer, added tokens) and
    hold the base's tensors with the same shapes. Floating-point
    tensors are merged (computed in float64, stored in the base tensor's dtype); other tensors are
    copied from the base. Returns the record also written to `out`/merge.json. Raises
    FeatCalError on bad input, leaving no partial output and an existing `out` as it was.
    """
    started = time.perf_counter()
    out = Path(out)
    merger = get(method)
    hp = merger.check(hyperparameters)
    shard_bytes = parse_shard_size(max_shard_size)
    if not experts:
        raise FeatCalError("no experts to merge: pass at least one --expert TASK=DIR")
    check_names(experts, "--expert")
    inputs = (base, *experts.values())
    check_output(out, overwrite=overwrite, inputs=inputs)
    base_ckpt = Checkpoint(base, "base model")
    expert_ckpts = {
        task: open_expert(path, f"expert {task!r}", base_ckpt) for task, path in experts.items()
    }
    for expert in expert_ckpts.values():
        check_fine_tune(base_ckpt, expert)
    _warn_without_tokenizer(base_ckpt)
    key_maps = {task: _key_map(base_ckpt, c) for task, c in expert_ckpts.items()}
    log.info(
        "merging %d experts into %s with %s %s (%d tensors)",
        len(expert_ckpts),
        out,
        merger.name,
        hp,
        len(base_ckpt.tensors),
    )

    with guarded_directory(out, overwrite=overwrite, inputs=inputs) as tmp:
        layout = plan_layout(base_ckpt, shard_bytes)
        counts = _write_weights(
            merger, hp, base_ckpt, expert_ckpts, key_maps, tmp, progress, layout
        )
        _copy_other_files(base_ckpt, tmp)
        sources = expert_sources or {}
        record = {
            "merge_record_version": RECORD_VERSION,
            "featcal_version": featcal_version(),
            "method": merger.name,
            "hyperparameters": hp,
            "max_shard_size": shard_bytes,
            "inputs": {
                "base": _described(base_ckpt, base_source),
                "experts": {
                    task: _described(c, sources.get(task)) for task, c in expert_ckpts.items()
                },
            },
            "tensors": counts,
            "wall_seconds": round(time.perf_counter() - started, 3),
            "peak_rss_bytes": peak_rss_bytes(),
        }
        (tmp / RECORD_NAME).write_text(json.dumps(record, indent=2) + "\n")
        _write_card(record, base_ckpt, out.name, tmp)
    log.info("wrote %s in %.1f s", out, record["wall_seconds"])
    return record


def _described(checkpoint: Checkpoint, source: Mapping[str, Any] | None) -> dict[str, Any]:
    """How the record names an input: its folder and weight files' sha256
    (`Checkpoint.describe`), and where it came from: a Hub snapshot's kind, reference, repo_id,
    revision and commit (`source`), else {"kind": "local"}."""
    origin = {"kind": "local"} if source is None or source.get("kind") != "hub" else source
    return {**checkpoint.describe(), **{k: v for k, v in origin.items() if k != "path"}}


def _write_card(record: dict, base: Checkpoint, name: str, out_dir: Path) -> None:
    """The merged model's own card (README.md; featcal_core.provenance.merge_card) into
    `out_dir`, a folder to be called `name`."""
    from featcal_core.provenance.merge_card import merge_card
    from featcal_core.provenance.model_card import CARD_NAME

    try:
        architecture: str | None = detect(base.config, str(base.directory / "config.json")).name
    except FeatCalError:
        architecture = None
    text = merge_card(record, base.config, name, architecture)
    (out_dir / CARD_NAME).write_text(text, encoding="utf-8")


def _warn_without_tokenizer(base: Checkpoint) -> None:
    """One warning when the base reads text (a text model, or a CLIP with its text tower) and its
    folder holds no tokenizer files: the merged model is written without one too."""
    from featcal_core.architectures.base import has_tokenizer

    try:
        reads_text = detect(base.config).modality == "text" or "text_config" in base.config
    except FeatCalError:  # a family featcal merges but does not calibrate
        return
    if reads_text and not has_tokenizer(base.directory):
        log.warning(
            "base model %s has no tokenizer files: the merged model is written without them, "
            "and calibrate and evaluate refuse it; save the base's tokenizer into its folder "
            "with tokenizer.save_pretrained",
            base.directory,
        )


def _is_float(dtype: str) -> bool:
    return DTYPES[dtype].is_floating_point


def _key_map(base: Checkpoint, expert: Checkpoint) -> dict[str, str | None]:
    """For each base tensor, the expert tensor it merges with (None: copy the base's).

    When the base's architecture is known (featcal_core.architectures), the tower's tensors are
    matched by canonical name through each checkpoint's own key prefix, so a CLIPModel base merges
    with CLIPVisionModel experts (transformers 4.x or 5.x layout) and a BertModel base with
    BertForSequenceClassification experts; base tensors outside the tower that the expert lacks
    (a text tower, a pooler) are copied from the base, and expert tensors outside the base's layout
    (task heads) are ignored, and so are non-float buffers the expert lacks (e.g. BERT's
    `position_ids`, which older checkpoints store and newer ones do not): copied from the base.
    Otherwise the names must agree exactly.
    """
    try:
        arch = detect(base.config, str(base.directory / "config.json"))
    except FeatCalError:
        arch = None
    if arch is None:
        return _exact_key_map(base, expert)
    base_prefix = arch.resolve_prefix(base)
    expert_prefix = arch.resolve_prefix(expert)
    mapping: dict[str, str | None] = {}
    for name in base.tensors:
        if not name.startswith(base_prefix):
            mapping[name] = name if name in expert.tensors else None
            continue
        canonical = name[len(base_prefix) :]
        other = expert_prefix + canonical
        if other in expert.tensors:
            mapping[name] = other
        elif arch.owns(canonical) and _is_float(base.tensors[name].dtype):
            raise FeatCalError(
                f"tensor {other!r} (the base's {name!r}) is missing from {expert.role} "
                f"{expert.directory}; an expert must be a fine-tune of the base with the same "
                "architecture"
            )
        else:
            mapping[name] = None
    tower = {other for other in mapping.values() if other is not None}
    extra = [
        n
        for n in expert.tensors
        if n.startswith(expert_prefix) and arch.owns(n[len(expert_prefix) :]) and n not in tower
    ]
    if extra:
        raise FeatCalError(
            f"{expert.role} {expert.directory} has tower tensor {extra[0]!r} that the base model "
            f"{base.directory} lacks; an expert must be a fine-tune of the base with the same "
            "architecture"
        )
    _check_pairs(base, expert, mapping)
    return mapping


def _exact_key_map(base: Checkpoint, expert: Checkpoint) -> dict[str, str | None]:
    """Identity mapping; `expert` must have exactly the base's tensor names."""
    missing = [name for name in base.tensors if name not in expert.tensors]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise FeatCalError(
            f"tensor {missing[0]!r}{more} of the base model {base.directory} is missing from "
            f"{expert.role} {expert.directory}; an expert must be a fine-tune of the base with "
            "the same architecture"
        )
    extra = [name for name in expert.tensors if name not in base.tensors]
    if extra:
        more = f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""
        raise FeatCalError(
            f"{expert.role} {expert.directory} has tensor {extra[0]!r}{more} that the base model "
            f"{base.directory} lacks; an expert must be a fine-tune of the base with the same "
            "architecture"
        )
    mapping: dict[str, str | None] = {name: name for name in base.tensors}
    _check_pairs(base, expert, mapping)
    return mapping


def _check_pairs(base: Checkpoint, expert: Checkpoint, mapping: dict[str, str | None]) -> None:
    """Matched tensors have the same shape and the same (float or not) dtype kind."""
    for name, other_name in mapping.items():
        if other_name is None:
            continue
        info, other = base.tensors[name], expert.tensors[other_name]
        if other.shape != info.shape:
            raise FeatCalError(
                f"tensor {other_name!r} has shape {list(other.shape)} in {expert.role} "
                f"{expert.directory} but {list(info.shape)} in the base model {base.directory}; "
                "merge only fine-tunes of the same base"
            )
        if _is_float(other.dtype) != _is_float(info.dtype):
            raise FeatCalError(
                f"tensor {other_name!r} has dtype {other.dtype} in {expert.role} "
                f"{expert.directory} but {info.dtype} in the base model {base.directory}; "
                "re-save the expert"
            )


def _check_finite(tensor: torch.Tensor, name: str, where: str) -> None:
    if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
        raise FeatCalError(f"tensor {name!r} {where} contains NaN or Inf; {_fix(where)}")


def _fix(where: str) -> str:
    if where.startswith("in the merge"):
        return "lower --scale or check the inputs"
    return "fix or re-create that checkpoint"


def _row_spans(shape: tuple[int, ...]) -> list[tuple[int, int]] | None:
    """Row chunks [start, stop) of about CHUNK_ENTRIES entries; None: small enough to read whole."""
    numel = math.prod(shape)
    if not shape or numel <= CHUNK_ENTRIES:
        return None
    step = max(1, CHUNK_ENTRIES // (numel // shape[0] or 1))
    return [(a, min(a + step, shape[0])) for a in range(0, shape[0], step)]


def _place(merger: MergeMethod, name: str, offset: int, checkpoint: Any) -> dict[str, Place]:
    """The `place` keyword for a method that takes one, else no keyword."""
    return {"place": Place(name, offset, checkpoint)} if merger.takes_place else {}


class _Readers:
    """Open shard readers of several checkpoints, opened on first use and closed together."""

    def __init__(self, stack: ExitStack):
        self._stack = stack
        self._open: dict[tuple[int, str], Reader] = {}

    def read(
        self, checkpoint: Checkpoint, name: str, rows: tuple[int, int] | None = None
    ) -> torch.Tensor:
        """Tensor `name` of `checkpoint`, or only its rows [start, stop) when `rows` is given."""
        file = checkpoint.tensors[name].file
        key = (id(checkpoint), file)
        try:
            if key not in self._open:
                self._open[key] = self._stack.enter_context(checkpoint.reader(file))
            reader = self._open[key]
            tensor = reader[name] if rows is None else reader.rows(name, *rows)
        except (OSError, SafetensorsFormatError) as exc:
            raise FeatCalError(
                f"cannot read tensor {name!r} from {checkpoint.directory / file} ({exc}); "
                f"re-save the {checkpoint.role}"
            ) from exc
        _check_finite(tensor, name, f"in {checkpoint.role} {checkpoint.directory}")
        return tensor


def _write_weights(
    merger: MergeMethod,
    hp: dict[str, Any],
    base: Checkpoint,
    experts: dict[str, Checkpoint],
    key_maps: dict[str, dict[str, str | None]],
    out_dir: Path,
    progress: bool,
    layout: Layout,
) -> dict[str, int]:
    """Write the files of `layout` (the base's tensors) into `out_dir`; returns merged/copied
    counts."""
    counts = {"merged": 0, "copied": 0}
    bar = stage_progress(total=len(base.tensors), desc="merge", unit="tensor", enabled=progress)
    with ExitStack() as stack:
        stack.callback(bar.close)
        readers = _Readers(stack)

        def cast(merged: torch.Tensor, name: str, shape: tuple[int, ...], dtype: str):
            if tuple(merged.shape) != shape:
                raise FeatCalError(
                    f"merge method {merger.name!r} returned shape {list(merged.shape)} for "
                    f"{name!r} (expected {list(shape)}); this is a bug in the method"
                )
            _check_finite(merged, name, f"in the merge ({merger.name}, {hp})")
            result = merged.to(DTYPES[dtype])
            _check_finite(result, name, f"in the merge ({merger.name}, {hp}) cast to {dtype}")
            return result

        def pairs_of(name: str) -> list[tuple[Checkpoint, str]] | None:
            """(expert, its tensor name) per expert when `name` is merged; None: copied."""
            others = [key_maps[task][name] for task in experts]
            found = [o for o in others if o is not None]
            if not _is_float(base.tensors[name].dtype) or len(found) < len(others):
                return None
            return list(zip(experts.values(), found, strict=True))

        def task_vector_chunks(
            name: str, t: int, spans: list[tuple[int, int]] | None
        ) -> Iterator[torch.Tensor]:
            """Expert t's τ_t of tensor `name` in float64, whole or in the given row spans."""
            pairs = pairs_of(name)
            assert pairs is not None  # only merged tensors have task vectors
            expert, other = pairs[t]
            each: Sequence[tuple[int, int] | None] = spans or [None]
            for span in each:
                theta0 = as_compute(readers.read(base, name, span))
                yield as_compute(readers.read(expert, other, span)).sub_(theta0)

        checkpoint = None
        if merger.needs_checkpoint(hp):
            merged_names = [
                n for shard in base.files for n in base.entries[shard] if pairs_of(n) is not None
            ]
            total = sum(math.prod(base.tensors[n].shape) for n in merged_names)
            log.info(
                "%s: checkpoint pass over %d merged tensors (%d entries per expert)",
                merger.name,
                len(merged_names),
                total,
            )

            def checkpoint_vector(t: int) -> Iterator[torch.Tensor]:
                for n in merged_names:
                    yield from task_vector_chunks(n, t, _row_spans(base.tensors[n].shape))

            checkpoint = merger.prepare_checkpoint(checkpoint_vector, len(experts), total, hp)

        def fetch(name: str) -> torch.Tensor | Iterator[torch.Tensor]:
            info = base.tensors[name]
            pairs = pairs_of(name)
            if pairs is None:
                counts["copied"] += 1
                bar.update(1)
                return readers.read(base, name)
            counts["merged"] += 1
            numel = math.prod(info.shape)
            spans = _row_spans(info.shape) if merger.chunkable else None
            if spans is None:
                theta0 = readers.read(base, name)
                thetas = [readers.read(expert, other) for expert, other in pairs]
                place = _place(merger, name, 0, checkpoint)
                result = cast(
                    merger.merge_tensor(theta0, thetas, hp, **place), name, info.shape, info.dtype
                )
                bar.update(1)
                return result
            row = numel // info.shape[0]

            def task_vector(t: int) -> Iterator[torch.Tensor]:
                return task_vector_chunks(name, t, spans)

            def chunks() -> Iterator[torch.Tensor]:
                place = _place(merger, name, 0, checkpoint)
                prepared = merger.prepare(task_vector, len(pairs), numel, hp, **place)
                for span in spans:
                    theta0 = readers.read(base, name, span)
                    thetas = [readers.read(expert, other, span) for expert, other in pairs]
                    shape = (span[1] - span[0], *info.shape[1:])
                    place = _place(merger, name, span[0] * row, checkpoint)
                    merged = merger.merge_chunk(theta0, thetas, hp, prepared, **place)
                    del thetas
                    yield cast(merged, name, shape, info.dtype)
                bar.update(1)

            return chunks()

        write_layout(layout, out_dir, fetch)
    return counts


def _copy_other_files(base: Checkpoint, out_dir: Path) -> None:
    """Copy the files a model carries from the base (`carry_files`' allow-list); name the rest."""
    left_out = carry_files(base.directory, out_dir)
    weights = set(base.files) | {INDEX_NAME}
    left_out = [name for name in left_out if name not in weights]
    if left_out:  # a Hub snapshot's card and repository files, other weight formats, records
        log.info(
            "not copied from the base %s into the merged model: %s (a merged model carries its "
            "config, generation config, tokenizer, chat template and processor files only)",
            base.directory,
            ", ".join(left_out),
        )
