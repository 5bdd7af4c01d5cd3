"""Write docs/zero-cache.md's plan table and its example plan from what ``pretrain.py --plan`` prints.

    python tools/plan_table.py            # rewrite them in docs/zero-cache.md
    python tools/plan_table.py --check    # exit 1 if the page is not what --plan prints now

Each cell is rank 0's plan of one shipped config on one named machine, run through ``pretrain.py``'s own
``--plan`` path: the bound line's stream and time as printed ("bound: H2D, at least 1.053 s per step" gives
"H2D, 1.053 s"), or the refusal's tier and shortfall ("the host tier needs ... (short by 59.91 GiB)" gives
"refused: host short by 59.91 GiB"). ``tests/unit/test_plan_configs.py`` fails when the page is stale.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "zero-cache.md"
REGENERATE = "python tools/plan_table.py"
CONFIGS = ("gpt_1.3b", "llama_7b", "llama_13b", "llama_30b")
MACHINES = (
    # (--gpus, --device-memory, --host-memory, --nvme)
    (1, "24GiB", "128GiB", "2TB"),   # a workstation card (RTX 4090 / A10 class)
    (1, "80GiB", "256GiB", "4TB"),   # one A100/H100 80GB
    (8, "80GiB", "1TiB", "8TB"),     # an 8-GPU server (cloud p4de/p5 class; a DGX has 2 TiB)
)
TABLE_HEADER = "| rank 0's plan: the step's bound |"
"""How the table's first line starts: the page's table is that line and the ones after it up to a blank line."""
EXAMPLE = ("llama_7b", MACHINES[0], False)
"""The plan the page prints in full, after a line ``$ <its command>``."""
_BOUND = re.compile(r"bound: (?P<stream>[^,]+), at least (?P<time>\S+ \S+) per step")
_REFUSED = re.compile(r"the (?P<tier>\w+) tier needs .*?\(short by (?P<short>[\d.]+ \w+)\)")


def plan_arguments(config: str, machine: tuple, nvme: bool) -> list[str]:
    gpus, device_memory, host_memory, drive = machine
    arguments = ["--config", f"configs/{config}.json", "--plan", "--gpus", str(gpus), "--device-memory",
                 device_memory, "--host-memory", host_memory]
    return arguments + (["--nvme", drive] if nvme else [])


def plan_output(arguments: list[str]) -> str:
    """What ``python pretrain.py ARGUMENTS`` prints on stdout, run in this process (``--config`` relative to the
    repository's root)."""
    sys.path.insert(0, str(ROOT))
    import pretrain

    at = arguments.index("--config") + 1
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = pretrain.main([*arguments[:at], str(ROOT / arguments[at]), *arguments[at + 1:]])
    text = out.getvalue()
    if code not in (0, 2):
        raise RuntimeError(f"pretrain.py {' '.join(arguments)} exited {code}:\n{text}")
    return text


def cell(text: str) -> str:
    """The table's cell for one plan's output."""
    bound, refused = _BOUND.search(text), _REFUSED.search(text)
    if bound:
        return f"{bound['stream']}, {bound['time']}"
    if refused:
        return f"refused: {refused['tier']} short by {refused['short']}"
    raise ValueError(f"neither a bound nor a refusal in --plan's output:\n{text}")


def table() -> list[str]:
    """The page's table, one row per config, a column per machine without and with its drive."""
    header, rule = TABLE_HEADER, "|---|"
    for gpus, device_memory, host_memory, drive in MACHINES:
        header += f" {gpus}x {device_memory} GPU, {host_memory} RAM | + {drive} NVMe |"
        rule += "---|---|"
    rows = [header, rule]
    for config in CONFIGS:
        cells = [cell(plan_output(plan_arguments(config, machine, nvme))) for machine in MACHINES
                 for nvme in (False, True)]
        rows.append(f"| `{config}` | " + " | ".join(cells) + " |")
    return rows


def render(page: str) -> str:
    """``page`` with its table and its example plan replaced by what ``--plan`` prints now."""
    lines = page.split("\n")
    start = next(index for index, line in enumerate(lines) if line.startswith(TABLE_HEADER))
    end = lines.index("", start)
    lines[start:end] = table()
    command = "$ python pretrain.py " + " ".join(plan_arguments(*EXAMPLE))
    start = lines.index(command) + 1
    end = lines.index("```", start)
    lines[start:end] = plan_output(plan_arguments(*EXAMPLE)).rstrip("\n").split("\n")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the page is stale; write nothing")
    args = parser.parse_args()
    page = PAGE.read_text()
    fresh = render(page)
    if args.check:
        if fresh != page:
            print(f"{PAGE} is stale: run {REGENERATE}", file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(fresh)
    print(f"wrote {PAGE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
