"""``add_config_arguments``: DeepSpeed's command-line flags on a script's own argument parser."""

from __future__ import annotations

import argparse


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add ``--deepspeed``, ``--deepspeed_config`` (and the deprecated ``--deepscale*``), as DeepSpeed does.

    ``initialize(args=args)`` then reads the config from ``args.deepspeed_config``.

    Args:
        parser: the script's parser.

    Returns:
        The same parser.
    """
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations")
    group.add_argument("--deepspeed", default=False, action="store_true",
                       help="Enable DeepSpeed (helper flag for user code, no impact on the engine)")
    group.add_argument("--deepspeed_config", default=None, type=str, help="DeepSpeed json configuration file.")
    group.add_argument("--deepscale", default=False, action="store_true", help="Deprecated alias of --deepspeed")
    group.add_argument("--deepscale_config", default=None, type=str, help="Deprecated alias of --deepspeed_config")
    return parser
