"""Whether a checkpoint reads the base's token ids: `check_same_vocabulary`.

A merge or a calibration feeds every model the base's token ids (the output carries the base's
tokenizer), so an expert whose ids mean other tokens is refused, in one line naming the expert
and what differs:

- `vocab_size` in config.json (and in a nested `text_config`), where both configs have it;
- tokenizer.json's vocabulary: the digest of its `model` (vocabulary, merges), `normalizer` and
  `pre_tokenizer`, where both folders have a tokenizer.json (merges compared in either of the
  formats `tokenizers` writes); a slow tokenizer's vocabulary files (vocab.json, vocab.txt,
  merges.txt, SentencePiece models) by content, where both have the file;
- the added tokens (id → text), from the first source both folders have: tokenizer.json (the
  tokens beyond its vocabulary; a token of the vocabulary registered as added or not is the same
  id), added_tokens.json (tokens beyond the vocabulary), tokenizer_config.json's
  `added_tokens_decoder` (which lists the vocabulary's special tokens too: only an id that names
  two different texts differs).

What only changes how text is framed is logged as a warning (the output carries the base's): the
special tokens (tokenizer_config.json, special_tokens_map.json, the added tokens' `special`
flags) and the chat template (chat_template.jinja, chat_template.json, tokenizer_config.json's
`chat_template`, additional_chat_templates/), where the checkpoint has them. A checkpoint saved
without tokenizer files is compared on its config only.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from featcal_core.errors import FeatCalError

log = logging.getLogger(__name__)

TOKENIZER_JSON = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
SPECIAL_TOKENS_MAP = "special_tokens_map.json"
ADDED_TOKENS = "added_tokens.json"
#: a slow tokenizer's vocabulary files, compared by content
VOCAB_FILES = (
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "tokenizer.model",
    "spiece.model",
    "spm.model",
    "sentencepiece.bpe.model",
)
#: tokenizer_config.json / special_tokens_map.json keys naming special tokens
SPECIAL_KEYS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
    "additional_special_tokens",
    "extra_special_tokens",
)
#: tokenizer.json sections that decide which ids a text becomes
_VOCABULARY_SECTIONS = ("model", "normalizer", "pre_tokenizer")
#: every file whose presence means the folder was saved with its tokenizer
TOKENIZER_FILES = (
    TOKENIZER_JSON,
    TOKENIZER_CONFIG,
    SPECIAL_TOKENS_MAP,
    ADDED_TOKENS,
    *VOCAB_FILES,
)
_FIX = (
    "its token ids would mean other tokens than the base's; pass an expert fine-tuned from this "
    "base with the base's tokenizer (same vocabulary and added tokens)"
)


class Saved(Protocol):
    """A saved model's folder as read here: a Checkpoint, or a Hub snapshot holding only its
    config.json and tokenizer files (`featcal check`)."""

    directory: Path
    config: dict
    role: str


@dataclass(frozen=True)
class AddedTokens:
    """Added tokens of one source: `tokens` (id → text) compared, whole (`complete`) or only on
    the ids both sides list; `special`: every registered token's (text, special flag)."""

    tokens: dict[int, str]
    complete: bool
    special: dict[int, tuple[str, bool]]


@dataclass
class Vocabulary:
    """What fixes a folder's token ids (`sizes`, `tokenizer`, `files`, `added`) and what only
    frames text (`special`, `templates`)."""

    sizes: dict[str, int] = field(default_factory=dict)  # "vocab_size" (config.json) → value
    tokenizer: tuple[str, int] | None = None  # tokenizer.json: (vocabulary digest, tokens)
    files: dict[str, str] = field(default_factory=dict)  # vocabulary file → content digest
    added: dict[str, AddedTokens] = field(default_factory=dict)  # source → its added tokens
    special: dict[str, Any] = field(default_factory=dict)  # role → token text(s)
    templates: dict[str, str] = field(default_factory=dict)  # template name → text
    saved: bool = False  # the folder holds tokenizer files


def check_same_vocabulary(base: Saved, other: Saved, role: str | None = None) -> None:
    """Refuse `other` (an expert or merged model; `role` names it, default `other.role`) when
    its token ids are not the base's; warn when its special tokens or chat template differ."""
    role = role or other.role
    mine, theirs = read_vocabulary(base), read_vocabulary(other)
    where = f"{role} {other.directory}"
    for key, value in mine.sizes.items():
        if key in theirs.sizes and theirs.sizes[key] != value:
            raise FeatCalError(
                f"{where}: {key} is {theirs.sizes[key]} in its config.json, the base's "
                f"({base.directory}) is {value}; {_FIX}"
            )
    if mine.tokenizer and theirs.tokenizer and mine.tokenizer[0] != theirs.tokenizer[0]:
        raise FeatCalError(
            f"{where}: its {TOKENIZER_JSON} vocabulary differs from the base's ({base.directory}):"
            f" sha256 {theirs.tokenizer[0][:12]}, {theirs.tokenizer[1]} tokens; the base's "
            f"{mine.tokenizer[0][:12]}, {mine.tokenizer[1]} tokens; {_FIX}"
        )
    for name, digest in mine.files.items():
        if name in theirs.files and theirs.files[name] != digest:
            raise FeatCalError(
                f"{where}: its {name} differs from the base's ({base.directory}): sha256 "
                f"{theirs.files[name][:12]}, the base's {digest[:12]}; {_FIX}"
            )
    source = next((s for s in mine.added if s in theirs.added), None)
    if source is not None:
        ours, yours = mine.added[source], theirs.added[source]
        shared = ours.tokens.keys() & yours.tokens.keys()
        differ = _first_difference(
            ours.tokens if ours.complete else {i: ours.tokens[i] for i in shared},
            yours.tokens if ours.complete else {i: yours.tokens[i] for i in shared},
        )
        if differ is not None:
            raise FeatCalError(
                f"{where}: its added tokens ({source}) differ from the base's ({base.directory}): "
                f"{differ}; {_FIX}"
            )
        ours_flags, yours_flags = ours.special, yours.special
        flags = {
            i
            for i in ours_flags.keys() & yours_flags.keys()
            if ours_flags[i] != yours_flags[i] and ours_flags[i][0] == yours_flags[i][0]
        }
        if flags:
            first = min(flags)
            log.warning(
                "%s: added token %d %r is %sspecial there, %sspecial in the base %s; the output "
                "carries the base's tokenizer",
                where,
                first,
                ours_flags[first][0],
                "" if yours_flags[first][1] else "not ",
                "" if ours_flags[first][1] else "not ",
                base.directory,
            )
    if theirs.saved:
        _warn_framing(base, mine, theirs, where)


def _warn_framing(base: Saved, mine: Vocabulary, theirs: Vocabulary, where: str) -> None:
    """A warning per kind: special tokens, chat template."""
    roles = sorted(mine.special.keys() | theirs.special.keys())
    differ = [r for r in roles if mine.special.get(r) != theirs.special.get(r)]
    if theirs.special and differ:
        role = differ[0]
        log.warning(
            "%s: its special tokens differ from the base's %s (%s is %r there, %r in the base%s); "
            "the output carries the base's tokenizer and special tokens",
            where,
            base.directory,
            role,
            theirs.special.get(role),
            mine.special.get(role),
            f"; {len(differ) - 1} more" if len(differ) > 1 else "",
        )
    if theirs.templates and theirs.templates != mine.templates:
        names = sorted(n for n in mine.templates.keys() | theirs.templates.keys())
        changed = [n for n in names if mine.templates.get(n) != theirs.templates.get(n)]
        log.warning(
            "%s: its chat template (%s) differs from the base's %s; the output carries the "
            "base's chat template",
            where,
            ", ".join(changed),
            base.directory,
        )


def _first_difference(base: dict[int, str], other: dict[int, str]) -> str | None:
    for token_id in sorted(base.keys() | other.keys()):
        if base.get(token_id) != other.get(token_id):
            if token_id not in other:
                return f"id {token_id} is {base[token_id]!r} in the base, absent there"
            if token_id not in base:
                return f"id {token_id} is {other[token_id]!r} there, absent in the base"
            return f"id {token_id} is {other[token_id]!r} there, {base[token_id]!r} in the base"
    return None


# ----------------------------------------------------------------------------------- reading


def read_vocabulary(checkpoint: Saved) -> Vocabulary:
    """The vocabulary of `checkpoint`'s config and of the tokenizer files in its folder."""
    directory = checkpoint.directory
    found = Vocabulary()
    config = checkpoint.config
    for key, inner in [("", config), ("text_config.", config.get("text_config"))]:
        if isinstance(inner, dict) and isinstance(inner.get("vocab_size"), int):
            found.sizes[f"{key}vocab_size"] = inner["vocab_size"]
    found.saved = any((directory / name).is_file() for name in TOKENIZER_FILES)
    if not found.saved:
        return found
    tokenizer = directory / TOKENIZER_JSON
    if tokenizer.is_file():
        digest, tokens, added = _tokenizer_json(*_stat(tokenizer))
        found.tokenizer = (digest, tokens)
        found.added[TOKENIZER_JSON] = added
    for name in VOCAB_FILES:
        if (directory / name).is_file():
            found.files[name] = _file_digest(name, *_stat(directory / name))
    settings = (
        _json(directory / TOKENIZER_CONFIG) if (directory / TOKENIZER_CONFIG).is_file() else {}
    )
    decoder = settings.get("added_tokens_decoder")
    if isinstance(decoder, dict):
        registered = {
            int(i): (str(_text(token)), bool(isinstance(token, dict) and token.get("special")))
            for i, token in decoder.items()
            if str(i).isdigit()
        }
        found.added[f"{TOKENIZER_CONFIG} added_tokens_decoder"] = AddedTokens(
            {i: text for i, (text, _) in registered.items()}, False, registered
        )
    if (directory / ADDED_TOKENS).is_file():
        listed = _json(directory / ADDED_TOKENS)
        beyond = {i: str(text) for text, i in listed.items() if isinstance(i, int)}
        found.added[ADDED_TOKENS] = AddedTokens(beyond, True, {})
    mapping = (
        _json(directory / SPECIAL_TOKENS_MAP) if (directory / SPECIAL_TOKENS_MAP).is_file() else {}
    )
    for source in (mapping, settings):
        for key in SPECIAL_KEYS:
            value = source.get(key)
            if value is not None and value != [] and value != {}:
                found.special[key] = _text(value)
    found.templates = _templates(directory, settings)
    return found


def _templates(directory: Path, settings: dict) -> dict[str, str]:
    """{name ("default" for the main one): template text} of every chat template found."""
    templates: dict[str, str] = {}
    given = settings.get("chat_template")
    if isinstance(given, str):
        templates["default"] = given
    elif isinstance(given, list):
        for entry in given:
            if isinstance(entry, dict) and isinstance(entry.get("template"), str):
                templates[str(entry.get("name", "default"))] = entry["template"]
    if (directory / "chat_template.json").is_file():
        text = _json(directory / "chat_template.json").get("chat_template")
        if isinstance(text, str):
            templates["default"] = text
    if (directory / "chat_template.jinja").is_file():
        templates["default"] = (directory / "chat_template.jinja").read_text(encoding="utf-8")
    extra = directory / "additional_chat_templates"
    if extra.is_dir():
        for path in sorted(extra.glob("*.jinja")):
            templates[path.stem] = path.read_text(encoding="utf-8")
    return templates


def _text(value: Any) -> Any:
    """A token as its text: an AddedToken's dict → its content; lists and maps item by item."""
    if isinstance(value, dict):
        if "content" in value:
            return str(value["content"])
        return {str(k): _text(v) for k, v in sorted(value.items())}
    if isinstance(value, list):
        return [_text(v) for v in value]
    return value


def _json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise FeatCalError(f"{path} is not valid JSON ({exc}); re-save the tokenizer") from exc
    if not isinstance(data, dict):
        raise FeatCalError(f"{path} is not a JSON object; re-save the tokenizer")
    return data


def _stat(path: Path) -> tuple[str, int, int]:
    """(the file it reads, mtime, size): the key the digests below are cached by (a changed file
    is re-read). The file is the symlink's target (a Hub cache's hash-named blob): what it holds
    is decided by the name in the folder, never by the target's."""
    info = path.stat()
    return str(path.resolve()), info.st_mtime_ns, info.st_size


@functools.lru_cache(maxsize=64)
def _tokenizer_json(path: str, mtime: int, size: int) -> tuple[str, int, AddedTokens]:
    """(digest of the vocabulary sections, number of tokens in the vocabulary, added tokens: those
    beyond the vocabulary compared whole)."""
    data = _json(Path(path))
    sections = {key: data.get(key) for key in _VOCABULARY_SECTIONS}
    model = sections.get("model")
    tokens = 0
    vocab: Any = None
    if isinstance(model, dict):
        model = dict(model)
        merges = model.get("merges")
        if isinstance(merges, list):  # "a b" (tokenizers < 0.20) or ["a", "b"]: the same merges
            model["merges"] = [m.split(" ", 1) if isinstance(m, str) else m for m in merges]
        vocab = model.get("vocab")
        tokens = len(vocab) if isinstance(vocab, dict | list) else 0
        sections["model"] = model
    canonical = json.dumps(sections, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    registered: dict[int, tuple[str, bool]] = {}
    for token in data.get("added_tokens") or []:
        if isinstance(token, dict) and isinstance(token.get("id"), int):
            registered[token["id"]] = (str(token.get("content")), bool(token.get("special")))
    beyond = {i: text for i, (text, _) in registered.items() if not _in_vocab(vocab, i, text)}
    digest = hashlib.sha256(canonical.encode()).hexdigest()
    return digest, tokens, AddedTokens(beyond, True, registered)


def _in_vocab(vocab: Any, token_id: int, text: str) -> bool:
    """The model's vocabulary (a map text → id, or Unigram's list of [text, score]) has `text`
    at `token_id`."""
    if isinstance(vocab, dict):
        return vocab.get(text) == token_id
    if isinstance(vocab, list) and 0 <= token_id < len(vocab):
        entry = vocab[token_id]
        return isinstance(entry, list | tuple) and bool(entry) and entry[0] == text
    return False


@functools.lru_cache(maxsize=64)
def _file_digest(name: str, path: str, mtime: int, size: int) -> str:
    """The content digest of the vocabulary file `name` (read from `path`, its symlink's target
    where it is one): JSON canonically, text line by line (line endings, trailing blank lines and
    merges.txt's `#version` header aside), anything else byte for byte."""
    raw = Path(path).read_bytes()
    if name.endswith(".json"):
        try:
            raw = json.dumps(json.loads(raw), sort_keys=True, ensure_ascii=False).encode()
        except (UnicodeDecodeError, json.JSONDecodeError):
            pass  # compared byte for byte
    elif name.endswith(".txt"):
        try:
            lines = raw.decode("utf-8").splitlines()
        except UnicodeDecodeError:
            lines = None
        if lines is not None:
            if name.endswith("merges.txt"):
                lines = [line for line in lines if not line.startswith("#version")]
            while lines and not lines[-1].strip():
                lines.pop()
            raw = "\n".join(lines).encode()
    return hashlib.sha256(raw).hexdigest()
