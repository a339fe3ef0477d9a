"""Write docs/arguments.md, the flag reference of pretrain_gpt.py, from its argument parser.

    python tools/write_arguments_doc.py            # (re)write docs/arguments.md
    python tools/write_arguments_doc.py --check    # exit 1 if docs/arguments.md is stale

The page has one table per argument group of `megatron.arguments.build_parser()`, DeepSpeed's
own flags included, with each flag's value, default and help, and at the end the engine x
feature table of `megatron.compatibility` and the status of every flag Megatron-LM's example
scripts use (their command lines kept in tests/compat/megatron_lm/). It is byte-deterministic: no
dates, no paths, no terminal-width wrapping, and `--local-rank`'s default is shown as it is
without a launcher (LOCAL_RANK unset). tests/tools/test_arguments_doc.py fails when it is stale.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Iterator

REPO_ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir))
sys.path.insert(0, REPO_ROOT)

DOC_PATH = os.path.join("docs", "arguments.md")
# Megatron-LM's example scripts' command lines, each with its source path and commit.
RECIPES_DIR = os.path.join(REPO_ROOT, "tests", "compat", "megatron_lm")
DEFAULT_OUTPUT = os.path.join(REPO_ROOT, DOC_PATH)
PROG = "pretrain_gpt.py"
# Flag defaults read from the environment at parser build time (the launcher's local rank).
LAUNCHER_ENVIRONMENT = ("LOCAL_RANK",)
# Python < 3.10 titles the optionals group "optional arguments"; keep the page the same.
_GROUP_TITLES = {"optional arguments": "options"}
_FLAG_ACTIONS = (
    argparse._StoreTrueAction,
    argparse._StoreFalseAction,
    argparse._StoreConstAction,
    argparse._AppendConstAction,
    argparse._CountAction,
    argparse._HelpAction,
    argparse._VersionAction,
    argparse.BooleanOptionalAction,
)


@contextlib.contextmanager
def _without_launcher_environment() -> Iterator[None]:
    saved = {name: os.environ.pop(name) for name in LAUNCHER_ENVIRONMENT if name in os.environ}
    try:
        yield
    finally:
        os.environ.update(saved)


def build_doc_parser() -> argparse.ArgumentParser:
    """pretrain_gpt.py's parser, built as without a launcher so defaults do not vary."""
    from megatron.arguments import build_parser

    with _without_launcher_environment():
        parser = build_parser()
    parser.prog = PROG
    return parser


def expand_help(action: argparse.Action) -> str:
    """The action's help with `%(default)s`-style fields filled in, as argparse does.

    Whitespace runs collapse to single spaces; `%(prog)s` is always pretrain_gpt.py.
    """
    params = dict(vars(action), prog=PROG)
    for name in list(params):
        if params[name] is argparse.SUPPRESS:
            del params[name]
        elif hasattr(params[name], "__name__"):
            params[name] = params[name].__name__
    if params.get("choices") is not None:
        params["choices"] = ", ".join(str(choice) for choice in params["choices"])
    return " ".join(((action.help or "") % params).split())


def _type_name(action: argparse.Action) -> str:
    return getattr(action.type, "__name__", "str") if action.type is not None else "str"


def format_value(action: argparse.Action) -> str:
    """What the flag takes: `flag` for switches, else choices, metavar or type, with nargs."""
    if isinstance(action, _FLAG_ACTIONS):
        return "flag"
    if action.choices is not None:
        one = "{" + ",".join(str(choice) for choice in action.choices) + "}"
    elif isinstance(action.metavar, str):
        one = action.metavar
    else:
        one = _type_name(action)
    nargs = action.nargs
    if isinstance(action.metavar, tuple):
        return " ".join(action.metavar) + f" ({_type_name(action)})"
    if nargs is None or nargs == 1:
        return one
    if nargs == "?":
        return f"[{one}]"
    if nargs == "*":
        return f"[{one} ...]"
    if nargs == "+":
        return f"{one} [{one} ...]"
    if isinstance(nargs, int):
        return " ".join([one] * nargs)
    return f"{one} ({nargs})"


def format_default(action: argparse.Action) -> str:
    """The default as a Markdown cell: `off` for a switch, empty when there is none."""
    if isinstance(action, (argparse._HelpAction, argparse._VersionAction)):
        return ""
    if isinstance(action, _FLAG_ACTIONS) and not isinstance(action, argparse.BooleanOptionalAction):
        return "off"
    if action.default is None or action.default is argparse.SUPPRESS:
        return ""
    default = action.default
    if isinstance(default, (list, tuple)):
        text = " ".join(str(item) for item in default)
    else:
        text = str(default)
    return f"`{text}`"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _group_title(group: argparse._ArgumentGroup) -> str:
    return _GROUP_TITLES.get(group.title or "", group.title or "options")


def render_arguments_markdown(parser: argparse.ArgumentParser) -> str:
    """The whole docs/arguments.md page for `parser`: one flag table per argument group."""
    lines = [
        f"# `{PROG}` flags",
        "",
        f"Generated by `python tools/write_arguments_doc.py` from the parser of `{PROG}` "
        "(`megatron.arguments.build_parser()`, DeepSpeed's flags included); do not edit by "
        "hand. `python tools/write_arguments_doc.py --check` exits 1 when this file is stale.",
    ]
    for group in parser._action_groups:
        actions = [action for action in group._group_actions if action.help != argparse.SUPPRESS]
        if not actions:
            continue
        lines += ["", f"## {_cell(_group_title(group))}", ""]
        if group.description:
            lines += [_cell(" ".join(group.description.split())), ""]
        lines += ["| flag | value | default | description |", "| --- | --- | --- | --- |"]
        for action in actions:
            flags = ", ".join(f"`{option}`" for option in action.option_strings) or (
                f"`{action.dest}`"
            )
            cells = (flags, format_value(action), format_default(action), expand_help(action))
            lines.append("| " + " | ".join(_cell(cell) for cell in cells) + " |")
    return "\n".join(lines + _engines_section() + _recipes_section(parser)) + "\n"


def _engines_section() -> list[str]:
    """Which engine runs which feature, from `megatron.compatibility.FEATURES` (the table the
    flag checks and the planner's suggestions read)."""
    from megatron.compatibility import markdown_table
    from megatron.layout import Engine

    engines = "; ".join(f"`{engine.value}`: {engine.description}" for engine in Engine)
    return [
        "",
        "## Engines and features",
        "",
        "The flags pick one engine per run (`megatron.layout.choose_engine`): "
        f"{engines}. A feature its engine does not run is refused in one line naming the "
        "flag (`megatron.compatibility`).",
        "",
        markdown_table(),
    ]


def _recipe_flags() -> tuple[list[str], dict[str, list[str]]]:
    """(each script's source line, {flag: the scripts using it}) of the captured recipes."""
    import glob
    import json

    sources, users = [], {}
    for path in sorted(glob.glob(os.path.join(RECIPES_DIR, "*.json"))):
        with open(path, encoding="utf-8") as file:
            script = json.load(file)
        repository, _, where = script["source"].partition(":")
        name = where.removeprefix("examples/")
        sources.append(
            f"- `{name}` ({repository.split('@')[0]} at {repository.split('@')[1][:12]}, "
            f"{script['world_size']} ranks)"
        )
        for token in script["argv"]:
            if token.startswith("--"):
                users.setdefault(token, [])
                if name not in users[token]:
                    users[token].append(name)
    return sources, users


def _flag_status(parser: argparse.ArgumentParser, flag: str) -> str:
    """What this parser does with `flag`: built, accepted without effect, or refused (why)."""
    from megatron.arguments.compat_flags import INERT, REFUSED

    rows = {row.option: row for row in INERT + REFUSED}
    if flag in rows:
        row = rows[flag]
        kind = "refused unless off" if row.refused and row.accepts else "refused"
        return f"{kind}: {row.reason}" if row.refused else f"accepted without effect: {row.reason}"
    if flag not in parser._option_string_actions:
        return "unknown here"
    return "built (see its group above)"


def _recipes_section(parser: argparse.ArgumentParser) -> list[str]:
    """Every flag of Megatron-LM's captured example scripts with its status here."""
    sources, users = _recipe_flags()
    lines = [
        "",
        "## Megatron-LM's example scripts",
        "",
        "The command lines of Megatron-LM's example scripts, kept in tests/compat/megatron_lm/ "
        "and checked by tests/compat/test_megatron_lm_*.py (each validates at the smallest "
        "world that holds its layout, or stops in one line naming what is not built):",
        "",
        *sources,
        "",
        "| flag | scripts | status |",
        "| --- | --- | --- |",
    ]
    for flag in sorted(users):
        scripts = ", ".join(f"`{name}`" for name in users[flag])
        # Without backticks: the groups' tables above hold each flag's one code span.
        cells = (flag, scripts, _flag_status(parser, flag))
        lines.append("| " + " | ".join(_cell(cell) for cell in cells) + " |")
    return lines


def get_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse the command line."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--output",
        default=DEFAULT_OUTPUT,
        help=f"where to write the page (default: {DOC_PATH} in the repository)",
    )
    parser.add_argument(
        "--check",
        action="store_true",
        help="write nothing; exit 1 if the file differs from a fresh render or is missing",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point."""
    args = get_args(argv)
    text = render_arguments_markdown(build_doc_parser())
    if args.check:
        try:
            with open(args.output, encoding="utf-8", newline="") as file:
                current = file.read()
        except FileNotFoundError:
            current = None
        default = os.path.abspath(args.output) == DEFAULT_OUTPUT
        name, rerun = (DOC_PATH, "") if default else (args.output, f" --output {args.output}")
        if current != text:
            print(
                f"error: {name} is stale; run python tools/write_arguments_doc.py{rerun}",
                file=sys.stderr,
            )
            return 1
        print(f"{name} is up to date", file=sys.stderr)
        return 0
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    with open(args.output, "w", encoding="utf-8", newline="\n") as file:
        file.write(text)
    print(f"wrote {args.output}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
