"""The entry point of a deploy bundle's `run` (python -m compiler bundle): the bundle's model and artifact, run here.

    OUT/run generate PROMPT [MAX_NEW_TOKENS] [RUNS] [--model DIR] [options of python -m runtime.generate]
    OUT/run chat [--model DIR] [options of python -m runtime.chat]

`--model DIR` names the checkpoint when the bundle was made without its weights (--no-weights).
The Python version is checked before anything compiled is imported: the bundle's packages are for one.
"""

import json
import sys
from importlib import import_module
from pathlib import Path

COMMANDS = {"generate": "runtime.generate", "chat": "runtime.chat"}
USAGE = "usage: run {generate PROMPT [MAX_NEW_TOKENS] [RUNS] | chat} [--model DIR] [options]"


def main(argv: list) -> int:
    """Run `argv` = [bundle folder, command, arguments...]; returns the exit status."""
    root, args = Path(argv[0]), argv[1:]
    info = json.loads((root / "bundle.json").read_text())
    here = "%d.%d" % sys.version_info[:2]
    if here != info["python"]:
        print(f"error: this bundle's packages are for Python {info['python']}, and {sys.executable} is Python "
              f"{here}; set RUDA_PYTHON to a Python {info['python']} interpreter, or bundle again with --python {here}",
              file=sys.stderr)
        return 2
    if not args or args[0] not in COMMANDS:
        print(f"{USAGE}\nerror: the first argument must be one of: {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    command, rest = args[0], args[1:]
    model = root / info["model"]
    if "--model" in rest:
        at = rest.index("--model")
        if at + 1 >= len(rest):
            print(f"{USAGE}\nerror: --model needs a directory", file=sys.stderr)
            return 2
        model, rest = Path(rest[at + 1]), rest[:at] + rest[at + 2:]
    from ir.errors import run_cli

    cli = import_module(COMMANDS[command])
    return run_cli(cli.main, [str(model), *rest, "--artifact", str(root / info["artifact"]),
                              "--device", info["device"]])
