"""The options reference, ``docs/options.md``, generated from ``memfit``'s own argument parser.

One section per command; per argument group, a table of each flag with its metavar, its default and its help.
The default is the one the help shows in brackets (``[5e-05]``: most ``train`` options default to ``None`` in
the parser and take their value from :class:`~memfit.config.TrainConfig`), else the parser's own default.

Regenerate after changing a flag (``tests/unit/test_docs.py`` fails until the file matches)::

    python -m memfit.docs_reference            # writes docs/options.md
    python -m memfit.docs_reference --check    # exit 1 if docs/options.md is out of date
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from memfit.options import build_parser

OUTPUT = Path("docs/options.md")
COMMAND = "python -m memfit.docs_reference"
TRAILING_DEFAULT = re.compile(r"\s*\[([^\[\]]*)\]\s*$")
"""A help text's last bracketed part: the default as the help states it."""


@dataclass(frozen=True, slots=True)
class Option:
    """One row of the reference: what the user types, what follows it, its default and what it does."""

    flags: tuple[str, ...]
    metavar: str
    default: str
    help: str


def commands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """Each subcommand's parser by name, in the order the parser lists them."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def command_helps(parser: argparse.ArgumentParser) -> dict[str, str]:
    """Each subcommand's one-line help."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return {choice.dest: choice.help or "" for choice in action._choices_actions}
    return {}


def options_by_group(parser: argparse.ArgumentParser) -> Iterator[tuple[str, list[Option]]]:
    """(group title, its options) for every argument group with at least one documented option."""
    for group in parser._action_groups:
        options = [option_of(action, parser.prog) for action in group._group_actions
                   if not isinstance(action, argparse._HelpAction | argparse._SubParsersAction)]
        if options:
            yield group.title or "", options


def option_of(action: argparse.Action, prog: str) -> Option:
    help_text = expanded_help(action, prog)
    stated = TRAILING_DEFAULT.search(help_text)
    if stated is not None:
        help_text, default = help_text[:stated.start()], stated.group(1)
    else:
        default = "(required)" if action.required else parser_default(action)
    flags = tuple(action.option_strings) or (action.metavar if isinstance(action.metavar, str) else action.dest,)
    return Option(flags=flags, metavar=metavar_of(action), default=default, help=help_text.strip())


def expanded_help(action: argparse.Action, prog: str) -> str:
    """The help as ``--help`` prints it: ``%(default)s`` and the like filled in, ``%%`` as ``%``."""
    if not action.help or action.help is argparse.SUPPRESS:
        return ""
    params = {**vars(action), "prog": prog}
    return action.help % params


def parser_default(action: argparse.Action) -> str:
    if action.default is None or action.default is False or action.default is argparse.SUPPRESS:
        return ""
    if isinstance(action.default, list):
        return " ".join(str(item) for item in action.default)
    return str(action.default)


def metavar_of(action: argparse.Action) -> str:
    """What follows the flag on the command line, as ``--help`` shows it; empty for a switch."""
    if action.nargs == 0:
        return ""
    if not action.option_strings:
        return ""
    if isinstance(action.metavar, str):
        name = action.metavar
    elif action.choices is not None:
        name = "{" + ",".join(str(choice) for choice in action.choices) + "}"
    else:
        name = action.dest.upper()
    if action.nargs == "?":
        return f"[{name}]"
    if action.nargs in ("+", "*"):
        return f"{name} [{name} ...]"
    return name


def cell(text: str) -> str:
    """Text safe inside a markdown table cell: no pipe, no HTML."""
    return text.replace("\\", "\\\\").replace("|", "\\|").replace("<", "&lt;").replace(">", "&gt;")


def code(text: str) -> str:
    return f"`{text}`" if text else ""


def section(name: str, help_line: str, parser: argparse.ArgumentParser) -> list[str]:
    sentence = help_line[:1].upper() + help_line[1:] + ("." if help_line and not help_line.endswith(".") else "")
    lines = [f"## memfit {name}", "", cell(sentence), ""]
    groups = list(options_by_group(parser))
    if not groups:
        return [*lines, "No options.", ""]
    for title, options in groups:
        lines += [f"**{cell(title)}**", "", "| option | value | default | meaning |", "|---|---|---|---|"]
        lines += [f"| {', '.join(code(flag) for flag in option.flags)} | {code(option.metavar)} | "
                  f"{cell(option.default)} | {cell(option.help)} |" for option in options]
        lines.append("")
    return lines


def reference(parser: argparse.ArgumentParser | None = None) -> str:
    """The whole of ``docs/options.md``."""
    parser = parser or build_parser()
    helps = command_helps(parser)
    subparsers = commands(parser)
    lines = ["# Options reference", "",
             f"Every flag of every `memfit` command, generated from the command line's own parser by `{COMMAND}`",
             "(do not edit by hand: rerun it after changing a flag). The default is the one `--help` states;",
             "the pages on each command and topic say what the options trade off. Every command also takes",
             "`-h`, `--help`.", "",
             "| command | what it does |", "|---|---|"]
    lines += [f"| [`memfit {name}`](#memfit-{name}) | {cell(helps.get(name, ''))} |" for name in subparsers]
    lines.append("")
    for name, subparser in subparsers.items():
        lines += section(name, helps.get(name, ""), subparser)
    return "\n".join(lines).rstrip("\n") + "\n"


def documented_flags(parser: argparse.ArgumentParser | None = None, *, with_help: bool = False) -> dict[str, set[str]]:
    """Every option string of every command, by command (``-h``/``--help`` only ``with_help``)."""
    parser = parser or build_parser()
    return {name: {flag for action in subparser._actions for flag in action.option_strings
                   if with_help or not isinstance(action, argparse._HelpAction)}
            for name, subparser in commands(parser).items()}


def main(argv: Sequence[str] | None = None) -> int:
    arguments = argparse.ArgumentParser(prog=COMMAND, description="Write the options reference, docs/options.md.")
    arguments.add_argument("--output", type=Path, default=OUTPUT, help=f"[{OUTPUT}]")
    arguments.add_argument("--check", action="store_true", help="only compare: exit 1 if the file is out of date")
    args = arguments.parse_args(argv)
    text = reference()
    if args.check:
        current = args.output.read_text(encoding="utf-8") if args.output.exists() else ""
        if current != text:
            sys.stderr.write(f"{args.output} is out of date; regenerate it with: {COMMAND}\n")
            return 1
        return 0
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(text, encoding="utf-8")
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
