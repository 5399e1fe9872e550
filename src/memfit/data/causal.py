"""Instruction data for causal-LM fine-tuning: prompt/completion pairs and chat conversations.

A file holds either a ``prompt`` and a ``completion`` column (names settable), or a ``messages`` list of
``{"role": ..., "content": ...}`` turns whose last turn is the assistant's answer: the completion, the turns
before it the prompt. Labelled classification data (text and label) becomes instruction pairs too: the text
with a question naming the labels as the prompt, the label's name as the completion.

When the completions are a small closed set (labels such as ``fresh``/``rotten``), :attr:`CausalExamples.labels`
holds each example's index into that set, and evaluation also scores accuracy: the completion with the highest
summed log-probability is the prediction.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

from memfit.data.examples import CausalExamples, Message, TextExamples
from memfit.data.files import read_rows
from memfit.errors import DataError

MAX_CLOSED_SET = 20
"""Completions form a closed set (and accuracy is scored) when there are at most this many distinct ones, each
seen at least twice on average."""


def is_causal_file(path: Path, *, prompt_column: str, completion_column: str, messages_column: str) -> bool:
    """Whether a CSV/JSONL file holds instruction data: its first row has a messages list or a prompt and a
    completion field."""
    first = first_row(path)
    return first is not None and (messages_column in first or (prompt_column in first and completion_column in first))


def first_row(path: Path) -> dict[str, Any] | None:
    try:
        with path.open(newline="", encoding="utf-8") as file:
            if path.suffix.lower() == ".csv":
                return next(csv.DictReader(file), None)
            for line in file:
                if line.strip():
                    row = json.loads(line)
                    return row if isinstance(row, dict) else None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None  # the table reader reports it, with the line
    return None


def load_instructions(path: Path, *, prompt_column: str, completion_column: str,
                      messages_column: str) -> CausalExamples:
    rows = read_rows(path)
    if not rows:
        raise DataError(f"--data {path}: the file holds no rows")
    if messages_column in rows[0]:
        return _conversations(path, rows, messages_column)
    columns = list(rows[0])
    missing = [(flag, name) for flag, name in (("--prompt-column", prompt_column),
                                               ("--completion-column", completion_column)) if name not in columns]
    if missing:
        raise DataError([f"--data {path}: no column {name!r} ({flag}) and no {messages_column!r} list; columns "
                         f"are: {', '.join(columns)}" for flag, name in missing])
    prompts, completions = [], []
    for number, row in enumerate(rows, start=1):
        prompt, completion = str(row.get(prompt_column) or ""), str(row.get(completion_column) or "")
        if not completion.strip():
            raise DataError(f"--data {path}: row {number} has an empty {completion_column!r}; every example needs "
                            "a completion to learn")
        prompts.append(prompt)
        completions.append(completion)
    return with_closed_set(prompts, completions, chat=False, templated=False)


def _conversations(path: Path, rows: list[dict[str, Any]], column: str) -> CausalExamples:
    prompts: list[list[Message]] = []
    completions: list[str] = []
    for number, row in enumerate(rows, start=1):
        turns = row.get(column)
        if not isinstance(turns, list) or not turns:
            raise DataError(f"--data {path}: row {number}: {column!r} is empty or not a list; write a list of "
                            '{"role": ..., "content": ...} turns ending with the assistant\'s answer')
        messages: list[Message] = []
        for turn in turns:
            if not (isinstance(turn, dict) and isinstance(turn.get("role"), str)
                    and isinstance(turn.get("content"), str)):
                raise DataError(f"--data {path}: row {number}: each turn needs a string 'role' and 'content' "
                                f"(got {json.dumps(turn)[:60]})")
            messages.append({"role": turn["role"], "content": turn["content"]})
        if messages[-1]["role"] != "assistant" or len(messages) < 2:
            raise DataError(f"--data {path}: row {number}: the last turn must be the assistant's answer, after at "
                            "least one turn before it (the prompt)")
        prompts.append(messages[:-1])
        completions.append(messages[-1]["content"])
    return with_closed_set(prompts, completions, chat=True, templated=True)


def with_closed_set(prompts: list[str] | list[list[Message]], completions: list[str], *, chat: bool,
                    templated: bool) -> CausalExamples:
    """Examples, with labels when the completions are a small closed set."""
    distinct = sorted(set(completions))
    closed = len(distinct) <= MAX_CLOSED_SET and len(distinct) * 2 <= len(completions)
    kept: list[Any] = list(prompts)
    return CausalExamples(prompts=kept, completions=list(completions), chat=chat, templated=templated,
                          label_names=distinct if closed else [],
                          labels=[distinct.index(text) for text in completions] if closed else [])


def as_instructions(examples: TextExamples, *, question: str | None = None) -> CausalExamples:
    """Labelled texts as instruction pairs: the text and a question naming the labels, the label as the answer.
    Templated as one user turn when the tokenizer has a chat template."""
    ask = question or f"Which of these labels fits the text: {', '.join(examples.label_names)}? Answer with the label."
    prompts = [f"{text}\n\n{ask}" for text in examples.texts]
    completions = [examples.label_names[label] for label in examples.labels]
    return CausalExamples(prompts=prompts, completions=completions, chat=False, templated=True,
                          label_names=list(examples.label_names), labels=list(examples.labels))
