#!/usr/bin/env python3
"""Convert the MindSpore seed's rank table (rank_table_16pcs.json) into a DeepSpeed hostfile.

    python run_scripts/rank_table_to_hostfile.py run_scripts/rank_tables/rank_table_16pcs.json -o hostfile
    bash run_scripts/run_cluster.sh DATA.tsv hostfile recipes/16pcs/16pcs.json

Each server_list entry becomes one line `SERVER_ID slots=<number of devices>`, in server_list order, which is the
order DeepSpeed numbers ranks in. The table's rank_ids must therefore count 0, 1, 2, … server after server; a table
that numbers them otherwise (or misses server_id / device / rank_id, or disagrees with server_count) is rejected
with one `error:` line naming the entry. device_ip and host_nic_ip (HCCL settings) have no DeepSpeed counterpart:
NCCL finds the network itself (set NCCL_SOCKET_IFNAME to pin an interface).
"""

from __future__ import annotations

import argparse
import os
import sys

try:
    from common.script_entry import require_own_checkout
except ModuleNotFoundError:  # no package to import: one line, not a traceback
    print(
        "error: this checkout's Python packages are not installed (or an older copy is): run `pip install -e .` "
        "in the checkout (README), or set PYTHONPATH to its folder",
        file=sys.stderr,
    )
    sys.exit(2)
require_own_checkout(__file__)  # and it is this checkout's (common/script_entry.py)

from common.errors import UserError, run_cli
from common.user_files import refuse_output_over_inputs
from training.plan.cluster import format_hostfile, read_rank_table


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="rank_table_to_hostfile.py", description=__doc__.split("\n\n")[0])
    p.add_argument("rank_table", help="the seed's rank table JSON (server_list[].server_id, device[])")
    p.add_argument("-o", "--output", default="-", help="hostfile to write (default: standard output)")
    args = p.parse_args(argv)
    hosts = read_rank_table(args.rank_table)
    text = format_hostfile(
        hosts,
        header=f"DeepSpeed hostfile from {os.path.basename(args.rank_table)}: "
        f"{len(hosts)} node(s), {sum(h.slots for h in hosts)} ranks",
    )
    if args.output == "-":
        sys.stdout.write(text)
        return 0
    out_dir = os.path.dirname(os.path.abspath(args.output))
    if not os.path.isdir(out_dir):
        raise UserError(f"-o {args.output}: folder {out_dir} does not exist")
    refuse_output_over_inputs(args.output, "-o", [(f"the rank table {args.rank_table}", args.rank_table)])
    with open(args.output, "w", encoding="utf-8") as f:
        f.write(text)
    print(f"wrote {args.output}: " + ", ".join(f"{h.name} slots={h.slots}" for h in hosts), file=sys.stderr)
    return 0


if __name__ == "__main__":
    run_cli(main)
