"""Instruction data for causal-LM fine-tuning: prompt/completion pairs, Alpaca rows and chat conversations.

A table holds a ``prompt`` and a ``completion`` column (names settable), Alpaca's ``instruction``/``input``/
``output``, or a conversation: ``messages`` of ``{"role": ..., "content": ...}`` turns or ShareGPT's
``conversations`` of ``{"from": ..., "value": ...}`` turns, whose last turn is the assistant's answer: the
completion, the turns before it the prompt (:mod:`memfit.data.formats` recognises which). Labelled
classification data (text and label) becomes instruction pairs too: the text
with a question naming the labels as the prompt, the label's name as the completion.

When the completions are a small closed set (labels such as ``fresh``/``rotten``), :attr:`CausalExamples.labels`
holds each example's index into that set, and evaluation also scores accuracy: the completion with the highest
summed log-probability is the prediction.
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from memfit.data.examples import CausalExamples, Message, TextExamples
from memfit.data.formats import SHAREGPT_COLUMN
from memfit.errors import DataError

if TYPE_CHECKING:
    from memfit.data import Columns

MAX_CLOSED_SET = 20
"""Completions form a closed set (and accuracy is scored) when there are at most this many distinct ones, each
seen at least twice on average."""


SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "system": "system", "chatgpt": "assistant", "bing": "assistant", "bard": "assistant"}
"""ShareGPT's speaker names as chat roles (``from`` values seen in published ShareGPT-style datasets)."""


def instructions_from_rows(data: str, rows: list[dict[str, Any]], data_format: str,
                           columns: Columns) -> CausalExamples:
    """Instruction pairs from the rows of a table in one of :data:`memfit.data.formats.INSTRUCTION_FORMATS`."""
    if data_format == "alpaca":
        return _alpaca(data, rows)
    if data_format in ("messages", "sharegpt"):
        column = columns.messages if isinstance(rows[0].get(columns.messages), list) else SHAREGPT_COLUMN
        examples = _conversations(data, rows, column)
    else:
        examples = _pairs(data, rows, columns.prompt, columns.completion)
    return replace(examples, source_format=data_format)


def _pairs(data: str, rows: list[dict[str, Any]], prompt_column: str, completion_column: str) -> CausalExamples:
    prompts, completions = [], []
    for number, row in enumerate(rows, start=1):
        prompt, completion = str(row.get(prompt_column) or ""), str(row.get(completion_column) or "")
        if not completion.strip():
            raise DataError(f"--data {data}: row {number} has an empty {completion_column!r}; every example needs "
                            "a completion to learn")
        prompts.append(prompt)
        completions.append(completion)
    return with_closed_set(prompts, completions, chat=False, templated=False)


def _alpaca(data: str, rows: list[dict[str, Any]]) -> CausalExamples:
    """Alpaca's instruction and optional input as one user turn (templated when the tokenizer has a chat
    template), its output as the completion."""
    prompts, completions = [], []
    for number, row in enumerate(rows, start=1):
        instruction, extra = str(row.get("instruction") or "").strip(), str(row.get("input") or "").strip()
        output = str(row.get("output") or "")
        if not instruction or not output.strip():
            raise DataError(f"--data {data}: row {number} has an empty 'instruction' or 'output'; every Alpaca "
                            "example needs both")
        prompts.append(f"{instruction}\n\n{extra}" if extra else instruction)
        completions.append(output)
    return replace(with_closed_set(prompts, completions, chat=False, templated=True), source_format="alpaca")


def _conversations(data: str, rows: list[dict[str, Any]], column: str) -> CausalExamples:
    prompts: list[list[Message]] = []
    completions: list[str] = []
    for number, row in enumerate(rows, start=1):
        turns = row.get(column)
        if not isinstance(turns, list) or not turns:
            raise DataError(f"--data {data}: row {number}: {column!r} is empty or not a list; write a list of "
                            '{"role": ..., "content": ...} turns ending with the assistant\'s answer')
        messages = [_turn(data, number, turn) for turn in turns]
        while messages and messages[-1]["role"] != "assistant":  # turns after the last answer teach nothing
            messages.pop()
        if len(messages) < 2:
            raise DataError(f"--data {data}: row {number}: the last turn must be the assistant's answer, after at "
                            "least one turn before it (the prompt)")
        prompts.append(messages[:-1])
        completions.append(messages[-1]["content"])
    return with_closed_set(prompts, completions, chat=True, templated=True)


def _turn(data: str, number: int, turn: Any) -> Message:
    """A chat turn from ``{"role", "content"}`` or ShareGPT's ``{"from", "value"}``."""
    if isinstance(turn, dict) and isinstance(turn.get("role"), str) and isinstance(turn.get("content"), str):
        return {"role": turn["role"], "content": turn["content"]}
    if isinstance(turn, dict) and isinstance(turn.get("from"), str) and isinstance(turn.get("value"), str):
        role = SHAREGPT_ROLES.get(turn["from"].lower())
        if role is None:
            raise DataError(f"--data {data}: row {number}: unknown speaker {turn['from']!r} (known: "
                            f"{', '.join(SHAREGPT_ROLES)})")
        return {"role": role, "content": turn["value"]}
    raise DataError(f"--data {data}: row {number}: each turn needs a string 'role' and 'content' (or ShareGPT's "
                    f"'from' and 'value') (got {json.dumps(turn)[:60]})")


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
