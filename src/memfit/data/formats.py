"""The shapes a table of examples comes in, recognised from its columns without flags.

=================  ===============================================  ==============================================
format             columns (first row)                              becomes
=================  ===============================================  ==============================================
alpaca             ``instruction``, ``output`` (``input`` optional)  prompt: the instruction, a blank line and the
                                                                    input when there is one; completion: output
sharegpt           ``conversations``: turns ``{"from", "value"}``,   a chat; the last ``gpt`` turn is the answer
                   roles ``human``/``gpt``/``system``
messages           ``messages``: turns ``{"role", "content"}``       a chat; the last assistant turn is the answer
prompt-completion  ``prompt``, ``completion``                       a prompt and the completion to learn
text-label         ``text``, ``label``                              classification (for a causal LM, instruction
                                                                    pairs asking for the label)
=================  ===============================================  ==============================================

The column names of the last three follow ``--messages-column``, ``--prompt-column``/``--completion-column`` and
``--text-column``/``--label-column``. A table that fits two instruction formats is ambiguous: memfit names the
columns it found and asks for ``--data-format``, which also forces a format when the columns are unusual.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from memfit.errors import DataError
from memfit.names import DATA_FORMATS

if TYPE_CHECKING:
    from memfit.data import Columns

INSTRUCTION_FORMATS = ("alpaca", "sharegpt", "messages", "prompt-completion")
SHAREGPT_COLUMN = "conversations"
assert DATA_FORMATS == ("auto", *INSTRUCTION_FORMATS, "text-label")
DESCRIPTIONS = {
    "alpaca": "Alpaca (instruction/input/output)",
    "sharegpt": "ShareGPT (conversations of from/value turns)",
    "messages": "chat messages (role/content turns)",
    "prompt-completion": "prompt/completion",
    "text-label": "text/label",
}


def matching_formats(row: dict[str, Any], columns: Columns) -> list[str]:
    """Every format whose columns ``row`` has, instruction formats first."""
    found = []
    if "instruction" in row and "output" in row:
        found.append("alpaca")
    conversation = row.get(SHAREGPT_COLUMN)
    if isinstance(conversation, list) and columns.messages != SHAREGPT_COLUMN:
        found.append("sharegpt")
    if isinstance(row.get(columns.messages), list):
        found.append("sharegpt" if _sharegpt_turns(row[columns.messages]) else "messages")
    if columns.prompt in row and columns.completion in row:
        found.append("prompt-completion")
    if columns.text in row and columns.label in row:
        found.append("text-label")
    return list(dict.fromkeys(found))


def _sharegpt_turns(turns: list[Any]) -> bool:
    return bool(turns) and isinstance(turns[0], dict) and "from" in turns[0] and "value" in turns[0]


def instruction_format(data: str, rows: list[dict[str, Any]], columns: Columns, chosen: str = "auto") -> str | None:
    """The instruction format of a table: ``chosen`` when set (its columns checked), else the one its first row
    fits; ``None`` when it fits none (labelled data, or unknown columns); one line when it fits several."""
    if not rows:
        raise DataError(f"--data {data}: the table holds no rows")
    found = matching_formats(rows[0], columns)
    if chosen != "auto":
        if chosen not in found:
            raise DataError(f"--data {data}: --data-format {chosen} needs {DESCRIPTIONS[chosen]} columns; "
                            f"{found_columns(rows[0])}")
        return chosen if chosen in INSTRUCTION_FORMATS else None
    instructions = [name for name in found if name in INSTRUCTION_FORMATS]
    if len(instructions) > 1:
        raise DataError(f"--data {data}: the columns fit {' and '.join(DESCRIPTIONS[n] for n in instructions)}; "
                        f"{found_columns(rows[0])}; choose one with --data-format "
                        f"({', '.join(INSTRUCTION_FORMATS)})")
    return instructions[0] if instructions else None


def found_columns(row: dict[str, Any]) -> str:
    return f"columns found: {', '.join(map(str, row)) or 'none'}"


def unrecognised(data: str, row: dict[str, Any], columns: Columns) -> DataError:
    """No instruction format and no text/label columns: the half of a pair that is missing, or what was found
    and the flags that name the columns."""
    for pair in ((("--prompt-column", columns.prompt), ("--completion-column", columns.completion)),
                 (("--text-column", columns.text), ("--label-column", columns.label))):
        missing = [(flag, name) for flag, name in pair if name not in row]
        if len(missing) == 1:
            flag, name = missing[0]
            return DataError(f"--data {data}: no column {name!r} ({flag}); {found_columns(row)}")
    known = "; ".join(f"{DESCRIPTIONS[name]}" for name in INSTRUCTION_FORMATS)
    return DataError(f"--data {data}: no known format in its {found_columns(row)} (known: {known}); name the "
                     "columns with --prompt-column/--completion-column, --messages-column or "
                     "--text-column/--label-column")
