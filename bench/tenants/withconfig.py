"""Run a command whose ``--config FILE`` first gets a ``tenants`` section:
``python bench/tenants/withconfig.py TENANTS_JSON COMMAND...``.

``bench.proxy.run.start_pdscope`` writes the proxy's config itself and takes a ``wrap`` (argv put before
the command); this script is that wrap: it writes FILE with the section into a sibling file and execs
the command on it, so the process the ceiling measures (by its pid's CPU seconds) is the proxy itself.
Run by its path, not as a module: it imports nothing of the repository, so it serves another checkout's
proxy (``--proxy-tree``) as well.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import yaml


def main(argv: list[str]) -> None:
    section, cmd = json.loads(argv[0]), list(argv[1:])
    at = cmd.index("--config") + 1
    src = Path(cmd[at])
    config = yaml.safe_load(src.read_text(encoding="utf-8"))
    config["tenants"] = section
    dst = src.with_name(src.stem + ".tenants.yaml")
    dst.write_text(yaml.safe_dump(config, sort_keys=False), encoding="utf-8")
    cmd[at] = str(dst)
    os.execv(cmd[0], cmd)


if __name__ == "__main__":
    main(sys.argv[1:])
