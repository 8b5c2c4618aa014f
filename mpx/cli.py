"""The ``mpx`` command line: ``mpx --version``, ``mpx policy show SPEC``, ``mpx policy list``, and the
commands other packages register.

The library's own command is ``policy``.  Every other command comes from an entry point in the group
``mpx.commands`` (:data:`COMMANDS_GROUP`) of an installed distribution: the mpx tools (``tools/`` in
the repository, distribution ``mpx-tools``) register ``conformance``, ``bench``, ``doctor``, ``compare``
and ``history``.  An entry point's name is the command; the object it loads provides

- ``help``: one line for ``mpx --help``;
- ``add_arguments(parser)``: adds the command's options to its ``argparse`` parser;
- ``run(args) -> int``: runs it with the parsed arguments and returns the exit status; it may raise
  :class:`UsageError` (or an :class:`mpx.MPXError`) for a user error.

Loading an entry point imports its module when the parser is built, so a command's module imports no
framework at import time (its ``run`` does, or the worker processes it starts).  A command whose entry
point fails to load stays listed in ``mpx --help`` as ``unavailable: importing MODULE failed: ...``,
and running it prints that line and exits 2.  An unknown command exits 2 naming the installed ones.

Every user error exits 2 with one line on stderr and no traceback: bad arguments, an invalid policy,
an ``--out`` that cannot be written, an ``--only`` that matches nothing, and any :class:`mpx.MPXError`
a command raises.  Ctrl-C exits 130.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from importlib.metadata import EntryPoint, entry_points
from typing import NoReturn

from mpx._version import __version__
from mpx.errors import MPXError
from mpx.ops import OP_TABLE
from mpx.policy import CATEGORIES, FP8_PRESETS, PRESET_ALIASES, PRESETS, Policy, get_policy
from mpx.scaling import ScalerConfig

__all__ = ["COMMANDS_GROUP", "UsageError", "build_parser", "main", "registered_commands"]

#: The entry-point group of the commands other distributions add to ``mpx`` (see the module docstring).
COMMANDS_GROUP = "mpx.commands"


class UsageError(Exception):
    """Bad command-line usage (exit status 2)."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{self.prog}: {message}")


def _describe(policy: Policy) -> dict:
    scaler = ScalerConfig.for_policy(policy)
    return {
        "policy": str(policy),
        "name": policy.name,
        "param_dtype": policy.param_dtype,
        "compute_dtype": policy.compute_dtype,
        "output_dtype": policy.output_dtype,
        "reduce_dtype": policy.reduce_dtype,
        "keep_fp32": list(policy.keep_fp32),
        "rules": [{"selector": rule.selector, "policy": str(rule.policy)} for rule in policy.rules()],
        "fp8": None if policy.fp8 is None else policy.fp8.to_dict(),
        "fp8_ops": [op for op in OP_TABLE if OP_TABLE.fp8_applies(op, policy)],
        "loss_scaling": scaler.kind,
        "ops": {
            op: {
                "class": OP_TABLE.classify(op, policy).value,
                "result_dtype": OP_TABLE.result_dtype(op, policy, [policy.param_dtype]),
            }
            for op in OP_TABLE
        },
    }


def _show(args: argparse.Namespace) -> int:
    try:
        policy = get_policy(args.spec)
    except MPXError as err:
        raise UsageError(f"mpx policy show: {err}") from None
    info = _describe(policy)
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    print(f"policy   {info['policy']}" + (f"  ({info['name']})" if info["name"] else ""))
    print(f"params   {policy.param_dtype}")
    print(f"compute  {policy.compute_dtype}")
    print(f"output   {policy.output_dtype}")
    print(f"reduce   {policy.reduce_dtype}  (gradient all-reduce across replicas)")
    print(f"keep_fp32 {'+'.join(policy.keep_fp32) or 'none'}")
    print(f"fp8      {_recipe_text(policy)}")
    print(f"loss scaling (default) {info['loss_scaling']}")
    print("rules (last match wins):" if info["rules"] else "rules: none")
    for rule in info["rules"]:
        print(f"  {rule['selector']:<28} -> {rule['policy']}")
    print(f"ops (result dtype for {policy.param_dtype} inputs):")
    width = max(map(len, OP_TABLE))
    for op, row in info["ops"].items():
        fp8 = "  (FP8 GEMM)" if op in info["fp8_ops"] else ""
        print(f"  {op:<{width}}  {row['class']:<11}  {row['result_dtype']}{fp8}")
    return 0


def _recipe_text(policy: Policy) -> str:
    """One line for a policy's FP8 recipe (``none`` without one)."""
    r = policy.fp8
    if r is None:
        return "none"
    if not hasattr(r, "format"):  # a block-scaled recipe (mpx.blocks, #31)
        return f"block-scaled {r.name or 'custom'}: {r.to_dict()}"
    formats = "e4m3 inputs and weights, e5m2 gradients" if r.format == "hybrid" else "e4m3 everywhere"
    if r.scaling == "delayed":
        scaling = f"delayed scaling (history {r.amax_history_len}, amax {r.amax_compute})"
    else:
        scaling = "current scaling (each tensor's own amax)"
    return (
        f"{r.format} ({formats}); {scaling}, margin {r.margin}, "
        f"power-of-two scales {'on' if r.power_of_two else 'off'}; ops: "
        + ", ".join(op for op in OP_TABLE if OP_TABLE.fp8_applies(op, policy))
    )


def _list(args: argparse.Namespace) -> int:
    for name, policy in PRESETS.items():
        aliases = ", ".join(a for a, target in PRESET_ALIASES.items() if target == name)
        print(f"{name:<15} {policy!s:<48} aliases: {aliases}")
    for name, policy in FP8_PRESETS.items():
        print(f"{name:<15} {policy!s}")
    print(f"categories for keep_fp32 and category: selectors: {', '.join(CATEGORIES)}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="mpx", description="One mixed-precision policy for PyTorch, Keras and JAX.")
    parser.add_argument("--version", action="version", version=f"mpx {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    policy = commands.add_parser("policy", help="inspect policies")
    policy_commands = policy.add_subparsers(dest="policy_command", metavar="SUBCOMMAND", parser_class=_Parser)
    show = policy_commands.add_parser("show", help="print a policy's dtypes, rules and op table")
    show.add_argument(
        "spec", help="a preset (mixed_float16), an alias (bf16-mixed) or keys (params=...,compute=...)"
    )
    show.add_argument("--json", action="store_true", help="print JSON instead of text")
    show.set_defaults(run=_show)
    listing = policy_commands.add_parser("list", help="list the presets and their aliases")
    listing.set_defaults(run=_list)
    for entry in registered_commands():
        command, reason = _load(entry)
        if command is None:  # listed with the reason; running it says why (exit 2)
            sub = commands.add_parser(entry.name, help=f"unavailable: {reason}", add_help=False)
            sub.set_defaults(unavailable=f"mpx {entry.name}: unavailable: {reason}")
            continue
        sub = commands.add_parser(entry.name, help=command.help)
        command.add_arguments(sub)
        sub.set_defaults(run=command.run)
    return parser


def registered_commands() -> list[EntryPoint]:
    """The ``mpx.commands`` entry points of the installed distributions, one per command name, by name.

    ``policy`` is the library's own and cannot be replaced; of two entry points with one name the
    first found is kept.  Nothing is imported here.
    """
    found: dict[str, EntryPoint] = {}
    for entry in entry_points(group=COMMANDS_GROUP):
        if entry.name != "policy":
            found.setdefault(entry.name, entry)
    return [found[name] for name in sorted(found)]


def _load(entry: EntryPoint) -> tuple[object | None, str]:
    """The command object of ``entry`` and "", or None and one line on why it cannot be used."""
    try:
        command = entry.load()
    except ImportError as err:
        return None, _import_failure(entry.module, err)
    except Exception as err:  # a broken module or a misspelled object: the other commands still work
        return None, f"loading {entry.value} failed: {type(err).__name__}: {_first_line(err)}"
    if not (
        isinstance(getattr(command, "help", None), str)
        and callable(getattr(command, "add_arguments", None))
        and callable(getattr(command, "run", None))
    ):
        return None, f"{entry.value} is not an mpx command: it needs help, add_arguments and run"
    return command, ""


def _first_line(err: BaseException) -> str:
    return str(err).splitlines()[0] if str(err) else type(err).__name__


def _import_failure(module: str, err: ImportError) -> str:
    """One line on why ``module`` cannot be imported: the ImportError's message, naming the module."""
    return f"importing {module} failed: {type(err).__name__}: {_first_line(err)}"


def _unknown_command(name: str, installed: Sequence[str]) -> str:
    """The one-line error for a command no installed package provides."""
    names = list(installed)
    listing = ", ".join(names[:-1]) + f" and {names[-1]}" if len(names) > 1 else names[0]
    return (
        f"mpx: unknown command {name!r}: the installed commands are {listing}; further commands come from "
        f"packages that register {COMMANDS_GROUP!r} entry points, such as the mpx tools "
        "(pip install -e ./tools in a checkout of mpx)"
    )


def _command_names(parser: argparse.ArgumentParser) -> list[str]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return list(action.choices)
    return []


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status."""
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    args = None
    try:
        command = next((a for a in argv if not a.startswith("-")), None)  # mpx's own options take no value
        if command is not None and command not in _command_names(parser):
            raise UsageError(_unknown_command(command, _command_names(parser)))
        args, extra = parser.parse_known_args(argv)
        if getattr(args, "unavailable", None):  # whatever its arguments: they cannot be checked
            raise UsageError(args.unavailable)
        if extra:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        run: Callable[[argparse.Namespace], int] | None = getattr(args, "run", None)
        if run is None:
            if args.command == "policy":
                raise UsageError("mpx policy: a subcommand is required: show SPEC, list")
            raise UsageError(f"mpx: a command is required: {', '.join(_command_names(parser))}")
        return run(args)
    except UsageError as err:
        print(str(err), file=sys.stderr)
        return 2
    except MPXError as err:  # bad input that a command only found out while running
        command = getattr(args, "command", None)
        print(f"mpx{' ' + command if command else ''}: {str(err).splitlines()[0]}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # pragma: no cover - interactive
        print("mpx: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # pragma: no cover - `mpx policy show x | head`
        return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
